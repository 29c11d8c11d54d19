"""The REST API on real photos: verify, embed, health, and typed errors for bad input."""

from __future__ import annotations

import io
import itertools
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from models.manifest import load_manifest
from service.app import create_app
from service.redis_server import LocalRedis
from service.settings import Settings
from tests.conftest import short_temp_dir

pytestmark = pytest.mark.shared_data


@pytest.fixture(scope="module")
def client(default_model_dir: Path, redis_binary: str):
    folder = short_temp_dir()
    with LocalRedis(folder / "redis", binary=redis_binary) as redis:
        settings = Settings(
            model_dir=default_model_dir, max_image_pixels=5_000_000, redis_url=redis.url, auth="off"
        )
        with TestClient(create_app(settings)) as c:
            yield c
    shutil.rmtree(folder, ignore_errors=True)


def _people(photos_dir: Path) -> dict[str, list[Path]]:
    return {d.name: sorted(d.glob("*.jpg")) for d in sorted((photos_dir / "people").iterdir())}


def _verify(client, a: Path, b: Path) -> dict:
    r = client.post("/v1/verify", files={"photo1": a.open("rb"), "photo2": b.open("rb")})
    assert r.status_code == 200, r.text
    return r.json()


def test_health_and_readiness(client, default_model_dir):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["model_id"] == load_manifest(default_model_dir).model_id


def test_every_genuine_pair_is_the_same_person_and_every_impostor_pair_is_not(client, photos_dir):
    """What a new user tries first: all 12 genuine pairs of photos/people (different photos of one
    person) accepted, all 21 pairs of different people rejected, at the calibrated threshold."""
    people = _people(photos_dir)
    genuine = [
        _verify(client, a, b) for photos in people.values() for a, b in itertools.combinations(photos, 2)
    ]
    firsts = [photos[0] for photos in people.values()]
    impostor = [_verify(client, a, b) for a, b in itertools.combinations(firsts, 2)]
    assert len(genuine) == 12 and len(impostor) == 21
    rejected = [round(v["score"], 3) for v in genuine if not v["same_person"]]
    accepted = [round(v["score"], 3) for v in impostor if v["same_person"]]
    assert not rejected and not accepted, (rejected, accepted)
    assert min(v["score"] for v in genuine) > max(v["score"] for v in impostor)


def test_verify_decides_with_the_manifest_threshold(client, photos_dir, default_thresholds):
    people = _people(photos_dir)
    same = _verify(client, people["obama"][0], people["obama"][1])
    other = _verify(client, people["obama"][0], people["biden"][0])
    assert same["same_person"] is True and other["same_person"] is False
    assert same["threshold"] == default_thresholds["verification"] and same["threshold_far"] == 1e-3
    assert other["score"] < default_thresholds["verification"] <= same["score"]
    assert len(same["faces"]) == 2 and len(same["faces"][0]["landmarks"]) == 5


def test_embed_returns_both_faces_of_a_two_face_photo(client, photos_dir, default_model_dir):
    path = photos_dir / "scenes" / "two_faces_kit_rose.jpg"
    r = client.post("/v1/embed", files=[("photos", path.open("rb"))])
    body = r.json()
    assert r.status_code == 200 and body["embedding_size"] == load_manifest(default_model_dir).output_size
    faces = body["photos"][0]["faces"]
    assert len(faces) == 2
    for face in faces:
        assert np.isclose(np.linalg.norm(face["embedding"]), 1.0, atol=1e-4)


def test_embed_reports_each_photo_status(client, photos_dir):
    blank = io.BytesIO()
    Image.new("RGB", (200, 200), (128, 128, 128)).save(blank, format="PNG")
    files = [
        ("photos", (photos_dir / "scenes" / "single_carell.jpg").open("rb")),
        ("photos", ("blank.png", blank.getvalue(), "image/png")),
        ("photos", ("notes.txt", b"hello", "text/plain")),
    ]
    statuses = [p["status"] for p in client.post("/v1/embed", files=files).json()["photos"]]
    assert statuses == ["ok", "no_face", "unreadable_image"]


