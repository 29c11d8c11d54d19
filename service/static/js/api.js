// Calls to the service's REST API from the page: the API key of this tab, typed errors.

const KEY_STORAGE = "sphereface.apiKey";
/** How many times a request refused with 429 rate_limited is sent again after its Retry-After. */
const RATE_LIMIT_RETRIES = 3;

/** An answer that is not a success, with the API's machine-readable code and human message. */
export class ApiError extends Error {
  constructor(message, code, status) {
    super(message);
    this.code = code;
    this.status = status;
  }
}

/** The API key typed in this tab ("" when none); sessionStorage forgets it when the tab closes. */
export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function url(path, query) {
  // Relative to the page, so the page works behind a proxy that serves it under a prefix.
  const target = new URL(path, document.baseURI);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") target.searchParams.set(name, value);
  }
  return target;
}

async function failure(response) {
  let message = `The service answered HTTP ${response.status}${response.statusText ? ` (${response.statusText})` : ""}.`;
  let code = `http_${response.status}`;
  try {
    const body = await response.json();
    if (body && typeof body.message === "string") {
      message = body.message;
      code = typeof body.code === "string" ? body.code : code;
    }
  } catch {
    // not JSON (a proxy's error page): keep the status line
  }
  return new ApiError(message, code, response.status);
}

/**
 * Call the API. `json` sends a JSON body, `form` a FormData (photos); `as` is "json" or "blob".
 * Throws ApiError with the API's message for every answer that is not a success.
 */
export async function api(path, { method = "GET", query, json, form, as = "json" } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers["X-API-Key"] = key;
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form;
  }
  let response;
  for (let attempt = 0; ; attempt++) {
    try {
      response = await fetch(url(path, query), { method, headers, body });
    } catch {
      throw new ApiError("Could not reach the service. Is it still running?", "network_error", 0);
    }
    // A key over its rate limit is refused before its body is read, so sending again is safe:
    // wait as long as Retry-After says (a gallery of many faces asks for many thumbnails at once).
    const wait = Number(response.headers.get("Retry-After"));
    if (response.status !== 429 || attempt >= RATE_LIMIT_RETRIES || !(wait > 0) || wait > 10) break;
    await new Promise((resolve) => setTimeout(resolve, wait * 1000));
  }
  if (!response.ok) throw await failure(response);
  return as === "blob" ? response.blob() : response.json();
}

/** Words for a person: the message of the API, and what to do for a missing or wrong key. */
export function describe(error) {
  if (!(error instanceof ApiError)) return `Something went wrong in the page: ${error.message || error}`;
  if (error.status === 401) return `${error.message.replace(/\.$/, "")}. Type an API key at the top of the page.`;
  return error.message;
}

/** Show an error (or hide the element with null). */
export function showError(element, error) {
  if (!error) {
    element.hidden = true;
    element.textContent = "";
    return;
  }
  element.textContent = describe(error);
  element.hidden = false;
}

/** "1 in 1,000" for a false-accept rate of 0.001. */
export function oneIn(rate) {
  if (!rate) return "";
  return `1 in ${Math.round(1 / rate).toLocaleString("en")}`;
}

/** A cosine score with three decimals. */
export function score(value) {
  return value === null || value === undefined ? "–" : value.toFixed(3);
}
