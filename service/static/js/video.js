// Video: a clip's people as tracks, one decision each, with the best frame of each when the
// browser can play the clip.

import { api, oneIn, score, showError } from "./api.js";
import { element } from "./photos.js";

const THUMB = 96; // pixels of a track's thumbnail

function trackName(track) {
  return track.status === "known" ? track.name || track.subject_id : "unknown";
}

function seconds(value) {
  return `${value.toFixed(1)} s`;
}

function summary(answer) {
  const known = answer.tracks.filter((t) => t.status === "known").length;
  const count = answer.tracks.length;
  const words = [`${count} ${count === 1 ? "person" : "people"} seen: ${known} known, ${count - known} unknown.`];
  words.push(`${answer.frames} frames at ${answer.sample_fps} per second, ${answer.faces} faces, ${answer.embedded} embedded.`);
  const far = answer.threshold_far ? ` (${oneIn(answer.threshold_far)} false matches per comparison)` : "";
  words.push(`A person is known at a score of ${score(answer.threshold)} or more${far}.`);
  if (answer.short_tracks) words.push(`${answer.short_tracks} face${answer.short_tracks === 1 ? "" : "s"} seen too briefly to decide.`);
  return words.join(" ");
}

/** The best face of a track cut from the clip at its time, or nothing when it cannot be played. */
async function thumbnail(video, track) {
  const [x1, y1, x2, y2] = track.best_face.box;
  const side = Math.max(x2 - x1, y2 - y1) * 1.4;
  try {
    await new Promise((resolve, reject) => {
      video.onseeked = resolve;
      video.onerror = reject;
      video.currentTime = track.best_face.time_s;
    });
  } catch {
    return null;
  }
  const canvas = element("canvas", { width: THUMB, height: THUMB, class: "track-thumb", role: "img",
    "aria-label": `best face of ${trackName(track)} at ${seconds(track.best_face.time_s)}` });
  const cx = (x1 + x2) / 2, cy = (y1 + y2) / 2;
  canvas.getContext("2d").drawImage(video, cx - side / 2, cy - side / 2, side, side, 0, 0, THUMB, THUMB);
  return canvas;
}

function trackItem(track) {
  const item = element("li", { class: `face-item track ${track.status}`, tabindex: "0" });
  const title = element("p", { class: "who" });
  title.append(element("strong", {}, trackName(track)));
  title.append(` · ${seconds(track.start_s)} to ${seconds(track.end_s)}`);
  if (track.score !== null) title.append(` · score ${score(track.score)}`);
  item.append(title);
  const detail = `${track.faces} faces seen, decided on the best ${track.decided_on}`;
  const cluster = track.cluster_id ? " · kept with the unknown people" : "";
  item.append(element("p", { class: "hint" }, detail + cluster));
  return item;
}

export function setUpVideo(app) {
  const input = document.getElementById("video-file");
  const rate = document.getElementById("video-fps");
  const run = document.getElementById("video-run");
  const busy = document.getElementById("video-busy");
  const error = document.getElementById("video-error");
  const result = document.getElementById("video-result");
  const list = document.getElementById("video-tracks");
  const video = document.getElementById("video-preview");
  let url = null;

  input.addEventListener("change", () => {
    result.hidden = true;
    showError(error, null);
    run.disabled = !input.files.length;
    if (url) URL.revokeObjectURL(url);
    url = input.files.length ? URL.createObjectURL(input.files[0]) : null;
    if (url) video.src = url;
  });

  run.addEventListener("click", async () => {
    const form = new FormData();
    form.append("video", input.files[0]);
    run.disabled = true;
    busy.hidden = false;
    result.hidden = true;
    showError(error, null);
    try {
      const answer = await api("v1/identify/video", { method: "POST", form, query: { sample_fps: rate.value } });
      document.getElementById("video-summary").textContent = summary(answer);
      list.replaceChildren(...answer.tracks.map(trackItem));
      result.hidden = false;
      for (const [index, track] of answer.tracks.entries()) {
        const thumb = await thumbnail(video, track);
        if (thumb) list.children[index].prepend(thumb);
      }
    } catch (exc) {
      showError(error, exc);
      app.noteError(exc);
    } finally {
      busy.hidden = true;
      run.disabled = !input.files.length;
    }
  });
}
