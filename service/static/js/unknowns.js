// Unknown people: the clusters of faces identify did not know (SPHEREFACE_KEEP_UNKNOWN=true),
// largest first, with thumbnails; name a cluster (enroll its faces) or delete it.

import { api, oneIn, showError } from "./api.js";
import { element } from "./photos.js";

const PAGE_SIZE = 12;

/** A subject id from a typed name: letters, digits and _ . - @ : only ("Ada Lovelace" -> "ada_lovelace"). */
export function subjectIdOf(name) {
  const id = name.trim().toLowerCase().normalize("NFKD").replace(/[\u0300-\u036f]/g, "")
    .replace(/[^a-z0-9_.\-@:]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 128);
  return id.replace(/\./g, "") ? id : "";
}

function when(iso) {
  return iso.replace("T", " ").slice(0, 16);
}

export class Unknowns {
  constructor(app) {
    this.app = app;
    this.offset = 0;
    this.nextOffset = null;
    this.imageUrls = [];
    this.list = document.getElementById("unknowns-list");
    this.summary = document.getElementById("unknowns-summary");
    this.rule = document.getElementById("unknowns-rule");
    this.error = document.getElementById("unknowns-error");
    this.prev = document.getElementById("unknowns-prev");
    this.next = document.getElementById("unknowns-next");
    this.prev.addEventListener("click", () => this.load(Math.max(0, this.offset - PAGE_SIZE)));
    this.next.addEventListener("click", () => this.nextOffset !== null && this.load(this.nextOffset));
  }

  async load(offset = this.offset) {
    const request = (this.loads = (this.loads || 0) + 1);
    showError(this.error, null);
    let page;
    try {
      page = await api("v1/unknowns/clusters", { query: { offset, limit: PAGE_SIZE } });
    } catch (exc) {
      if (request !== this.loads) return;
      this.list.replaceChildren();
      this.rule.textContent = "";
      this.summary.textContent = exc.code === "unknowns_off"
        ? "This service keeps no unknown faces. Start it with SPHEREFACE_KEEP_UNKNOWN=true to group the faces nobody enrolled."
        : "";
      if (exc.code !== "unknowns_off") showError(this.error, exc);
      this.app.noteError(exc);
      return;
    }
    if (request !== this.loads) return;
    this.offset = offset;
    this.nextOffset = page.next_offset;
    this.render(page);
  }

  render(page) {
    for (const url of this.imageUrls) URL.revokeObjectURL(url);
    this.imageUrls = [];
    const rule = page.rule;
    const merged = rule.false_merge_rate === null ? "" : ` On LFW, ${(100 * rule.false_merge_rate).toFixed(2)}% of the face pairs grouped together were two different people.`;
    this.rule.textContent = `A face joins a group when its closest faces there score at least ${rule.threshold.toFixed(3)} (the model's threshold for ${oneIn(rule.threshold_far)} false accepts).${merged}`;
    if (page.total === 0) {
      this.summary.textContent = "No unknown faces yet: faces that Identify does not know appear here.";
    } else {
      const last = page.offset + page.clusters.length;
      this.summary.textContent = `${page.offset + 1}–${last} of ${page.total} unknown ${page.total === 1 ? "person" : "people"} · ${page.pooled_faces} face${page.pooled_faces === 1 ? "" : "s"} kept`;
    }
    this.list.replaceChildren(...page.clusters.map((cluster, index) => this.card(cluster, page.offset + index + 1)));
    this.prev.disabled = page.offset === 0;
    this.next.disabled = page.next_offset === null;
  }

  thumbnail(face, label) {
    if (!face.has_image) return element("div", { class: "no-image" }, "no image stored");
    const img = element("img", { alt: label, width: "96", height: "96" });
    api(`v1/unknowns/faces/${encodeURIComponent(face.id)}/image`, { as: "blob" })
      .then((blob) => {
        const url = URL.createObjectURL(blob);
        this.imageUrls.push(url);
        img.src = url;
      })
      .catch(() => img.replaceWith(element("div", { class: "no-image" }, "image unavailable")));
    return img;
  }

  card(cluster, number) {
    const item = element("li", { class: "cluster-card", "data-cluster-id": cluster.id });
    const title = `Unknown person ${number}`;
    item.append(element("h3", {}, title));
    const faces = element("div", { class: "cluster-faces" });
    cluster.representatives.forEach((face, i) => faces.append(this.thumbnail(face, `${title}, face ${i + 1}`)));
    item.append(faces);
    item.append(element("p", { class: "meta" }, `${cluster.faces} face${cluster.faces === 1 ? "" : "s"} · seen ${when(cluster.first_seen)}${cluster.faces > 1 ? ` to ${when(cluster.last_seen)}` : ""}`));
    if (this.app.canChange()) item.append(this.nameForm(cluster, title), this.deleteButton(cluster, title));
    return item;
  }

  nameForm(cluster, title) {
    const form = element("form", { class: "name-cluster" });
    const inputId = `name-${cluster.id}`;
    const input = element("input", { id: inputId, maxlength: "200", placeholder: "Their name", required: "" });
    const error = element("p", { class: "error", role: "alert", hidden: "" });
    form.append(element("label", { for: inputId }, `Name ${title.toLowerCase()}`), input, element("button", { type: "submit" }, "Name this person"), error);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const name = input.value.trim();
      const subjectId = subjectIdOf(name);
      if (!subjectId) {
        showError(error, new Error("Type a name with at least one letter or digit."));
        return;
      }
      try {
        const done = await api(`v1/unknowns/clusters/${encodeURIComponent(cluster.id)}/enroll`, {
          method: "POST",
          json: { subject_id: subjectId, create_subject: true, name },
        });
        this.summary.textContent = `${done.enrolled.length} face${done.enrolled.length === 1 ? "" : "s"} enrolled for ${name} (${subjectId}).`;
        await this.load();
        this.summary.textContent = `${done.enrolled.length} face${done.enrolled.length === 1 ? "" : "s"} enrolled for ${name} (${subjectId}). ${this.summary.textContent}`;
        this.app.refreshStatus();
      } catch (exc) {
        showError(error, exc);
        this.app.noteError(exc);
      }
    });
    return form;
  }

  deleteButton(cluster, title) {
    const button = element("button", { type: "button", class: "quiet", "aria-label": `Delete ${title.toLowerCase()} and their faces` }, "Delete");
    button.addEventListener("click", async () => {
      try {
        await api(`v1/unknowns/clusters/${encodeURIComponent(cluster.id)}`, { method: "DELETE" });
        await this.load();
      } catch (exc) {
        showError(this.error, exc);
        this.app.noteError(exc);
      }
    });
    return button;
  }
}
