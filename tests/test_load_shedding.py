"""Back-pressure on a real `sphereface serve` process: a bounded face path that sheds load with
503 `overloaded` and `Retry-After` (before: latency grew without bound), gallery reads that are
never held back, nothing acknowledged lost while it sheds, and the worker's memory back near
where it started after a burst of 8 large photos (before: 3.4 GB peak, 1.7 GB after)."""

from __future__ import annotations

import concurrent.futures as cf
import io
import time
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from service.serve_process import Service

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


def test_a_full_face_path_sheds_load_and_loses_nothing(default_model_dir, photos_dir, workdir):
    env = {
        "SPHEREFACE_MAX_FACE_REQUESTS": "1",
        "SPHEREFACE_MAX_QUEUED_REQUESTS": "1",
        "SPHEREFACE_QUEUE_WAIT": "20",
    }
    service = Service(default_model_dir, workdir / "data", extra_env=env)
    people = photos_dir / "people"
    obama = sorted((people / "obama").glob("*.jpg"))
    try:
        for name in ("obama", "biden"):
            assert service.client.post("/v1/subjects", json={"id": name}).status_code == 201

        def verify(_):
            files = {"photo1": obama[0].read_bytes(), "photo2": obama[1].read_bytes()}
            r = service.client.post("/v1/verify", files=files)
            return r.status_code, r.json().get("code"), r.headers.get("retry-after")

        def enroll(path):
            r = service.client.post(
                f"/v1/subjects/{path.parent.name}/faces", files=[("photos", path.read_bytes())]
            )
            return r.status_code, r.json()

        with cf.ThreadPoolExecutor(10) as pool:
            verifies = [pool.submit(verify, i) for i in range(8)]
            enrolls = [pool.submit(enroll, p) for p in sorted((people / "biden").glob("*.jpg"))]
            time.sleep(0.3)
            read_start = time.monotonic()
            listing = service.client.get("/v1/subjects")  # a gallery read is not queued behind them
            read_seconds = time.monotonic() - read_start
            outcomes = [f.result() for f in verifies]
            enrolled = [f.result() for f in enrolls]
        statuses = Counter(status for status, _, _ in outcomes)
        assert set(statuses) <= {200, 503} and statuses[200] >= 1 and statuses[503] >= 1, outcomes
        assert all(code == "overloaded" and retry == "1" for status, code, retry in outcomes if status == 503)
        assert listing.status_code == 200 and read_seconds < 1.0
        acknowledged = [body["items"][0]["face"]["id"] for status, body in enrolled if status == 200]
        assert all(status in (200, 503) for status, _ in enrolled)
        stored = {f["id"] for f in service.client.get("/v1/subjects/biden/faces").json()["faces"]}
        assert set(acknowledged) <= stored  # every acknowledged face is there
    finally:
        service.stop()


def large_png(side: int = 6000) -> bytes:
    pixels = np.zeros((side, side, 3), np.uint8)
    pixels[::7] = 200  # compresses well: a small upload that decodes to 108 MB
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def test_memory_returns_after_a_burst_of_large_photos(default_model_dir, photos_dir, workdir):
    # A long queue wait: on a busy 2-core machine the 8th large photo can wait over the default
    # 10 s for its turn, and this test is about memory, not shedding.
    env = {"SPHEREFACE_MAX_UPLOAD_BYTES": "67108864", "SPHEREFACE_QUEUE_WAIT": "60"}
    service = Service(default_model_dir, workdir / "data", extra_env=env)
    face = (photos_dir / "people" / "obama" / "1.jpg").read_bytes()
    big = large_png()
    try:

        def verify(first: bytes):
            r = service.client.post(
                "/v1/verify", files={"photo1": ("a.png", first), "photo2": ("b.jpg", face)}
            )
            return r.status_code, r.json().get("code")

        assert verify(face) == (200, None)  # warm: the model's arenas are allocated
        # ONNX Runtime's arenas also grow to the largest pyramid levels run side by side and keep
        # that size (up to about 100 MiB, in the first burst or a later one depending on how the
        # runs overlap, then flat over 6 bursts: a cache, not a leak). What must come back is the
        # burst's decoded pixels (8 photos of 103 MiB; without the trim after the burst, 380 MiB
        # stayed): less than two photos' worth may remain.
        start = service.rss_mib()
        with cf.ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(verify, big) for _ in range(8)]
            peak = start
            while not all(f.done() for f in burst):
                peak = max(peak, service.rss_mib())
                time.sleep(0.05)
        assert [f.result() for f in burst] == [(422, "no_face")] * 8
        time.sleep(0.5)
        after = service.rss_mib()
        print(f"worker RSS: {start:.0f} MiB before, {peak:.0f} MiB peak, {after:.0f} MiB after")
        assert peak < start + 1500, f"peak {peak:.0f} MiB from {start:.0f}: decodes are not bounded"
        two_photos = 2 * 6000 * 6000 * 3 / 2**20
        assert after < start + two_photos, f"{after:.0f} MiB after the burst, {start:.0f} MiB before"
    finally:
        service.stop()
