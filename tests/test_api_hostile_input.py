"""Requests a hostile or careless client sends, each found by fuzzing the service (a 500, a
stored record that broke later reads, or a misleading answer before the fix): a real
redis-server, the default model, real photos. Every answer must be a typed 4xx."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.app import create_app
from service.redis_server import LocalRedis
from service.settings import Settings

pytestmark = pytest.mark.shared_data

ADMIN = {"X-API-Key": "hostile-test-admin-key"}
BODY_LIMIT = 3_000_000


@pytest.fixture(scope="module")
def client(default_model_dir: Path, module_redis: LocalRedis):
    settings = Settings(
        model_dir=default_model_dir,
        redis_url=module_redis.url,
        api_key=ADMIN["X-API-Key"],
        max_request_bytes=BODY_LIMIT,
        max_photos_per_request=4,
        max_bulk_items=4,
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def empty(client, module_redis):
    module_redis.client().flushall()
    return client


def error(response) -> tuple[int, str, str]:
    body = response.json()
    return response.status_code, body["code"], body["message"]


def tiny_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 90, 60)).save(buf, "JPEG")
    return buf.getvalue()


def dds_with_an_unknown_pixel_format() -> bytes:
    header = b"DDS " + struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + bytes(44)
    pixel_format = struct.pack("<2I", 32, 0x4) + b"XYZ1" + bytes(20)
    return header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + bytes(64)


# -- keys before bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"), [("post", "/v1/subjects"), ("patch", "/v1/subjects/ada"), ("post", "/v1/embed")]
)
def test_the_key_is_checked_before_the_body_is_read(empty, method, path):
    """Before: these routes parsed the body first, so a keyless `{` got 422 (and a keyless body
    was read up to the limit) instead of 401."""
    broken = {"content": b"{", "headers": {"content-type": "application/json"}}
    status, code, _ = error(getattr(empty, method)(path, **broken))
    assert (status, code) == (401, "missing_api_key")
    wrong = {"X-API-Key": "sfk_0123456789ab_" + "A" * 43, "content-type": "application/json"}
    status, code, _ = error(getattr(empty, method)(path, content=b"{", headers=wrong))
    assert (status, code) == (401, "invalid_api_key")


# -- strict and clean text ------------------------------------------------------------------------


def test_unknown_fields_are_refused_by_name(empty):
    status, code, message = error(
        empty.post("/v1/subjects", json={"id": "ada", "nmae": "Ada"}, headers=ADMIN)
    )
    assert (status, code) == (422, "invalid_request") and "nmae" in message
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0
    r = empty.post("/v1/verify", json={"embedding1": [1.0], "embedding2": [1.0], "k": 3}, headers=ADMIN)
    assert error(r)[:2] == (422, "invalid_request") and "k" in error(r)[2]


@pytest.mark.parametrize("name", ["Ada\x00", "Ada\x1b[31m", "Ada\r\nX-Injected: 1", "\u202eadA"])
def test_names_with_control_characters_are_refused(empty, name):
    status, code, message = error(empty.post("/v1/subjects", json={"id": "ada", "name": name}, headers=ADMIN))
    assert (status, code) == (422, "invalid_request") and "control characters" in message
    assert (
        empty.post("/v1/subjects", json={"id": "ada", "name": "  Zoë  "}, headers=ADMIN).json()["name"]
        == "Zoë"
    )
    r = empty.patch("/v1/subjects/ada", json={"name": name}, headers=ADMIN)
    assert error(r)[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects/ada", headers=ADMIN).json()["name"] == "Zoë"


def test_a_lone_surrogate_is_refused_and_nothing_is_stored(empty):
    """Before: 500, but the subject was stored, and every listing page holding it answered 500."""
    body = b'{"id": "sur2", "metadata": {"k": "\\ud800"}}'
    r = empty.post("/v1/subjects", content=body, headers={**ADMIN, "content-type": "application/json"})
    assert error(r)[:2] == (422, "invalid_request") and "surrogate" in error(r)[2]
    listing = empty.get("/v1/subjects", headers=ADMIN)
    assert listing.status_code == 200 and listing.json()["total"] == 0


def test_paging_past_the_end_of_64_bits_is_refused(empty):
    for offset in (2**63, 2**63 - 1, 10**12):
        r = empty.get("/v1/subjects", params={"offset": offset}, headers=ADMIN)
        assert error(r)[:2] == (422, "invalid_request"), r.text
    assert empty.get("/v1/subjects", params={"offset": 10**9}, headers=ADMIN).json()["subjects"] == []


# -- limits are named for what they limit ----------------------------------------------------------


def test_too_many_photos_is_its_own_code(empty):
    photos = [("photos", (f"{i}.jpg", tiny_jpeg(), "image/jpeg")) for i in range(5)]
    status, code, message = error(empty.post("/v1/embed", files=photos, headers=ADMIN))
    assert (status, code) == (413, "too_many_photos") and "at most 4 photos" in message
    three = [(name, (f"{name}.jpg", tiny_jpeg(), "image/jpeg")) for name in ("photo1", "photo2", "photo2")]
    assert error(empty.post("/v1/verify", files=three, headers=ADMIN))[:2] == (413, "too_many_photos")
    r = empty.post(
        "/v1/enroll",
        json={"subjects": ["a"] * 5, "embeddings": [[0.1] * 128] * 5, "create_subjects": True},
        headers=ADMIN,
    )
    assert error(r)[:2] == (413, "too_many_photos")


def test_an_oversized_chunked_body_is_413_not_400(empty):
    def chunks():
        piece = b" " * 65536
        yield b'{"id": "ada", "name": "'
        for _ in range(BODY_LIMIT // len(piece) + 2):
            yield piece
        yield b'"}'

    headers = {**ADMIN, "content-type": "application/json"}
    status, code, _ = error(empty.post("/v1/subjects", content=chunks(), headers=headers))
    assert (status, code) == (413, "request_too_large")


# -- images no decoder should take down ------------------------------------------------------------


def test_a_photo_the_decoder_cannot_handle_is_unreadable_not_a_500(empty, photos_dir):
    dds = ("bad.dds", dds_with_an_unknown_pixel_format(), "image/x-dds")
    r = empty.post("/v1/embed", files=[("photos", dds)], headers=ADMIN)
    assert r.status_code == 200 and r.json()["photos"][0]["status"] == "unreadable_image"
    assert error(empty.post("/v1/identify", files=[("photo", dds)], headers=ADMIN))[:2] == (
        422,
        "unreadable_image",
    )
    # in a bulk enrollment it fails alone; the other photo is enrolled
    good = photos_dir / "people" / "obama" / "1.jpg"
    files = [("photos", dds), ("photos", ("1.jpg", good.read_bytes(), "image/jpeg"))]
    r = empty.post(
        "/v1/enroll",
        files=files,
        data={"subjects": ["ada", "obama"]},
        params={"create_subjects": True},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    assert [item["status"] for item in r.json()["items"]] == ["unreadable_image", "ok"]


def test_a_16_bit_greyscale_photo_finds_its_face(empty, photos_dir):
    grey = np.asarray(Image.open(photos_dir / "people" / "biden" / "1.jpg").convert("L"))
    buf = io.BytesIO()
    Image.fromarray(grey.astype(np.uint16) * 257).save(buf, "PNG")
    r = empty.post(
        "/v1/embed", files=[("photos", ("grey16.png", buf.getvalue(), "image/png"))], headers=ADMIN
    )
    assert r.json()["photos"][0]["status"] == "ok" and len(r.json()["photos"][0]["faces"]) == 1


def test_the_multiple_faces_error_suggests_only_what_the_endpoint_takes(empty, photos_dir):
    empty.post("/v1/subjects", json={"id": "kit"}, headers=ADMIN)
    scene = photos_dir / "scenes" / "two_faces_kit_rose.jpg"
    r = empty.post(
        "/v1/subjects/kit/faces", files=[("photos", (scene.name, scene.read_bytes()))], headers=ADMIN
    )
    (item,) = r.json()["items"]
    assert item["status"] == "multiple_faces"
    assert "largest" in item["message"] and "all" not in item["message"].replace("central", "")


def test_embeddings_of_the_wrong_size_refuse_the_whole_enrollment_before_anything_is_stored(empty):
    good, short = [0.1] * 128, [0.1] * 3
    body = {"subjects": ["ada", "bob"], "embeddings": [good, short], "create_subjects": True}
    status, code, message = error(empty.post("/v1/enroll", json=body, headers=ADMIN))
    assert (status, code) == (422, "invalid_embedding") and "item 1 has 3" in message
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0  # no subject created either
    empty.post("/v1/subjects", json={"id": "ada"}, headers=ADMIN)
    r = empty.post("/v1/subjects/ada/faces", json={"embeddings": [short]}, headers=ADMIN)
    assert error(r)[:2] == (422, "invalid_embedding")
