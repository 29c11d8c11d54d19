// Choosing photos (file, drop, camera) and showing a photo with its faces boxed.

const SVG = "http://www.w3.org/2000/svg";

function element(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

function svgElement(tag, attributes = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

/** The camera dialog of the page, shared by every photo input; resolves to a File or null. */
async function takePhoto() {
  const dialog = document.getElementById("camera-dialog");
  const video = document.getElementById("camera-video");
  const error = document.getElementById("camera-error");
  const take = document.getElementById("camera-take");
  const cancel = document.getElementById("camera-cancel");
  error.hidden = true;
  take.disabled = true;
  dialog.showModal();
  let stream = null;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ video: { facingMode: "user" }, audio: false });
    video.srcObject = stream;
    take.disabled = false;
    take.focus();
  } catch (exc) {
    error.textContent = `The camera cannot be used: ${exc.message || exc.name}. Choose a photo file instead.`;
    error.hidden = false;
    cancel.focus();
  }
  const photo = await new Promise((resolve) => {
    const finish = (value) => {
      take.onclick = cancel.onclick = dialog.onclose = null;
      resolve(value);
    };
    cancel.onclick = () => finish(null);
    dialog.onclose = () => finish(null);
    take.onclick = () => {
      const canvas = document.createElement("canvas");
      canvas.width = video.videoWidth;
      canvas.height = video.videoHeight;
      canvas.getContext("2d").drawImage(video, 0, 0);
      canvas.toBlob(
        (blob) => finish(blob ? new File([blob], `camera-${Date.now()}.jpg`, { type: "image/jpeg" }) : null),
        "image/jpeg",
        0.92,
      );
    };
  });
  if (stream) for (const track of stream.getTracks()) track.stop();
  video.srcObject = null;
  if (dialog.open) dialog.close();
  return photo;
}

/**
 * A place to choose photos: a file input (keyboard and screen readers), a drop zone around it
 * and, where the browser has a camera, a button to take one. `onChange(files)` gets the photos.
 */
export class PhotoInput {
  constructor(parent, { id, label, multiple = false, onChange }) {
    this.multiple = multiple;
    this.onChange = onChange;
    this.files = [];
    this.root = element("div", { class: "photo-input" });
    this.zone = element("label", { class: "drop", for: id });
    this.zone.append(element("span", { class: "drop-label" }, label));
    this.zone.append(element("span", { class: "hint" }, multiple ? "choose photos, or drop them here" : "choose a photo, or drop it here"));
    this.input = element("input", { type: "file", id, accept: "image/*" });
    this.input.multiple = multiple;
    this.zone.append(this.input);
    this.root.append(this.zone);
    if (navigator.mediaDevices && navigator.mediaDevices.getUserMedia) {
      const camera = element("button", { type: "button", class: "quiet camera" }, "Use the camera");
      camera.setAttribute("aria-label", `${label}: take a photo with the camera`);
      camera.addEventListener("click", async () => {
        const photo = await takePhoto();
        if (photo) this.set(this.multiple ? [...this.files, photo] : [photo]);
      });
      this.root.append(camera);
    }
    this.input.addEventListener("change", () => this.set([...this.input.files]));
    for (const type of ["dragenter", "dragover"]) {
      this.zone.addEventListener(type, (event) => {
        event.preventDefault();
        this.zone.classList.add("over");
      });
    }
    for (const type of ["dragleave", "drop"]) {
      this.zone.addEventListener(type, () => this.zone.classList.remove("over"));
    }
    this.zone.addEventListener("drop", (event) => {
      event.preventDefault();
      const dropped = [...event.dataTransfer.files];
      if (dropped.length) this.set(this.multiple ? dropped : dropped.slice(0, 1));
    });
    parent.append(this.root);
  }

  set(files) {
    this.files = files;
    this.onChange(files);
  }

  clear() {
    this.input.value = "";
    this.files = [];
  }
}

/** A photo with an SVG layer on top for face boxes, landmarks and labels. */
export class FacePhoto {
  constructor(parent, { caption = "" } = {}) {
    this.figure = element("figure", { class: "face-photo" });
    this.frame = element("div", { class: "frame" });
    this.img = element("img", { alt: "" });
    this.layer = svgElement("svg", { class: "faces", "aria-hidden": "true" });
    this.frame.append(this.img, this.layer);
    this.caption = element("figcaption", {}, caption);
    this.figure.append(this.frame, this.caption);
    this.figure.hidden = true;
    this.url = null;
    parent.append(this.figure);
  }

  /** Show a file; resolves false when the browser cannot show it (the API still gets to judge it). */
  async show(file, caption) {
    this.clearFaces();
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = URL.createObjectURL(file);
    this.caption.textContent = caption || file.name;
    this.figure.hidden = false;
    this.frame.hidden = false;
    this.img.alt = `photo ${file.name}`;
    this.img.src = this.url;
    try {
      await this.img.decode();
      return true;
    } catch {
      this.frame.hidden = true;
      this.caption.textContent = `${file.name}: the browser cannot show this file`;
      return false;
    }
  }

  hide() {
    this.figure.hidden = true;
    this.clearFaces();
  }

  clearFaces() {
    this.layer.replaceChildren();
  }

  /**
   * Box each face with its five landmarks. `describe(face, i)` gives {label, title, kind}: the
   * text over the box, the tooltip, and a class (known, unknown, used).
   */
  drawFaces(faces, describe) {
    this.clearFaces();
    const width = this.img.naturalWidth;
    const height = this.img.naturalHeight;
    if (!width || !height) return;
    this.layer.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const unit = Math.max(width, height) / 100;
    faces.forEach((face, index) => {
      if (!face.box) return;
      const { label, title, kind } = describe(face, index);
      const [x1, y1, x2, y2] = face.box;
      const group = svgElement("g", { class: `face ${kind || ""}`, "data-index": index });
      group.append(svgElement("title"));
      group.firstChild.textContent = title || label || "";
      group.append(svgElement("rect", { x: x1, y: y1, width: x2 - x1, height: y2 - y1, class: "box" }));
      for (const [x, y] of face.landmarks || []) {
        group.append(svgElement("circle", { cx: x, cy: y, r: Math.max(unit * 0.6, (x2 - x1) / 40), class: "landmark" }));
      }
      if (label) {
        const size = Math.max(unit * 3.2, (x2 - x1) / 7);
        const above = y1 - size * 0.35 > size;
        const text = svgElement("text", {
          x: x1,
          y: above ? y1 - size * 0.35 : y2 + size,
          "font-size": size,
          class: "label",
        });
        text.textContent = label;
        group.append(text);
      }
      this.layer.append(group);
    });
  }

  highlight(index) {
    for (const group of this.layer.querySelectorAll("g.face")) {
      group.classList.toggle("highlight", Number(group.dataset.index) === index);
    }
  }
}

export { element };
