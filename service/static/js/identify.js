// Identify: every face of a photo boxed and named (or "unknown"), with its top candidates.

import { api, oneIn, score, showError } from "./api.js";
import { element, FacePhoto, PhotoInput } from "./photos.js";

function faceName(face) {
  return face.status === "known" ? face.name || face.subject_id : "unknown";
}

function candidatesText(face) {
  if (!face.candidates.length) return "no one in the gallery to compare with";
  return face.candidates.map((c) => `${c.name || c.subject_id} ${score(c.score)}`).join(", ");
}

function summary(answer) {
  const known = answer.faces.filter((f) => f.status === "known").length;
  const count = answer.faces.length;
  const words = [`${count} face${count === 1 ? "" : "s"}: ${known} known, ${count - known} unknown.`];
  words.push(`Searched ${answer.gallery_faces} enrolled face${answer.gallery_faces === 1 ? "" : "s"};`);
  const far = answer.threshold_far ? ` (${oneIn(answer.threshold_far)} false matches per comparison)` : "";
  words.push(`a face is known at a score of ${score(answer.threshold)} or more${far}.`);
  if (answer.gallery_faces === 0) words.push("The gallery is empty: add people in the Gallery tab first.");
  return words.join(" ");
}

function faceItem(face, index, photo) {
  const item = element("li", { class: `face-item ${face.status}`, tabindex: "0" });
  const title = element("p", { class: "who" });
  title.append(element("strong", {}, faceName(face)));
  if (face.score !== null) title.append(` · score ${score(face.score)}`);
  item.append(title);
  if (face.candidates.length) {
    const list = element("ol", { class: "candidates", "aria-label": `candidates for face ${index + 1}` });
    for (const c of face.candidates) {
      list.append(element("li", {}, `${c.name || c.subject_id} (${c.subject_id}): ${score(c.score)}`));
    }
    item.append(list);
  } else {
    item.append(element("p", { class: "hint" }, "no one in the gallery to compare with"));
  }
  for (const type of ["mouseenter", "focus"]) item.addEventListener(type, () => photo.highlight(index));
  for (const type of ["mouseleave", "blur"]) item.addEventListener(type, () => photo.highlight(-1));
  return item;
}

export function setUpIdentify(app) {
  const parent = document.getElementById("identify-slot");
  const run = document.getElementById("identify-run");
  const busy = document.getElementById("identify-busy");
  const error = document.getElementById("identify-error");
  const result = document.getElementById("identify-result");
  const list = document.getElementById("identify-faces");
  const input = new PhotoInput(parent, {
    id: "identify-photo",
    label: "Photo",
    onChange: async (files) => {
      result.hidden = true;
      showError(error, null);
      if (files.length) await photo.show(files[0]);
      else photo.hide();
      run.disabled = !files.length;
    },
  });
  const photo = new FacePhoto(parent);

  run.addEventListener("click", async () => {
    const form = new FormData();
    form.append("photo", input.files[0]);
    run.disabled = true;
    busy.hidden = false;
    result.hidden = true;
    showError(error, null);
    photo.clearFaces();
    try {
      const answer = await api("v1/identify", { method: "POST", form });
      photo.drawFaces(answer.faces, (face) => ({
        label: faceName(face),
        title: `${faceName(face)}: ${candidatesText(face)}`,
        kind: face.status,
      }));
      document.getElementById("identify-summary").textContent = summary(answer);
      list.replaceChildren(...answer.faces.map((face, i) => faceItem(face, i, photo)));
      result.hidden = false;
    } catch (exc) {
      showError(error, exc);
      app.noteError(exc);
    } finally {
      busy.hidden = true;
      run.disabled = !input.files.length;
    }
  });
}
