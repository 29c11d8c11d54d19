"""Requests a hostile or careless client sends, each found by fuzzing the service (a 500, a
stored record that broke later reads, or a misleading answer before the fix): a real
redis-server, the default model, real photos. Every answer must be a typed 4xx."""

from __future__ import annotations

import io
import re
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


# -- strict inputs: numbers are numbers, one value per key, ids and names that stay what they say --


def post_json(client, path: str, body: bytes, method: str = "post"):
    return getattr(client, method)(path, content=body, headers={**ADMIN, "content-type": "application/json"})


@pytest.mark.parametrize(
    "bad",
    [["0.1"] * 128, [True] * 128, [0.1] * 127 + ["0.1"], [0.1] * 127 + [False]],
    ids=["strings", "booleans", "one string", "one boolean"],
)
def test_embeddings_of_strings_or_booleans_are_refused(empty, bad):
    """Strings and booleans are not cast: cast, `["0.1", ...]` against `[true, ...]` would be
    `same_person: true` (200), and such vectors could be enrolled."""
    good = [0.1] * 128
    calls = [
        ("/v1/verify", {"embedding1": bad, "embedding2": good}),
        ("/v1/identify", {"embeddings": [bad]}),
        ("/v1/enroll", {"subjects": ["ada"], "embeddings": [bad], "create_subjects": True}),
    ]
    for path, body in calls:
        status, code, message = error(empty.post(path, json=body, headers=ADMIN))
        assert (status, code) == (422, "invalid_request") and "valid number" in message, (path, message)
    empty.post("/v1/subjects", json={"id": "bob"}, headers=ADMIN)
    r = empty.post("/v1/subjects/bob/faces", json={"embeddings": [bad]}, headers=ADMIN)
    assert error(r)[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects/bob/faces", headers=ADMIN).json()["total"] == 0
    assert empty.get("/v1/subjects/ada", headers=ADMIN).status_code == 404
    # integers are numbers
    r = empty.post(
        "/v1/verify", json={"embedding1": [1] + [0] * 127, "embedding2": [1.0] * 128}, headers=ADMIN
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("flag", ["true", 1, "yes"])
def test_a_flag_is_true_or_false_only(empty, flag):
    body = {"subjects": ["ada"], "embeddings": [[0.1] * 128], "create_subjects": flag}
    assert error(empty.post("/v1/enroll", json=body, headers=ADMIN))[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0


def test_a_repeated_json_key_is_refused_wherever_it_is(empty):
    """No last-value-wins: with it, `{"id": "dupa", "id": "dupb"}` creates `dupb`, and a NaN
    `embedding1` followed by a valid one is verified (200)."""
    r = post_json(empty, "/v1/subjects", b'{"id": "dupa", "id": "dupb"}')
    status, code, message = error(r)
    assert (status, code) == (422, "invalid_request") and "'id' more than once" in message
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0
    vector = ", ".join(["0.1"] * 128)
    nan_first = f'{{"embedding1": [NaN{", 0.1" * 127}], "embedding1": [{vector}], "embedding2": [{vector}]}}'
    assert error(post_json(empty, "/v1/verify", nan_first.encode()))[:2] == (422, "invalid_request")
    nested = b'{"id": "ada", "metadata": {"team": "a", "team": "b"}}'
    assert error(post_json(empty, "/v1/subjects", nested))[:2] == (422, "invalid_request")
    assert empty.post("/v1/subjects", json={"id": "ada", "name": "Ada"}, headers=ADMIN).status_code == 201
    twice = b'{"name": "Eve", "name": "Ada"}'
    assert error(post_json(empty, "/v1/subjects/ada", twice, "patch"))[:2] == (422, "invalid_request")
    bulk = f'{{"subjects": ["ada"], "subjects": ["x"], "embeddings": [[{vector}]]}}'.encode()
    assert error(post_json(empty, "/v1/enroll", bulk))[:2] == (422, "invalid_request")
    faces = f'{{"embeddings": [[{vector}]], "embeddings": [[{vector}]]}}'.encode()
    assert error(post_json(empty, "/v1/subjects/ada/faces", faces))[:2] == (422, "invalid_request")
    assert error(post_json(empty, "/v1/identify", faces))[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects/ada", headers=ADMIN).json()["name"] == "Ada"
    assert empty.get("/v1/subjects/ada/faces", headers=ADMIN).json()["total"] == 0


@pytest.mark.parametrize("subject_id", [".", "..", "..."])
def test_ids_of_dots_only_are_refused(empty, subject_id):
    """A subject `..` would be one no URL can reach: clients drop `.` and `..` path segments
    (`/v1/subjects/..` is `/v1`)."""
    status, code, message = error(empty.post("/v1/subjects", json={"id": subject_id}, headers=ADMIN))
    assert (status, code) == (422, "invalid_request") and "not only dots" in message
    body = {"subjects": [subject_id], "embeddings": [[0.1] * 128], "create_subjects": True}
    assert error(empty.post("/v1/enroll", json=body, headers=ADMIN))[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0
    for fine in (".ada", "a..b", "ada."):
        assert empty.post("/v1/subjects", json={"id": fine}, headers=ADMIN).status_code == 201


INVISIBLE = ["\u2028", "\u2029", "\u200b", "\u00ad", "\ufeff", "\u2060", "\u200d", "\U000e0041", "\x85"]


@pytest.mark.parametrize("char", INVISIBLE, ids=lambda c: f"U+{ord(c):04X}")
def test_names_refuse_line_separators_and_invisible_format_characters(empty, char):
    """Every control, format (zero-width, soft hyphen, tags), line and paragraph separator
    character is refused, not only C0/C1 controls and bidirectional controls."""
    name = f"Ada{char}Lovelace"
    status, code, message = error(empty.post("/v1/subjects", json={"id": "ada", "name": name}, headers=ADMIN))
    assert (status, code) == (422, "invalid_request") and f"U+{ord(char):04X}" in message
    assert empty.post("/v1/subjects", json={"id": "ada", "name": "Ada"}, headers=ADMIN).status_code == 201
    r = empty.patch("/v1/subjects/ada", json={"name": name}, headers=ADMIN)
    assert error(r)[:2] == (422, "invalid_request")
    assert empty.get("/v1/subjects/ada", headers=ADMIN).json()["name"] == "Ada"


def test_the_documented_name_pattern_is_the_rule_enforced(empty):
    """The OpenAPI pattern of names refuses exactly what the service refuses (schemathesis
    generates names from it, on both sides of it)."""
    schema = empty.get("/openapi.json").json()["components"]["schemas"]["SubjectCreate"]["properties"]
    pattern = re.compile(schema["name"]["pattern"])
    samples = INVISIBLE + ["\x00", "\x1b", "\u202e", "\u061c", "a", "Zoë", "李", "😀", "\u0301", "\U0010fff0"]
    for char in samples:
        name = f"A{char}"
        refused = empty.post("/v1/subjects", json={"name": name}, headers=ADMIN).status_code == 422
        assert refused == (pattern.match(name) is None), f"U+{ord(char):04X}"


def test_metadata_is_opaque_json_kept_exactly_and_stored_escaped(empty, module_redis):
    """Metadata is the client's own JSON: its strings may hold line breaks, NUL or U+202E (a
    note, a token) and come back exactly as sent. Redis keeps it as JSON text with every
    non-ASCII and control character escaped, and answers are JSON, so nothing reaches a log or a
    terminal raw. This pins that decision (it held before too)."""
    metadata = {"note": "line one\r\nline two", "raw": "a\x00b", "rtl": "\u202eabc", "sep": "\u2028"}
    r = empty.post("/v1/subjects", json={"id": "ada", "metadata": metadata}, headers=ADMIN)
    assert r.status_code == 201 and r.json()["metadata"] == metadata
    assert empty.get("/v1/subjects/ada", headers=ADMIN).json()["metadata"] == metadata
    stored = module_redis.client().hget("sf:subject:ada", "metadata")
    assert stored.isascii() and b"\\u202e" in stored and b"\\r\\n" in stored and b"\x00" not in stored


@pytest.mark.parametrize("count", [5, 999, 1000, 1001, 1500])
def test_too_many_photos_is_413_at_every_count(empty, count):
    """Over Starlette's own limit of 1,000 parts too (where /v1/embed would answer its 422
    "Maximum number of files is 1000")."""
    parts = [("photos", (f"{i}.jpg", b"x", "image/jpeg")) for i in range(count)]
    status, code, message = error(empty.post("/v1/embed", files=parts, headers=ADMIN))
    assert (status, code) == (413, "too_many_photos") and "at most 4 photos" in message
    data = {"subjects": ["ada"] * count}
    r = empty.post("/v1/enroll", files=parts, data=data, params={"create_subjects": True}, headers=ADMIN)
    assert error(r)[:2] == (413, "too_many_photos")
    many = [(f"photo{1 + i % 2}", (f"{i}.jpg", b"x", "image/jpeg")) for i in range(count)]
    assert error(empty.post("/v1/verify", files=many, headers=ADMIN))[:2] == (413, "too_many_photos")
    photo = [("photo", (f"{i}.jpg", b"x", "image/jpeg")) for i in range(count)]
    assert error(empty.post("/v1/identify", files=photo, headers=ADMIN))[:2] == (413, "too_many_photos")
    assert empty.get("/v1/subjects", headers=ADMIN).json()["total"] == 0


def test_bulk_enrollment_creates_only_subjects_that_get_a_face(empty, photos_dir):
    """`create_subjects` creates a subject with its first stored face only: not one whose items
    all fail (`subjects_created: ["ghost3"]` with `enrolled: 0` would be a subject nobody
    enrolled)."""
    dds = ("bomb.dds", dds_with_an_unknown_pixel_format(), "image/x-dds")
    r = empty.post(
        "/v1/enroll",
        files=[("photos", dds)],
        data={"subjects": ["ghost3"]},
        params={"create_subjects": True},
        headers=ADMIN,
    )
    assert r.status_code == 200 and (r.json()["enrolled"], r.json()["subjects_created"]) == (0, [])
    good = photos_dir / "people" / "obama" / "1.jpg"
    files = [("photos", dds), ("photos", ("1.jpg", good.read_bytes(), "image/jpeg")), ("photos", dds)]
    r = empty.post(
        "/v1/enroll",
        files=files,
        data={"subjects": ["ghost1", "obama", "ghost2"]},
        params={"create_subjects": True},
        headers=ADMIN,
    )
    assert r.json()["subjects_created"] == ["obama"], r.text
    zero, unit = [0.0] * 128, [1.0] + [0.0] * 127
    body = {"subjects": ["ghost4", "ada", "ada"], "embeddings": [zero, zero, unit], "create_subjects": True}
    r = empty.post("/v1/enroll", json=body, headers=ADMIN)
    statuses = [item["status"] for item in r.json()["items"]]
    assert statuses == ["invalid_embedding", "invalid_embedding", "ok"] and r.json()["subjects_created"] == [
        "ada"
    ]
    listed = empty.get("/v1/subjects", headers=ADMIN).json()["subjects"]
    assert sorted(s["id"] for s in listed) == ["ada", "obama"]
    assert {s["id"]: s["face_count"] for s in listed} == {"ada": 1, "obama": 1}
