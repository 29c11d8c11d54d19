"""The page at `/` in a real Chromium (Debian's chromium and chromium-driver, driven by Selenium)
against a real `sphereface serve` process, a real redis-server and real photos.

A person verifies a genuine and an impostor pair and reads the decision, enrolls two people and
identifies both in a two-face photo, names the people of a video clip once each, names a group of
unknown faces, sees the API's message for a
text file, pages, searches, renames and deletes in the gallery, uses the tabs with the keyboard
and the page at phone width; `/docs` and `/redoc` render with nothing loaded from another host.

Set SPHEREFACE_SCREENSHOTS to a folder to keep a screenshot of each screen there
(`make screenshots` refreshes those of docs/screenshots).
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from service.auth import create_key
from service.serve_process import HEADERS, KEY, Service
from tests.conftest import fail_or_skip, short_temp_dir

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DESKTOP = (1280, 1000)
PHONE = (390, 844)


# -- the service, its Redis and the browser --------------------------------------------------


@pytest.fixture(scope="module")
def service(default_model_dir, module_redis):
    folder = short_temp_dir()
    running = Service(
        default_model_dir, folder / "data", module_redis.url, {"SPHEREFACE_KEEP_UNKNOWN": "true"}
    )
    yield running
    running.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def gallery(service, module_redis):
    """Each test starts from an empty gallery (the service's API client, admin key)."""
    module_redis.client().flushall()
    return service.client


def chromium_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        fail_or_skip("chromium and chromium-driver are not installed (make install-browser runs apt-get)")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service as DriverService

    binary, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={DESKTOP[0]},{DESKTOP[1]}")
    options.add_argument("--use-fake-device-for-media-stream")
    options.add_argument("--use-fake-ui-for-media-stream")
    # no other host resolves: the page and the docs must work as on a machine with no internet
    options.add_argument("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=DriverService(executable_path=driver_path))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory) -> Path:
    folder = os.environ.get("SPHEREFACE_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Page:
    """The page in the browser, in the words a person would use."""

    def __init__(self, driver, service: Service, screenshots: Path) -> None:
        self.driver, self.service, self.screenshots = driver, service, screenshots

    def open(self, key: str | None = KEY, size=DESKTOP, fragment: str = "") -> Page:
        self.driver.set_window_size(*size)
        self.driver.get(self.service.url + "/")
        self.driver.execute_script("sessionStorage.clear()")
        self.driver.get("about:blank")  # so that a URL differing only by its fragment loads anew
        self.driver.get(self.service.url + "/" + fragment)
        self.wait(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        if key is not None:
            self.use_key(key)
        return self

    def use_key(self, key: str) -> None:
        checks = self.key_checks()
        field = self.find("#api-key")
        field.clear()
        field.send_keys(key)
        self.find("#key-form button[type=submit]").click()
        self.wait(lambda d: self.key_checks() > checks)  # the page has asked the service about the key

    def key_checks(self) -> int:
        return int(self.find("body").get_attribute("data-key-checks") or 0)

    def wait(self, condition, timeout: float = 60):
        """Wait until ``condition(driver)`` is true; the page may re-render meanwhile."""
        try:
            return WebDriverWait(
                self.driver, timeout, ignored_exceptions=[StaleElementReferenceException]
            ).until(condition)
        except TimeoutException:
            self.shot("timeout")
            raise

    def find(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def find_all(self, css: str):
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.find(css).text

    def visible(self, css: str) -> bool:
        elements = self.find_all(css)
        return bool(elements) and elements[0].is_displayed()

    def wait_visible(self, css: str, timeout: float = 60):
        return self.wait(EC.visibility_of_element_located((By.CSS_SELECTOR, css)), timeout)

    def tab(self, name: str) -> None:
        self.find(f"#tab-{name}").click()
        self.wait_visible(f"#panel-{name}")

    def choose(self, css: str, *paths: Path) -> None:
        self.find(css).send_keys("\n".join(str(p) for p in paths))

    def shot(self, name: str, whole: bool = True) -> Path:
        """A screenshot of the whole page (beyond the window, or only the window), as JPEG."""
        path = self.screenshots / f"{name}.jpg"
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "jpeg", "quality": 80, "captureBeyondViewport": whole}
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def faces_drawn(self, container: str) -> int:
        return len(self.find_all(f"{container} svg.faces g.face"))

    def console_problems(self) -> list[str]:
        """Script errors and blocked loads in the console (HTTP error answers are expected)."""
        problems = []
        for entry in self.driver.get_log("browser"):
            message = entry["message"]
            if "Failed to load resource" in message:  # 401/404/422 answers the page shows as errors
                continue
            if entry["level"] in ("SEVERE", "WARNING"):
                problems.append(message)
        return problems


@pytest.fixture
def page(browser, service, screenshots) -> Page:
    browser.get_log("browser")  # drop what earlier tests left
    return Page(browser, service, screenshots)


def photos(photos_dir: Path, person: str) -> list[Path]:
    return sorted((photos_dir / "people" / person).glob("*.jpg"))


# -- verify ---------------------------------------------------------------------------------------


def verify_in_page(page: Page, first: Path, second: Path) -> str:
    page.choose("#verify-photo-1", first)
    page.choose("#verify-photo-2", second)
    page.wait(lambda d: page.find("#verify-run").is_enabled())
    page.find("#verify-run").click()
    page.wait(lambda d: page.visible("#verify-result") or page.visible("#verify-error"))
    return page.text("#verify-decision") if page.visible("#verify-result") else ""


def test_verify_a_genuine_and_an_impostor_pair(page, gallery, photos_dir, default_thresholds):
    page.open()
    obama = photos(photos_dir, "obama")
    decision = verify_in_page(page, obama[0], obama[1])
    assert decision == "Same person"
    for slot in ("#verify-slot-1", "#verify-slot-2"):
        assert page.faces_drawn(slot) == 1  # the face used, boxed
        assert len(page.find_all(f"{slot} svg.faces circle.landmark")) == 5
    explain = page.text("#verify-explain")
    assert f"{default_thresholds['verification']:.3f}" in explain and "1 in 1,000" in explain
    # the scale marks the score and the threshold where the API put them
    answer = gallery.post(
        "/v1/verify",
        files=[("photo1", obama[0].read_bytes()), ("photo2", obama[1].read_bytes())],
    ).json()
    label = page.find("#verify-scale").get_attribute("aria-label")
    assert f"score {answer['score']:.3f}" in label and f"{answer['threshold']:.3f}" in label
    page.shot("verify_same_person")

    decision = verify_in_page(page, obama[0], photos(photos_dir, "biden")[0])
    assert decision == "Different people"
    page.shot("verify_different_people")
    assert page.console_problems() == []


DROP_FILE = """
const [selector, name, b64] = arguments;
const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], name, { type: "image/jpeg" }));
const zone = document.querySelector(selector);
for (const type of ["dragenter", "dragover", "drop"]) {
  zone.dispatchEvent(new DragEvent(type, { dataTransfer: transfer, bubbles: true, cancelable: true }));
}
"""


def test_photos_dropped_on_the_page(page, gallery, photos_dir):
    page.open()
    first, second = photos(photos_dir, "biden")[:2]
    for n, path in ((1, first), (2, second)):
        data = base64.b64encode(path.read_bytes()).decode()
        page.driver.execute_script(DROP_FILE, f"#verify-slot-{n} .drop", f"dropped-{path.name}", data)
        page.wait(
            lambda d, n=n, path=path: page.text(f"#verify-slot-{n} figcaption") == f"dropped-{path.name}"
        )
    page.find("#verify-run").click()
    page.wait(lambda d: page.visible("#verify-result"))
    assert page.text("#verify-decision") == "Same person"


def test_a_text_file_gets_the_api_message(page, gallery, photos_dir, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("these are not the pixels you are looking for\n")
    page.open()
    assert verify_in_page(page, notes, photos(photos_dir, "obama")[0]) == ""
    shown = page.text("#verify-error")
    answer = gallery.post(
        "/v1/verify",
        files=[
            ("photo1", ("notes.txt", notes.read_bytes(), "text/plain")),
            ("photo2", photos(photos_dir, "obama")[0].read_bytes()),
        ],
    )
    assert answer.status_code in (415, 422), answer.text
    assert shown == answer.json()["message"]  # the API's words, not a JSON dump
    assert "notes.txt" in shown and "{" not in shown
    assert "cannot show this file" in page.text("#verify-slot-1 figcaption")
    page.shot("verify_error")


def test_a_photo_from_the_camera(page, gallery, photos_dir):
    """Chromium's fake camera (a test pattern, no face): the photo is taken, shown and sent."""
    page.open()
    page.find("#verify-slot-1 button.camera").click()
    page.wait(lambda d: d.execute_script("return document.getElementById('camera-video').videoWidth > 0"))
    page.find("#camera-take").click()
    page.wait(lambda d: page.text("#verify-slot-1 figcaption").startswith("camera-"))
    assert not page.find("#camera-dialog").get_attribute("open")
    assert page.driver.execute_script("return document.querySelector('#verify-slot-1 img').naturalWidth") > 0
    page.choose("#verify-photo-2", photos(photos_dir, "obama")[0])
    page.wait(lambda d: page.find("#verify-run").is_enabled())
    page.find("#verify-run").click()
    page.wait(lambda d: page.visible("#verify-error"))
    assert page.text("#verify-error").startswith("camera-") and "no face" in page.text("#verify-error")


def test_without_a_key_the_page_says_how_to_get_one(page, gallery, photos_dir):
    page.open(key=None)
    assert "needs an API key" in page.text("#key-note")
    obama = photos(photos_dir, "obama")
    verify_in_page(page, obama[0], obama[1])
    assert "Type an API key at the top of the page" in page.text("#verify-error")
    page.use_key("sfk_0123456789ab_not-a-real-secret-at-all")
    assert "unknown or revoked" in page.text("#key-note")
    page.use_key(KEY)
    page.driver.refresh()  # kept for the tab
    page.wait(lambda d: page.find("body").get_attribute("data-ready") == "true")
    assert page.find("#api-key").get_attribute("value") == KEY
    assert "may verify, identify and change the gallery" in page.text("#key-note")


# -- gallery and identify --------------------------------------------------------------------


def add_person(page: Page, name: str, subject_id: str) -> None:
    page.find("#new-subject-name").send_keys(name)
    page.find("#new-subject-id").send_keys(subject_id)
    page.find("#subject-create button[type=submit]").click()
    page.wait(lambda d: page.visible("#subject-heading") and page.text("#subject-heading") == name)


def enroll_in_page(page: Page, paths: list[Path]) -> list[str]:
    page.choose("#enroll-photos", *paths)
    page.find("#subject-detail .enroll button.primary").click()
    page.wait(lambda d: len(page.find_all("#subject-detail .enroll-status li")) == len(paths) + 1)
    return [li.text for li in page.find_all("#subject-detail .enroll-status li")]


def test_enroll_two_people_and_identify_both_in_one_photo(page, gallery, photos_dir):
    page.open(fragment="#gallery")
    assert page.visible("#panel-gallery")
    assert "No one in the gallery yet" in page.text("#subjects-count")
    kit, rose = photos(photos_dir, "kit_harington"), photos(photos_dir, "rose_leslie")
    scene = photos_dir / "scenes" / "two_faces_kit_rose.jpg"

    add_person(page, "Kit Harington", "kit")
    statuses = enroll_in_page(page, kit[:2] + [scene])
    assert statuses[0].startswith("2 enrolled, 1 not enrolled")
    assert statuses[1].startswith(f"{kit[0].name}: Enrolled")
    assert statuses[3].startswith(f"{scene.name}: Several faces")
    # the faces of the subject, with thumbnails of the stored regions
    page.wait(lambda d: len(page.find_all("#subject-detail .face-card img")) == 2)
    page.wait(
        lambda d: all(
            d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img)
            for img in page.find_all("#subject-detail .face-card img")
        )
    )
    statuses = enroll_in_page(page, kit[:1])
    assert statuses[1].startswith(f"{kit[0].name}: Already enrolled")

    add_person(page, "Rose Leslie", "rose")
    assert enroll_in_page(page, rose[:2])[0].startswith("2 enrolled, 0 not enrolled")
    page.wait(lambda d: "2 people" in page.text("#subjects-count"))
    page.shot("gallery")

    page.tab("identify")
    page.choose("#identify-photo", scene)
    page.find("#identify-run").click()
    page.wait_visible("#identify-result")
    labels = sorted(t.text for t in page.find_all("#identify-slot svg.faces text.label"))
    assert labels == ["Kit Harington", "Rose Leslie"]
    names = sorted(li.find_element(By.CSS_SELECTOR, ".who strong").text for li in page.find_all(".face-item"))
    assert names == ["Kit Harington", "Rose Leslie"]
    assert page.text("#identify-summary").startswith("2 faces: 2 known, 0 unknown.")
    page.shot("identify")

    # a stranger is labelled unknown
    page.choose("#identify-photo", photos(photos_dir, "lennon")[0])
    page.find("#identify-run").click()
    page.wait(lambda d: page.text("#identify-summary").startswith("1 face: 0 known, 1 unknown."))
    assert [t.text for t in page.find_all("#identify-slot svg.faces text.label")] == ["unknown"]
    assert page.console_problems() == []


def test_gallery_search_paging_rename_and_delete(page, gallery, photos_dir):
    for i in range(23):
        r = gallery.post("/v1/subjects", json={"id": f"person-{i:02d}", "name": f"Person {i:02d}"})
        assert r.status_code == 201, r.text
    gallery.post("/v1/subjects", json={"id": "obama", "name": "Barack Obama"})
    r = gallery.post(
        "/v1/subjects/obama/faces", files=[("photos", photos(photos_dir, "obama")[0].read_bytes())]
    )
    assert r.json()["enrolled"] == 1, r.text
    page.open(fragment="#gallery")
    page.wait(lambda d: page.text("#subjects-count") == "1–20 of 24 people")
    assert len(page.find_all("#subjects-list button.subject")) == 20
    page.find("#subjects-next").click()
    page.wait(lambda d: page.text("#subjects-count") == "21–24 of 24 people")
    assert not page.find("#subjects-next").is_enabled()

    page.find("#subject-query").send_keys("OBAMA")
    page.wait(lambda d: page.text("#subjects-count") == "1–1 of 1 person matching “OBAMA”")
    page.find("#subjects-list button.subject").click()
    page.wait(lambda d: page.visible("#subject-heading") and page.text("#subject-heading") == "Barack Obama")

    field = page.find("#rename-input")
    field.clear()
    field.send_keys("Barack H. Obama", Keys.ENTER)
    page.wait(lambda d: page.text("#subject-heading") == "Barack H. Obama")
    assert gallery.get("/v1/subjects/obama").json()["name"] == "Barack H. Obama"

    page.wait(lambda d: len(page.find_all("#subject-detail .face-card")) == 1)
    page.find("#subject-detail .face-card button").click()
    page.wait(lambda d: "No faces yet." in page.text("#subject-detail"))
    assert gallery.get("/v1/subjects/obama/faces").json()["faces"] == []

    page.find("#subject-detail .danger-zone button").click()
    page.find("#subject-detail .danger-zone button.quiet").click()  # "Keep": nothing deleted
    assert gallery.get("/v1/subjects/obama").status_code == 200
    page.find("#subject-detail .danger-zone button").click()
    page.find("#subject-detail .danger-zone button.danger").click()
    page.wait(lambda d: "was deleted" in page.text("#subject-detail"))
    assert gallery.get("/v1/subjects/obama").status_code == 404
    page.wait(lambda d: page.text("#subjects-count") == "No one matches “OBAMA”.")


def test_a_read_key_sees_the_gallery_but_cannot_change_it(page, gallery, module_redis):
    gallery.post("/v1/subjects", json={"id": "ada", "name": "Ada"})
    read_key, _ = create_key(module_redis.client(), "read", name="browser test")
    page.open(key=read_key, fragment="#gallery")
    assert "not change it" in page.text("#key-note")
    page.wait(lambda d: page.text("#subjects-count") == "1–1 of 1 person")
    assert not page.visible("#subject-create")
    assert "scope read" in page.text("#gallery-scope-note")
    page.find("#subjects-list button.subject").click()
    page.wait(lambda d: page.visible("#subject-heading"))
    assert page.find_all("#subject-detail .danger-zone") == []
    assert page.find_all("#enroll-photos") == []


def test_the_page_waits_out_a_rate_limit_instead_of_failing(page, gallery, module_redis):
    """A read key (50 requests/s, burst 100 by default) asking for 140 things at once, as a gallery
    of many faces asks for its thumbnails: the requests refused with 429 are sent again after
    Retry-After, and every one succeeds."""
    read_key, _ = create_key(module_redis.client(), "read", name="browser burst")
    page.open(key=read_key)
    outcome = page.driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const seen = [];
        const realFetch = window.fetch;
        window.fetch = async (...args) => {
          const response = await realFetch(...args);
          seen.push(response.status);
          return response;
        };
        import(new URL("static/js/api.js", document.baseURI)).then(async ({ api }) => {
          const calls = Array.from({ length: 140 }, () => api("v1/subjects"));
          const results = await Promise.allSettled(calls);
          window.fetch = realFetch;
          done({ failed: results.filter((r) => r.status === "rejected").length,
                 refused: seen.filter((s) => s === 429).length });
        });
        """
    )
    assert outcome["refused"] > 0  # the limit was reached ...
    assert outcome["failed"] == 0  # ... and the page waited it out


# -- unknown people ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(default_model_dir, photos_dir, tmp_path_factory) -> Path:
    """tests/test_video.py's clip: obama and biden (photos 2) cross the frame, lennon walks in."""
    pytest.importorskip("av", reason="the Video tab needs PyAV: pip install '.[video]'")
    from bench.video_clip import actor_photo, two_people_and_a_stranger, write_clip
    from models.pipeline import FacePipeline

    pipeline = FacePipeline(default_model_dir)
    people = photos_dir / "people"
    cast = {"a": ("obama", "2"), "b": ("biden", "2"), "stranger": ("lennon", "1")}
    actors = {k: actor_photo(pipeline, people / who / f"{n}.jpg", who) for k, (who, n) in cast.items()}
    path = tmp_path_factory.mktemp("clip") / "door.mp4"
    write_clip(path, two_people_and_a_stranger(actors), width=640, height=360, seconds=8.0)
    return path


def test_a_clip_in_the_video_tab_names_each_person_once(page, gallery, photos_dir, clip):
    for subject, name in (("obama", "Barack Obama"), ("biden", "Joe Biden")):
        assert gallery.post("/v1/subjects", json={"id": subject, "name": name}).status_code == 201
        photo = photos(photos_dir, subject)[0]
        files = [("photos", (photo.name, photo.read_bytes()))]
        r = gallery.post(f"/v1/subjects/{subject}/faces", files=files)
        assert r.status_code == 200, r.text
    page.open(fragment="#video")
    page.choose("#video-file", clip)
    page.find("#video-run").click()
    page.wait_visible("#video-result", timeout=120)
    tracks = page.find_all("#video-tracks li")
    names = [li.find_element(By.CSS_SELECTOR, ".who strong").text for li in tracks]
    assert names == ["Barack Obama", "Joe Biden", "unknown"]
    summary = page.text("#video-summary")
    assert summary.startswith("3 people seen: 2 known, 1 unknown. 40 frames at 5 per second"), summary
    assert "kept with the unknown people" in page.text("#video-tracks li.unknown")
    # each track's best face, cut from the clip in the browser at its time and box
    page.wait(lambda d: len(page.find_all("#video-tracks canvas.track-thumb")) == 3)
    page.shot("video")
    assert page.console_problems() == []


def test_unknown_people_are_grouped_and_named_in_the_page(page, gallery, photos_dir):
    for person, count in (("obama", 3), ("kit_harington", 2)):
        for path in photos(photos_dir, person)[:count]:
            r = gallery.post("/v1/identify", files=[("photo", (path.name, path.read_bytes(), "image/jpeg"))])
            assert r.status_code == 200 and r.json()["faces"][0]["status"] == "unknown", r.text
    page.open(fragment="#unknowns")
    page.wait(lambda d: len(page.find_all("#unknowns-list .cluster-card")) == 2)
    cards = page.find_all("#unknowns-list .cluster-card")
    assert cards[0].find_element(By.CSS_SELECTOR, ".meta").text.startswith("3 faces")
    assert cards[1].find_element(By.CSS_SELECTOR, ".meta").text.startswith("2 faces")
    assert "2 unknown people · 5 faces kept" in page.text("#unknowns-summary")
    assert "false accepts). On LFW, " in page.text("#unknowns-rule")
    page.wait(
        lambda d: (
            len(page.find_all("#unknowns-list .cluster-card img")) == 5
            and all(
                d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img)
                for img in page.find_all("#unknowns-list .cluster-card img")
            )
        )
    )
    page.shot("unknown_people")

    first = page.find("#unknowns-list .cluster-card input")
    first.send_keys("Barack Obama")
    first.send_keys(Keys.ENTER)
    page.wait(
        lambda d: page.text("#unknowns-summary").startswith(
            "3 faces enrolled for Barack Obama (barack_obama)."
        )
    )
    page.wait(lambda d: len(page.find_all("#unknowns-list .cluster-card")) == 1)

    page.tab("identify")
    page.choose("#identify-photo", photos(photos_dir, "obama")[3])
    page.find("#identify-run").click()
    page.wait(lambda d: page.text("#identify-summary").startswith("1 face: 1 known, 0 unknown."))
    assert [t.text for t in page.find_all("#identify-slot svg.faces text.label")] == ["Barack Obama"]
    assert page.console_problems() == []


# -- keyboard, phone width, docs --------------------------------------------------------------


def test_tabs_work_with_the_keyboard(page, gallery):
    page.open()
    page.find("#tab-verify").send_keys(Keys.ARROW_RIGHT)
    page.wait_visible("#panel-identify")
    assert page.driver.switch_to.active_element.get_attribute("id") == "tab-identify"
    assert not page.visible("#panel-verify")
    page.driver.switch_to.active_element.send_keys(Keys.END)
    page.wait_visible("#panel-unknowns")
    page.driver.switch_to.active_element.send_keys(Keys.ARROW_LEFT)
    page.wait_visible("#panel-gallery")
    page.driver.switch_to.active_element.send_keys(Keys.END)
    page.wait_visible("#panel-unknowns")
    page.driver.switch_to.active_element.send_keys(Keys.ARROW_RIGHT)  # wraps round
    page.wait_visible("#panel-verify")
    # every control of the verify tab can be reached with Tab and has a label
    for css in ("#verify-photo-1", "#verify-photo-2"):
        label = page.find(f"label[for={css[1:]}]")
        assert label.text.startswith("Photo")


def test_the_page_fits_a_phone(page, gallery, photos_dir):
    page.open(size=PHONE)
    obama = photos(photos_dir, "obama")
    assert verify_in_page(page, obama[0], obama[1]) == "Same person"
    overflow = page.driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    wide = page.driver.execute_script(
        "const w = document.documentElement.clientWidth;"
        "return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > w)"
        ".map(e => e.tagName + (e.id ? '#' + e.id : '') + '.' + e.className).slice(0, 8)"
    )
    assert overflow <= 0, f"the page is {overflow} px wider than a phone: {wide}"
    page.shot("phone_verify")


def same_origin_resources(page: Page) -> list[str]:
    """Every URL the document loaded that is not on the service's host."""
    urls = page.driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).concat([location.href])"
    )
    host = urlparse(page.service.url).netloc
    return [u for u in urls if urlparse(u).netloc != host]


def test_page_and_docs_load_nothing_from_another_host(page, gallery):
    page.open()
    assert same_origin_resources(page) == []
    csp = httpx.get(page.service.url + "/").headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp

    page.driver.get(page.service.url + "/docs")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title"))
    page.wait(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".opblock")) >= 10)
    assert "SphereFace face service" in page.text(".swagger-ui .info .title")
    assert same_origin_resources(page) == []
    page.shot("api_docs", whole=False)

    page.driver.get(page.service.url + "/redoc")
    page.wait(lambda d: d.find_elements(By.CSS_SELECTOR, ".api-content h1"))
    assert same_origin_resources(page) == []


def test_the_service_api_is_unchanged_for_clients(service):
    """The page's endpoint for the key's scope; the docs URLs answer HTML without a key."""
    assert httpx.get(service.url + "/v1/key", headers=HEADERS).json() == {"key_id": "env", "scope": "admin"}
    assert httpx.get(service.url + "/v1/key").status_code == 401
    for path in ("/", "/docs", "/redoc"):
        r = httpx.get(service.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
