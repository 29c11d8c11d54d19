// Gallery: people with search and paging; add, rename, delete; enroll photos; their faces.

import { api, showError } from "./api.js";
import { element, PhotoInput } from "./photos.js";

const PAGE_SIZE = 20;

/** Short words for each enrollment status of the API (the API's message follows them). */
const ENROLL_STATUS = {
  ok: "Enrolled",
  no_face: "No face",
  multiple_faces: "Several faces",
  duplicate_photo: "Already enrolled",
  unreadable_image: "Not a readable image",
  image_too_large: "Too large",
  subject_not_found: "Person not found",
  invalid_request: "Not accepted",
};

function personName(subject) {
  return subject.name || subject.id;
}

function facesText(count) {
  return `${count} face${count === 1 ? "" : "s"}`;
}

export class Gallery {
  constructor(app) {
    this.app = app;
    this.offset = 0;
    this.query = "";
    this.selected = null;
    this.imageUrls = [];
    this.list = document.getElementById("subjects-list");
    this.count = document.getElementById("subjects-count");
    this.prev = document.getElementById("subjects-prev");
    this.next = document.getElementById("subjects-next");
    this.detail = document.getElementById("subject-detail");
    this.error = document.getElementById("gallery-error");
    this.nextOffset = null;

    let typing = null;
    const search = document.getElementById("subject-query");
    search.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => this.search(search.value), 250);
    });
    document.getElementById("subject-search").addEventListener("submit", (event) => {
      event.preventDefault();
      this.search(search.value);
    });
    this.prev.addEventListener("click", () => this.load(Math.max(0, this.offset - PAGE_SIZE)));
    this.next.addEventListener("click", () => this.nextOffset !== null && this.load(this.nextOffset));
    document.getElementById("subject-create").addEventListener("submit", (event) => {
      event.preventDefault();
      this.create();
    });
  }

  /** Run an API call; show its error under the list (or in `target`), and say whether it worked. */
  async attempt(work, target = this.error) {
    showError(target, null);
    try {
      await work();
      return true;
    } catch (exc) {
      showError(target, exc);
      this.app.noteError(exc);
      return false;
    }
  }

  search(query) {
    this.query = query.trim();
    this.load(0);
  }

  async load(offset = this.offset) {
    // Answers can arrive out of order while a person types: only the latest request is shown.
    const request = (this.loads = (this.loads || 0) + 1);
    await this.attempt(async () => {
      const page = await api("v1/subjects", { query: { offset, limit: PAGE_SIZE, q: this.query } });
      if (request !== this.loads) return;
      this.offset = offset;
      this.nextOffset = page.next_offset;
      this.renderList(page);
    });
  }

  renderList(page) {
    const items = page.subjects.map((subject) => {
      const item = element("li");
      const button = element("button", { type: "button", class: "subject", "data-id": subject.id });
      button.append(element("span", { class: "name" }, personName(subject)));
      button.append(element("span", { class: "meta" }, `${subject.id} · ${facesText(subject.face_count)}`));
      if (this.selected && this.selected.id === subject.id) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => this.select(subject.id));
      item.append(button);
      return item;
    });
    this.list.replaceChildren(...items);
    const what = this.query ? ` matching “${this.query}”` : "";
    if (page.total === 0) {
      this.count.textContent = this.query ? `No one matches “${this.query}”.` : "No one in the gallery yet: add a person below.";
    } else {
      const last = page.offset + page.subjects.length;
      this.count.textContent = `${page.offset + 1}–${last} of ${page.total} ${page.total === 1 ? "person" : "people"}${what}`;
    }
    this.prev.disabled = page.offset === 0;
    this.next.disabled = page.next_offset === null;
  }

  async create() {
    const nameInput = document.getElementById("new-subject-name");
    const idInput = document.getElementById("new-subject-id");
    const body = {};
    if (nameInput.value.trim()) body.name = nameInput.value.trim();
    if (idInput.value.trim()) body.id = idInput.value.trim();
    let created = null;
    const ok = await this.attempt(async () => {
      created = await api("v1/subjects", { method: "POST", json: body });
    });
    if (!ok) return;
    nameInput.value = idInput.value = "";
    await this.load(this.offset);
    await this.select(created.id);
  }

  async select(subjectId) {
    let subject, faces;
    const ok = await this.attempt(async () => {
      let page;
      [subject, page] = await Promise.all([
        api(`v1/subjects/${encodeURIComponent(subjectId)}`),
        api(`v1/subjects/${encodeURIComponent(subjectId)}/faces`, { query: { limit: 1000 } }),
      ]);
      faces = page.faces;
    });
    if (!ok) return;
    this.selected = subject;
    for (const button of this.list.querySelectorAll("button.subject")) {
      if (button.dataset.id === subject.id) button.setAttribute("aria-current", "true");
      else button.removeAttribute("aria-current");
    }
    this.renderDetail(subject, faces);
  }

  renderDetail(subject, faces) {
    for (const url of this.imageUrls) URL.revokeObjectURL(url);
    this.imageUrls = [];
    const admin = this.app.canChange();
    const parts = [];
    const heading = element("h3", { id: "subject-heading", tabindex: "-1" }, personName(subject));
    parts.push(heading);
    parts.push(element("p", { class: "meta" }, `id ${subject.id} · ${facesText(subject.face_count)} for this model`));
    if (subject.face_count_all_models > subject.face_count) {
      parts.push(element("p", { class: "note" }, `${subject.face_count_all_models - subject.face_count} more face(s) were enrolled with another model and are not searched: re-embed them with \`sphereface gallery reembed\`.`));
    }
    const error = element("p", { class: "error", role: "alert", hidden: "" });
    if (admin) parts.push(this.renameForm(subject, error), this.deleteControl(subject, error));
    parts.push(error);
    if (admin) parts.push(this.enrollForm(subject));
    parts.push(this.facesGrid(subject, faces, admin, error));
    this.detail.replaceChildren(...parts);
  }

  renameForm(subject, error) {
    const form = element("form", { class: "inline rename" });
    const id = "rename-input";
    form.append(element("label", { for: id }, "Name"));
    const input = element("input", { id, maxlength: "256" });
    input.value = subject.name || "";
    form.append(input, element("button", { type: "submit" }, "Rename"));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const ok = await this.attempt(async () => {
        await api(`v1/subjects/${encodeURIComponent(subject.id)}`, { method: "PATCH", json: { name: input.value.trim() } });
      }, error);
      if (ok) {
        await this.load();
        await this.select(subject.id);
      }
    });
    return form;
  }

  deleteControl(subject, error) {
    const box = element("div", { class: "inline danger-zone" });
    const ask = element("button", { type: "button", class: "danger" }, "Delete person");
    box.append(ask);
    ask.addEventListener("click", () => {
      const question = element("p", {}, `Delete ${personName(subject)} and ${facesText(subject.face_count_all_models)}? This cannot be undone.`);
      const yes = element("button", { type: "button", class: "danger" }, "Yes, delete");
      const no = element("button", { type: "button", class: "quiet" }, "Keep");
      box.replaceChildren(question, yes, no);
      no.focus();
      no.addEventListener("click", () => {
        box.replaceChildren(ask);
        ask.focus();
      });
      yes.addEventListener("click", async () => {
        const ok = await this.attempt(async () => {
          await api(`v1/subjects/${encodeURIComponent(subject.id)}`, { method: "DELETE" });
        }, error);
        if (ok) {
          this.selected = null;
          this.detail.replaceChildren(element("p", { class: "hint" }, `${personName(subject)} was deleted.`));
          await this.load();
          this.app.refreshStatus();
        }
      });
    });
    return box;
  }

  enrollForm(subject) {
    const box = element("div", { class: "enroll" });
    box.append(element("h4", {}, "Enroll photos"));
    const run = element("button", { type: "button", class: "primary", disabled: "" }, "Enroll");
    const chosen = element("p", { class: "hint", "aria-live": "polite" });
    const input = new PhotoInput(box, {
      id: "enroll-photos",
      label: `Photos of ${personName(subject)}`,
      multiple: true,
      onChange: (files) => {
        run.disabled = !files.length;
        chosen.textContent = files.length ? `${files.length} photo${files.length === 1 ? "" : "s"} chosen: ${files.map((f) => f.name).join(", ")}` : "";
      },
    });
    const policyId = "enroll-policy";
    const policy = element("select", { id: policyId });
    for (const [value, words] of [["reject", "skip the photo"], ["largest", "enroll the largest face"], ["central", "enroll the most central face"]]) {
      policy.append(element("option", { value }, words));
    }
    const policyRow = element("p", { class: "inline" });
    policyRow.append(element("label", { for: policyId }, "A photo with several faces:"), policy);
    const statuses = element("ul", { class: "enroll-status", "aria-live": "polite", "aria-label": "enrollment results" });
    const error = element("p", { class: "error", role: "alert", hidden: "" });
    box.append(chosen, policyRow, run, error, statuses);
    run.addEventListener("click", async () => {
      const form = new FormData();
      for (const file of input.files) form.append("photos", file);
      run.disabled = true;
      run.textContent = "Enrolling…";
      let answer = null;
      await this.attempt(async () => {
        answer = await api(`v1/subjects/${encodeURIComponent(subject.id)}/faces`, {
          method: "POST",
          form,
          query: { multiple_faces: policy.value },
        });
      }, error);
      run.textContent = "Enroll";
      if (!answer) {
        run.disabled = false;
        return;
      }
      input.clear();
      const page = await api(`v1/subjects/${encodeURIComponent(subject.id)}/faces`, { query: { limit: 1000 } }).catch(() => null);
      const faces = page ? page.faces : null;
      const refreshed = await api(`v1/subjects/${encodeURIComponent(subject.id)}`).catch(() => subject);
      this.renderDetail(refreshed, faces || []);
      const list = this.detail.querySelector(".enroll-status");
      list.replaceChildren(...answer.items.map((item) => {
        const li = element("li", { class: item.status === "ok" ? "ok" : "failed" });
        li.append(element("strong", {}, `${item.filename || `item ${item.index + 1}`}: ${ENROLL_STATUS[item.status] || item.status}`));
        if (item.message) li.append(` (${item.message})`);
        return li;
      }));
      list.prepend(element("li", { class: "total" }, `${answer.enrolled} enrolled, ${answer.failed} not enrolled.`));
      await this.load();
      this.app.refreshStatus();
    });
    return box;
  }

  facesGrid(subject, faces, admin, error) {
    const box = element("div", { class: "faces" });
    box.append(element("h4", {}, `Faces (${faces.length})`));
    if (!faces.length) {
      box.append(element("p", { class: "hint" }, "No faces yet."));
      return box;
    }
    const grid = element("ul", { class: "face-grid" });
    faces.forEach((face, index) => {
      const item = element("li", { class: "face-card", "data-face-id": face.id });
      const label = `face ${index + 1} of ${personName(subject)}`;
      if (face.has_image) {
        const img = element("img", { alt: label, width: "120", height: "120" });
        api(`v1/faces/${encodeURIComponent(face.id)}/image`, { as: "blob" })
          .then((blob) => {
            const url = URL.createObjectURL(blob);
            this.imageUrls.push(url);
            img.src = url;
          })
          .catch(() => img.replaceWith(element("div", { class: "no-image" }, "image unavailable")));
        item.append(img);
      } else {
        item.append(element("div", { class: "no-image", title: "enrolled from an embedding, or the service keeps no face images (SPHEREFACE_STORE_FACE_IMAGES=false)" }, face.source === "embedding" ? "from an embedding: no image" : "no image stored"));
      }
      const when = face.created_at.replace("T", " ").slice(0, 16);
      item.append(element("p", { class: "meta" }, `${when}${face.model_id !== this.app.modelId ? ` · model ${face.model_id}` : ""}`));
      if (admin) {
        const remove = element("button", { type: "button", class: "quiet", "aria-label": `Delete ${label}` }, "Delete");
        remove.addEventListener("click", async () => {
          const ok = await this.attempt(async () => {
            await api(`v1/faces/${encodeURIComponent(face.id)}`, { method: "DELETE" });
          }, error);
          if (ok) {
            await this.select(subject.id);
            await this.load();
            this.app.refreshStatus();
          }
        });
        item.append(remove);
      }
      grid.append(item);
    });
    box.append(grid);
    return box;
  }
}