def test_embed_of_aligned_crop_skips_detection(client, photos_dir, default_model_dir):
    manifest = load_manifest(default_model_dir)
    crop = io.BytesIO()
    Image.new("RGB", (manifest.input_width, manifest.input_height), (90, 60, 40)).save(crop, format="PNG")
    r = client.post("/v1/embed?aligned=true", files=[("photos", ("crop.png", crop.getvalue()))])
    assert r.json()["photos"][0]["status"] == "ok"
    r = client.post(
        "/v1/embed?aligned=true", files=[("photos", (photos_dir / "scenes" / "single_carell.jpg").open("rb"))]
    )
    assert r.json()["photos"][0]["status"] == "wrong_crop_size"


@pytest.mark.parametrize(
    "payload,code,status",
    [(b"", "unreadable_image", 422), (b"GIF89a broken", "unreadable_image", 422)],
    ids=["empty", "corrupt"],
)
def test_verify_rejects_bad_photos_with_a_typed_error(client, photos_dir, payload, code, status):
    good = (photos_dir / "people" / "obama" / "1.jpg").open("rb")
    r = client.post("/v1/verify", files={"photo1": ("bad.jpg", payload), "photo2": good})
    assert r.status_code == status and r.json()["code"] == code and "bad.jpg" in r.json()["message"]


def test_verify_without_a_face_is_no_face(client, photos_dir):
    blank = io.BytesIO()
    Image.new("RGB", (300, 300), (10, 200, 10)).save(blank, format="JPEG")
    good = (photos_dir / "people" / "obama" / "1.jpg").open("rb")
    r = client.post("/v1/verify", files={"photo1": good, "photo2": ("green.jpg", blank.getvalue())})
    assert r.status_code == 422 and r.json()["code"] == "no_face"


@pytest.mark.parametrize("order", ["no_face first", "unreadable first"])
def test_verify_with_two_bad_photos_reports_the_first(client, order):
    """The two photos are detected side by side; the answer is still the first photo's error."""
    blank = io.BytesIO()
    Image.new("RGB", (300, 300), (10, 200, 10)).save(blank, format="JPEG")
    no_face, unreadable = ("green.jpg", blank.getvalue()), ("broken.jpg", b"GIF89a broken")
    first, second = (no_face, unreadable) if order == "no_face first" else (unreadable, no_face)
    r = client.post("/v1/verify", files={"photo1": first, "photo2": second})
    code = "no_face" if order == "no_face first" else "unreadable_image"
    assert r.status_code == 422 and r.json()["code"] == code and first[0] in r.json()["message"]


def test_verify_with_reject_policy_refuses_a_photo_of_several_faces(client, photos_dir):
    two = (photos_dir / "scenes" / "two_faces_kit_rose.jpg").open("rb")
    one = (photos_dir / "people" / "kit_harington" / "1.jpg").open("rb")
    r = client.post("/v1/verify?multiple_faces=reject", files={"photo1": two, "photo2": one})
    assert r.status_code == 422 and r.json()["code"] == "multiple_faces"


def test_too_many_pixels_is_image_too_large(client, photos_dir):
    big = (photos_dir / "people" / "obama" / "3.jpg").open("rb")  # 3.3 MP: within the limit
    huge = io.BytesIO()
    Image.new("RGB", (3000, 2000)).save(huge, format="JPEG")
    r = client.post("/v1/verify", files={"photo1": ("huge.jpg", huge.getvalue()), "photo2": big})
    assert r.status_code == 413 and r.json()["code"] == "image_too_large"


def test_missing_field_is_invalid_request(client, photos_dir):
    r = client.post("/v1/verify", files={"photo1": (photos_dir / "people" / "obama" / "1.jpg").open("rb")})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
