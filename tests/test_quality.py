"""The face quality score: it orders real photos made worse (downscaled, blurred, rotated), its
ingredients read what they say, every endpoint returns it, and enrollment refuses a face under
the floor with ``low_quality`` and the reason."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageFilter

from models.align import get_template
from models.pipeline import FacePipeline
from models.quality import (
    DEFAULT_QUALITY_MODEL,
    face_quality,
    head_pose,
    score_features,
)
from service.app import create_app
from service.redis_server import LocalRedis
from service.settings import Settings
from tests.conftest import short_temp_dir
from training.evaluation.quality_fit import Pairs, edc_curve, fit_logistic

ROOT = Path(__file__).resolve().parents[1]
ADMIN = {"X-API-Key": "test-admin-key"}


# -- the ingredients ----------------------------------------------------------------------------
def test_a_frontal_face_has_no_yaw_and_a_turned_one_has_much():
    frontal = get_template("sphereface_112x96").as_array()
    turned = frontal.copy()
    turned[2, 0] += 0.4 * (frontal[1, 0] - frontal[0, 0])  # the nose towards the right eye
    assert head_pose(frontal)["yaw"] < 0.05
    assert head_pose(turned)["yaw"] > 0.3
    tilted = frontal @ np.array([[0.0, 1.0], [-1.0, 0.0]])  # the whole face a quarter turn
    assert head_pose(tilted)["roll"] == pytest.approx(90.0, abs=1.0)
    assert head_pose(tilted)["yaw"] == pytest.approx(head_pose(frontal)["yaw"], abs=1e-6)


def test_the_score_names_pose_as_the_reason_for_a_turned_face():
    features = {**DEFAULT_QUALITY_MODEL.reference, "yaw": 0.9}
    assert score_features(features).reason == "turned_away"
    assert score_features(features).score < score_features(DEFAULT_QUALITY_MODEL.reference).score


def test_the_shipped_weights_are_the_fitted_ones():
    fitted = json.loads((ROOT / "docs/results/quality.json").read_text())["model"]
    shipped = DEFAULT_QUALITY_MODEL
    assert fitted["weights"] == dict(shipped.weights) and fitted["intercept"] == shipped.intercept
    assert fitted["reference"] == dict(shipped.reference) and fitted["norm_scale"] == shipped.norm_scale


def test_logistic_fit_recovers_known_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 2))
    y = (rng.random(20_000) < 1 / (1 + np.exp(-(0.5 + 2.0 * x[:, 0] - 1.0 * x[:, 1])))).astype(float)
    beta = fit_logistic(x, y, np.ones(len(y)), l2=0.0)
    assert beta == pytest.approx([0.5, 2.0, -1.0], abs=0.1)


def test_rejecting_the_worst_pairs_removes_their_errors():
    score = np.array([0.1, 0.2, 0.9, 0.95, 0.97, 0.99])  # the two lowest fail at 0.5
    pairs = Pairs(np.arange(6), np.arange(6), score, np.ones(6), np.zeros(6, bool))
    curve = edc_curve(np.array([0.0, 0.1, 1, 1, 1, 1]), pairs, 0.5, grid=np.array([0.0, 1 / 3]))
    assert curve == pytest.approx([2 / 6, 0.0])
    worst_first = edc_curve(np.array([1, 1, 0.0, 0.1, 0.2, 0.3]), pairs, 0.5, grid=np.array([1 / 3]))
    assert worst_first == pytest.approx([2 / 4])


# -- real photos made worse -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline(default_model_dir: Path) -> FacePipeline:
    return FacePipeline(default_model_dir, intra_op_threads=1)


def _quality(pipeline: FacePipeline, image: np.ndarray):
    """The quality of the largest face of ``image`` as the service computes it."""
    faces, crops = pipeline.crops(image, "largest")
    raw = pipeline.embedder.embed(crops, normalize=False)
    f = faces[0]
    return face_quality(f.score, f.box, f.landmarks, crops[0], raw[0], model_id=pipeline.manifest.model_id)


def _face_photo(photos_dir: Path, width: int = 480) -> Image.Image:
    photo = Image.open(photos_dir / "people/obama/1.jpg").convert("RGB")
    return photo.resize((width, round(photo.height * width / photo.width)), Image.Resampling.LANCZOS)


def _scaled(photo: Image.Image, factor: float) -> Image.Image:
    return photo.resize((round(photo.width * factor), round(photo.height * factor)), Image.Resampling.BICUBIC)


@pytest.mark.shared_data
def test_downscaled_blurred_and_rotated_copies_score_in_order(pipeline, photos_dir):
    photo = _face_photo(photos_dir)
    original = _quality(pipeline, np.asarray(photo))
    side = original.features["size"]
    downscaled = []
    for face_px in (60, 36, 24):
        factor = face_px / 2**side
        small = photo.resize(
            (round(photo.width * factor), round(photo.height * factor)), Image.Resampling.BICUBIC
        )
        downscaled.append(_quality(pipeline, np.asarray(small)))
    blurred = [_quality(pipeline, np.asarray(photo.filter(ImageFilter.GaussianBlur(r)))) for r in (1.5, 3, 5)]
    rotated = [
        _quality(pipeline, np.asarray(photo.rotate(a, resample=Image.Resampling.BILINEAR))) for a in (30, 60)
    ]
    assert original.score > 0.95
    for series in (downscaled, blurred, rotated):
        scores = [original.score] + [q.score for q in series]
        assert scores == sorted(scores, reverse=True), scores
    floor = Settings.model_fields["min_quality"].default
    assert downscaled[-1].reason == "too_small" and downscaled[-1].score < floor
    assert blurred[-1].reason == "blurred" and blurred[-1].score < original.score - 0.1


# -- the service ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(default_model_dir: Path, redis_binary: str):
    folder = short_temp_dir()
    with LocalRedis(folder / "redis", binary=redis_binary) as redis:
        settings = Settings(model_dir=default_model_dir, redis_url=redis.url, api_key=ADMIN["X-API-Key"])
        with TestClient(create_app(settings)) as c:
            yield c
    shutil.rmtree(folder, ignore_errors=True)


def _jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=95)
    return out.getvalue()


@pytest.mark.shared_data
def test_every_endpoint_returns_the_quality_of_every_face(client, photos_dir):
    scene = (photos_dir / "scenes/two_faces_obama_biden.jpg").read_bytes()
    one = (photos_dir / "people/biden/1.jpg").read_bytes()
    embedded = client.post("/v1/embed", files=[("photos", ("s.jpg", scene))], headers=ADMIN).json()
    identified = client.post("/v1/identify", files={"photo": ("s.jpg", scene)}, headers=ADMIN).json()
    verified = client.post("/v1/verify", files={"photo1": one, "photo2": scene}, headers=ADMIN).json()
    client.post("/v1/subjects", json={"id": "biden"}, headers=ADMIN)
    enrolled = client.post(
        "/v1/subjects/biden/faces", files=[("photos", ("b.jpg", one))], headers=ADMIN
    ).json()
    listed = client.get("/v1/subjects/biden/faces", headers=ADMIN).json()
    faces = (
        embedded["photos"][0]["faces"]
        + identified["faces"]
        + verified["faces"]
        + [enrolled["items"][0]["face"]]
        + listed["faces"]
    )
    assert len(faces) >= 7
    assert all(0.0 <= face["quality"] <= 1.0 for face in faces), faces
    assert listed["faces"][0]["quality"] == enrolled["items"][0]["face"]["quality"]


@pytest.mark.shared_data
def test_enrollment_refuses_a_24_pixel_face_as_too_small(client, pipeline, photos_dir):
    photo = _face_photo(photos_dir)
    size = 2 ** _quality(pipeline, np.asarray(photo)).features["size"]
    tiny = _scaled(photo, 24 / size)
    client.post("/v1/subjects", json={"id": "obama"}, headers=ADMIN)
    files = [("photos", ("tiny.jpg", _jpeg(tiny))), ("photos", ("big.jpg", _jpeg(photo)))]
    r = client.post("/v1/subjects/obama/faces", files=files, headers=ADMIN)
    assert r.status_code == 200, r.text
    tiny_item, big_item = r.json()["items"]
    assert tiny_item["status"] == "low_quality" and tiny_item["reason"] == "too_small", tiny_item
    assert (
        "too small" in tiny_item["message"] and tiny_item["quality"] < client.app.state.settings.min_quality
    )
    assert big_item["status"] == "ok" and big_item["face"]["quality"] >= client.app.state.settings.min_quality


@pytest.mark.shared_data
def test_identification_scores_a_subject_by_all_its_faces_when_asked(client, photos_dir):
    """``aggregation=mean`` and ``quality-mean`` give the subject the (quality-weighted) mean
    cosine of its enrolled faces; ``max`` its best face's."""
    client.post("/v1/subjects", json={"id": "barack"}, headers=ADMIN)
    enrolled = [photos_dir / f"people/obama/{n}.jpg" for n in (2, 3)]
    files = [("photos", (p.name, p.read_bytes())) for p in enrolled]
    items = client.post("/v1/subjects/barack/faces", files=files, headers=ADMIN).json()["items"]
    assert [i["status"] for i in items] == ["ok", "ok"], items
    faces = client.get("/v1/subjects/barack/faces?embeddings=true", headers=ADMIN).json()["faces"]
    vectors = np.array([f["embedding"] for f in faces])
    weights = np.array([f["quality"] for f in faces])
    probe = (photos_dir / "people/obama/4.jpg").read_bytes()
    answer = client.post("/v1/embed", files=[("photos", ("p.jpg", probe))], headers=ADMIN).json()
    cosines = vectors @ np.array(answer["photos"][0]["faces"][0]["embedding"])
    weighted = cosines @ weights / weights.sum()
    for how, score in {"max": cosines.max(), "mean": cosines.mean(), "quality-mean": weighted}.items():
        r = client.post(f"/v1/identify?aggregation={how}", files={"photo": ("p.jpg", probe)}, headers=ADMIN)
        found = [c for c in r.json()["faces"][0]["candidates"] if c["subject_id"] == "barack"]
        assert found and found[0]["score"] == pytest.approx(score, abs=1e-4), (how, r.json())
