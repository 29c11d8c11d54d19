// The page: tabs, the API key of this tab, the service's state; each tab lives in its module.

import { api, apiKey, describe, setApiKey } from "./api.js";
import { Gallery } from "./gallery.js";
import { setUpIdentify } from "./identify.js";
import { Unknowns } from "./unknowns.js";
import { setUpVideo } from "./video.js";
import { setUpVerify } from "./verify.js";

/** What the tabs share: the served model, the key's scope, the status line. */
class App {
  constructor() {
    this.modelId = null;
    this.scope = null; // "read", "admin", or null (no key, or a key the service refused)
    this.status = document.getElementById("service-status");
    this.keyNote = document.getElementById("key-note");
  }

  canChange() {
    return this.scope === "admin";
  }

  async refreshStatus() {
    let ready;
    try {
      const response = await fetch(new URL("readyz", document.baseURI));
      ready = await response.json();
    } catch {
      this.status.textContent = "The service does not answer.";
      this.status.className = "status bad";
      return;
    }
    if (ready.status === "ready") {
      this.modelId = ready.model_id;
      const faces = ready.gallery_faces ?? 0;
      this.status.textContent = `Ready · model ${ready.model_id} on ${ready.provider} · ${faces} face${faces === 1 ? "" : "s"} in the gallery`;
      this.status.className = "status ok";
    } else {
      this.status.textContent = `Not ready: ${ready.message || ready.status}`;
      this.status.className = "status bad";
    }
  }

  /** Ask the service what the key may do, and show it beside the key field. */
  async checkKey() {
    try {
      const info = await api("v1/key");
      this.scope = info.scope;
      const who = info.key_id === "env" ? "The service's admin key (SPHEREFACE_API_KEY)" : `Key ${info.key_id}`;
      this.keyNote.textContent = info.key_id === "auth-off"
        ? "This service needs no API key (auth is off)."
        : info.scope === "admin"
          ? `${who} may verify, identify and change the gallery. It is kept in this tab only.`
          : `${who} may verify, identify and look at the gallery, not change it. It is kept in this tab only.`;
    } catch (exc) {
      this.scope = null;
      this.keyNote.textContent = apiKey()
        ? describe(exc)
        : "This service needs an API key. `sphereface serve` wrote an admin key to .sphereface/admin.key.";
    }
    document.body.classList.toggle("read-only", !this.canChange());
    document.body.dataset.keyChecks = String(Number(document.body.dataset.keyChecks || 0) + 1);
    const note = document.getElementById("gallery-scope-note");
    note.hidden = this.canChange();
    note.textContent = this.scope === "read"
      ? "This key can look at the gallery but not change it (scope read): use an admin key to add people."
      : "Type an admin API key at the top of the page to see and change the gallery.";
  }

  /** A 401 anywhere means the key is missing or no longer valid: say so beside the key field. */
  noteError(error) {
    if (error && error.status === 401) this.checkKey();
  }
}

function setUpTabs(onShow) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const show = (tab, focus) => {
    for (const other of tabs) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      other.tabIndex = selected ? 0 : -1;
      document.getElementById(other.getAttribute("aria-controls")).hidden = !selected;
    }
    if (focus) tab.focus();
    history.replaceState(null, "", `#${tab.id.replace("tab-", "")}`);
    onShow(tab.id.replace("tab-", ""));
  };
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => show(tab, false));
    tab.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: index + 1, ArrowLeft: index - 1, Home: 0, End: tabs.length - 1 };
      if (!(event.key in moves)) return;
      event.preventDefault();
      show(tabs[(moves[event.key] + tabs.length) % tabs.length], true);
    });
  });
  const fromAddress = () => {
    const chosen = tabs.find((tab) => tab.id === `tab-${location.hash.slice(1)}`);
    if (chosen && chosen.getAttribute("aria-selected") !== "true") show(chosen, false);
  };
  window.addEventListener("hashchange", fromAddress);
  fromAddress();
}

function setUpKey(app, gallery, unknowns) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  input.value = apiKey();
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    setApiKey(input.value.trim());
    await app.checkKey();
    gallery.load(0);
    unknowns.load(0);
  });
  document.getElementById("forget-key").addEventListener("click", async () => {
    setApiKey("");
    input.value = "";
    await app.checkKey();
    gallery.load(0);
    unknowns.load(0);
  });
}

async function main() {
  const app = new App();
  const gallery = new Gallery(app);
  const unknowns = new Unknowns(app);
  setUpVerify(app);
  setUpIdentify(app);
  setUpVideo(app);
  setUpKey(app, gallery, unknowns);
  setUpTabs((name) => {
    if (name === "gallery") gallery.load();
    if (name === "unknowns") unknowns.load();
  });
  await Promise.all([app.refreshStatus(), app.checkKey()]);
  document.body.dataset.ready = "true";
}

main();
