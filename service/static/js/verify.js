// Verify: two photos, the face used in each boxed, the score on a scale with the threshold.

import { api, oneIn, score, showError } from "./api.js";
import { element, FacePhoto, PhotoInput } from "./photos.js";

/** The score on a 0..1 scale with the threshold marked (negative scores sit at 0). */
function drawScale(container, value, threshold, far) {
  const position = (v) => `${(Math.min(Math.max(v, 0), 1) * 100).toFixed(1)}%`;
  const bar = element("div", { class: "bar" });
  const fill = element("div", { class: "fill" });
  fill.style.width = position(value);
  bar.append(fill);
  if (threshold !== null) {
    // the label hangs to the side with room, so that it never runs off a phone's screen
    const mark = element("div", { class: `threshold ${threshold > 0.5 ? "toward-left" : "toward-right"}` });
    mark.style.left = position(threshold);
    mark.append(element("span", {}, `threshold ${score(threshold)}${far ? ` · ${oneIn(far)} false accepts` : ""}`));
    bar.append(mark);
  }
  const marker = element("div", { class: "marker" });
  marker.style.left = position(value);
  bar.append(marker);
  const ticks = element("div", { class: "ticks", "aria-hidden": "true" });
  for (const tick of ["0", "0.25", "0.5", "0.75", "1"]) ticks.append(element("span", {}, tick));
  const words = threshold === null
    ? `score ${score(value)} on a scale from 0 to 1`
    : `score ${score(value)} on a scale from 0 to 1; the threshold is ${score(threshold)}`;
  container.replaceChildren(bar, ticks);
  container.setAttribute("role", "img");
  container.setAttribute("aria-label", words);
}

function explain(result) {
  const words = [`Cosine similarity of the two faces: ${score(result.score)} (1 is identical, 0 unrelated).`];
  if (result.threshold === null) {
    words.push("This model has no calibrated threshold, so the service makes no decision.");
  } else {
    const far = result.threshold_far ? ` It was set so that about ${oneIn(result.threshold_far)} pairs of different people pass (false-accept rate ${result.threshold_far}).` : "";
    words.push(`Pairs at or above ${score(result.threshold)} are taken as the same person.${far}`);
  }
  words.push(`Model: ${result.model_id}.`);
  return words.join(" ");
}

export function setUpVerify(app) {
  const run = document.getElementById("verify-run");
  const busy = document.getElementById("verify-busy");
  const error = document.getElementById("verify-error");
  const result = document.getElementById("verify-result");
  const decision = document.getElementById("verify-decision");
  const slots = [1, 2].map((n) => {
    const parent = document.getElementById(`verify-slot-${n}`);
    const slot = {};
    slot.input = new PhotoInput(parent, {
      id: `verify-photo-${n}`,
      label: `Photo ${n}`,
      onChange: async (files) => {
        result.hidden = true;
        showError(error, null);
        slot.photo.clearFaces();
        if (files.length) await slot.photo.show(files[0]);
        else slot.photo.hide();
        run.disabled = !slots.every((s) => s.input.files.length);
      },
    });
    slot.photo = new FacePhoto(parent);
    return slot;
  });

  run.addEventListener("click", async () => {
    const form = new FormData();
    form.append("photo1", slots[0].input.files[0]);
    form.append("photo2", slots[1].input.files[0]);
    run.disabled = true;
    busy.hidden = false;
    result.hidden = true;
    showError(error, null);
    try {
      const answer = await api("v1/verify", { method: "POST", form });
      answer.faces.forEach((face, i) => {
        slots[i].photo.drawFaces([face], () => ({ kind: "used", title: `the face compared (detection ${face.detection_score.toFixed(2)})` }));
      });
      decision.className = "decision";
      if (answer.same_person === null) {
        decision.textContent = "No decision";
        decision.classList.add("none");
      } else if (answer.same_person) {
        decision.textContent = "Same person";
        decision.classList.add("same");
      } else {
        decision.textContent = "Different people";
        decision.classList.add("different");
      }
      drawScale(document.getElementById("verify-scale"), answer.score, answer.threshold, answer.threshold_far);
      document.getElementById("verify-explain").textContent = explain(answer);
      result.hidden = false;
      result.scrollIntoView({ block: "nearest", behavior: "smooth" });
    } catch (exc) {
      showError(error, exc);
      app.noteError(exc);
    } finally {
      busy.hidden = true;
      run.disabled = !slots.every((s) => s.input.files.length);
    }
  });
}
