"""Unknown faces kept and clustered: the pool in a real Redis (and a Redis Cluster) with vectors
made to be near or far, and the API end to end with real photos and the default model."""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from PIL import Image

from service.app import create_app
from service.redis_server import LocalRedis
from service.settings import Settings
from service.unknowns.clustering import PoolView, link_score
from service.unknowns.pool import KeptFace, MergeRule, Retention, UnknownPool
from tests.conftest import short_temp_dir

DIM = 64
RULE = MergeRule(threshold=0.9, far=1e-5, name="far_1e-05")


def person(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(DIM)
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def photo_of(base: np.ndarray, seed: int, spread: float = 0.1) -> np.ndarray:
    """Another photo of the person of ``base``: cosine to it about 1 - spread**2 / 2 (~0.995)."""
    noise = np.random.default_rng(1000 + seed).standard_normal(DIM) * spread / np.sqrt(DIM)
    vector = base + noise
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def make_pool(client, **kwargs) -> UnknownPool:
    return UnknownPool(client, "test-model", DIM, RULE, known_threshold=0.9, **kwargs)


def kept(vector: np.ndarray) -> KeptFace:
    return KeptFace(embedding=vector, source="camera-1", photo_sha256="ab" * 32)


# -- the rule --------------------------------------------------------------------------------------
def test_link_score_averages_the_three_best_cosines():
    assert link_score(np.array([0.1, 0.95, 0.9, 0.2, 0.85])) == pytest.approx(0.9)
    assert link_score(np.array([0.97])) == pytest.approx(0.97)


def test_one_close_face_does_not_pull_a_stranger_into_a_large_cluster():
    view = PoolView(2)
    for i, angle in enumerate([0.0, 0.3, 0.6]):
        view.add(f"a{i}", np.array([np.cos(angle), np.sin(angle)], np.float32), "A", float(i))
    # cosine 0.91 to the nearest face of A, far below 0.9 to the others: the mean of three fails
    stranger = np.array([np.cos(-0.43), np.sin(-0.43)], np.float32)
    assert view.scores(stranger).max() >= 0.9
    assert view.assign(stranger, 0.9) is None
    assert view.assign(np.array([np.cos(0.3), np.sin(0.3)], np.float32), 0.9) == "A"


def test_removing_a_face_keeps_the_other_rows_right():
    view = PoolView(DIM, capacity=2)
    vectors = {f"f{i}": person(i) for i in range(5)}
    for i, (face_id, vector) in enumerate(vectors.items()):
        view.add(face_id, vector, f"c{i}", float(i))
    assert view.remove("f1") and not view.remove("f1")
    for face_id in ("f0", "f2", "f3", "f4"):
        assert np.array_equal(view.vectors[view.rows[face_id]], vectors[face_id])
    assert "c1" not in view.members and len(view) == 4


# -- the pool in Redis -----------------------------------------------------------------------------
def test_photos_of_one_person_share_a_cluster_and_strangers_get_their_own(redis_client):
    pool = make_pool(redis_client)
    alice, bob = person(1), person(2)
    a = [pool.add(kept(photo_of(alice, i))) for i in range(3)]
    b = [pool.add(kept(photo_of(bob, 10 + i))) for i in range(2)]
    assert len({cluster for _, cluster in a}) == 1
    assert len({cluster for _, cluster in b}) == 1
    assert a[0][1] != b[0][1]
    assert pool.clusters() == [(a[0][1], 3), (b[0][1], 2)]
    stored = pool.faces([a[0][0]], with_embedding=True)[0]
    assert stored.source == "camera-1" and stored.cluster_id == a[0][1]
    assert np.allclose(stored.embedding, photo_of(alice, 0))


def test_two_workers_cluster_as_one(redis_server):
    first = make_pool(redis.Redis.from_url(redis_server.url))
    second = make_pool(redis.Redis.from_url(redis_server.url))
    alice = person(3)
    _, cluster = first.add(kept(photo_of(alice, 0)))
    assert second.add(kept(photo_of(alice, 1)))[1] == cluster  # second reads first's face
    assert first.add(kept(photo_of(alice, 2)))[1] == cluster
    assert first.clusters() == second.clusters() == [(cluster, 3)]
    first.remove(first.cluster_face_ids(cluster))
    assert second.clusters() == []


def test_an_add_chosen_on_an_old_pool_is_assigned_again(redis_server):
    first = make_pool(redis.Redis.from_url(redis_server.url))
    second = make_pool(redis.Redis.from_url(redis_server.url))
    second.refresh()  # second's view: the empty pool
    _, cluster = first.add(kept(photo_of(person(4), 0)))
    stale_rev = second.revision
    refresh = second._refresh
    calls = []

    def late_refresh() -> int:  # the first try sees the old pool, as a worker that lost the race
        calls.append(1)
        return stale_rev if len(calls) == 1 else refresh()

    second._refresh = late_refresh
    assert second.add(kept(photo_of(person(4), 1)))[1] == cluster
    assert len(calls) == 2


def test_the_oldest_faces_go_beyond_the_count_limit(redis_client):
    pool = make_pool(redis_client, retention=Retention(max_faces=3, max_age_s=3600))
    ids = [pool.add(kept(person(20 + i)))[0] for i in range(5)]
    pool.refresh()
    assert sorted(pool.view.ids) == sorted(ids[2:])
    assert redis_client.zcard(pool.base + "faces") == 3
    assert not redis_client.exists(pool.face_key(ids[0]))


def test_faces_older_than_the_age_limit_go(redis_client):
    pool = make_pool(redis_client, retention=Retention(max_faces=100, max_age_s=0.3))
    pool.add(kept(person(30)))
    time.sleep(0.4)
    assert pool.evict() == 1
    assert pool.clusters() == []


def test_faces_an_enrolled_face_now_identifies_leave_the_pool(redis_client):
    pool = make_pool(redis_client)
    carol, dave = person(40), person(41)
    carols = [pool.add(kept(photo_of(carol, i)))[0] for i in range(2)]
    daves = [pool.add(kept(photo_of(dave, 10 + i)))[0] for i in range(2)]
    assert sorted(pool.remove_matching(photo_of(carol, 99)[None])) == sorted(carols)
    pool.refresh()
    assert sorted(pool.view.ids) == sorted(daves)


def test_a_worker_far_behind_reloads_the_pool(redis_server):
    first = make_pool(redis.Redis.from_url(redis_server.url))
    second = make_pool(redis.Redis.from_url(redis_server.url))
    second.refresh()
    for i in range(3):
        first.add(kept(person(50 + i)))
    first.redis.xtrim(first.base + "changes", maxlen=1)  # the entries second needs are gone
    second.refresh()
    first.refresh()
    assert sorted(second.view.ids) == sorted(first.view.ids) and len(second.view) == 3


def test_the_pool_works_on_a_redis_cluster(redis_cluster):
    client = redis_cluster.client()
    try:
        pool = make_pool(client, prefix=f"t{time.time_ns()}:")
        alice = person(60)
        clusters = {pool.add(kept(photo_of(alice, i)))[1] for i in range(3)}
        assert len(clusters) == 1
        assert pool.clusters() == [(clusters.pop(), 3)]
    finally:
        client.close()


# -- the API with real photos ----------------------------------------------------------------------
ADMIN = {"X-API-Key": "test-admin-key"}


@pytest.fixture(scope="module")
def server(redis_binary):
    folder = short_temp_dir()
    server = LocalRedis(folder / "redis", binary=redis_binary).start()
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def client(default_model_dir: Path, server: LocalRedis):
    settings = Settings(
        model_dir=default_model_dir, redis_url=server.url, api_key=ADMIN["X-API-Key"], keep_unknown=True
    )
    with TestClient(create_app(settings)) as c:
        yield c


def identify(client, path: Path, **params) -> dict:
    files = [("photo", (path.name, path.read_bytes(), "image/jpeg"))]
    r = client.post("/v1/identify", files=files, params=params, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.shared_data
def test_strangers_are_clustered_and_a_named_cluster_is_known_later(client, server, photos_dir):
    server.client().flushall()
    people = photos_dir / "people"
    seen = [identify(client, people / "obama" / f"{i}.jpg", source="door")["faces"][0] for i in (1, 2, 3)]
    seen += [identify(client, people / "kit_harington" / f"{i}.jpg")["faces"][0] for i in (1, 2)]
    assert all(face["status"] == "unknown" and face["unknown_face_id"] for face in seen)
    obama_cluster = seen[0]["cluster_id"]
    assert {face["cluster_id"] for face in seen[:3]} == {obama_cluster}
    assert seen[3]["cluster_id"] == seen[4]["cluster_id"] != obama_cluster

    page = client.get("/v1/unknowns/clusters", headers=ADMIN).json()
    assert [(c["id"], c["faces"]) for c in page["clusters"]] == [
        (obama_cluster, 3),
        (seen[3]["cluster_id"], 2),
    ]
    assert page["rule"]["threshold_name"] == "far_1e-05" and page["rule"]["threshold"] > 0.9
    assert page["pooled_faces"] == 5
    detail = client.get(f"/v1/unknowns/clusters/{obama_cluster}", headers=ADMIN).json()
    assert [f["id"] for f in detail["faces"]] == [face["unknown_face_id"] for face in seen[:3]]
    assert {f["source"] for f in detail["faces"]} == {"door"}
    image = client.get(f"/v1/unknowns/faces/{seen[0]['unknown_face_id']}/image", headers=ADMIN)
    assert image.status_code == 200 and Image.open(io.BytesIO(image.content)).format == "JPEG"

    r = client.post(
        f"/v1/unknowns/clusters/{obama_cluster}/enroll",
        json={"subject_id": "obama", "create_subject": True, "name": "Barack Obama"},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    assert r.json()["subject_created"] and len(r.json()["enrolled"]) == 3 and r.json()["left_pool"] == 3
    later = identify(client, people / "obama" / "4.jpg")["faces"][0]
    assert later["status"] == "known" and later["subject_id"] == "obama"
    assert later["unknown_face_id"] is None
    remaining = client.get("/v1/unknowns/clusters", headers=ADMIN).json()["clusters"]
    assert [c["id"] for c in remaining] == [seen[3]["cluster_id"]]


@pytest.mark.shared_data
def test_enrolling_a_subject_takes_its_faces_out_of_the_pool(client, server, photos_dir):
    server.client().flushall()
    kit = photos_dir / "people" / "kit_harington"
    face = identify(client, kit / "1.jpg")["faces"][0]
    files = [("photos", ("2.jpg", (kit / "2.jpg").read_bytes(), "image/jpeg"))]
    r = client.post(
        "/v1/enroll", files=files, data={"subjects": "kit"}, params={"create_subjects": True}, headers=ADMIN
    )
    assert r.status_code == 200 and r.json()["enrolled"] == 1, r.text
    gone = client.get(f"/v1/unknowns/clusters/{face['cluster_id']}", headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["code"] == "unknown_cluster_not_found"


@pytest.mark.shared_data
def test_missing_clusters_and_faces_are_typed_404s(client, server):
    server.client().flushall()
    for method, path, code in [
        ("get", "/v1/unknowns/clusters/cmissing", "unknown_cluster_not_found"),
        ("delete", "/v1/unknowns/clusters/cmissing", "unknown_cluster_not_found"),
        ("delete", "/v1/unknowns/faces/umissing", "unknown_face_not_found"),
        ("get", "/v1/unknowns/faces/umissing/image", "unknown_face_not_found"),
    ]:
        r = getattr(client, method)(path, headers=ADMIN)
        assert (r.status_code, r.json()["code"]) == (404, code), (path, r.text)
    r = client.post("/v1/unknowns/clusters/cmissing/enroll", json={"subject_id": "x"}, headers=ADMIN)
    assert (r.status_code, r.json()["code"]) == (404, "unknown_cluster_not_found")


@pytest.mark.shared_data
def test_deleting_a_face_and_a_cluster(client, server, photos_dir):
    server.client().flushall()
    lennon = photos_dir / "people" / "lennon"
    faces = [identify(client, lennon / f"{i}.jpg")["faces"][0] for i in (1, 2)]
    r = client.delete(f"/v1/unknowns/faces/{faces[0]['unknown_face_id']}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["removed"] == 1
    left = client.get("/v1/unknowns/clusters", headers=ADMIN).json()
    assert left["pooled_faces"] == 1
    r = client.delete(f"/v1/unknowns/clusters/{faces[1]['cluster_id']}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["removed"] == 1
    assert client.get("/v1/unknowns/clusters", headers=ADMIN).json()["total"] == 0


@pytest.mark.shared_data
def test_without_the_setting_nothing_is_kept(default_model_dir, server, photos_dir):
    server.client().flushall()
    settings = Settings(model_dir=default_model_dir, redis_url=server.url, api_key=ADMIN["X-API-Key"])
    with TestClient(create_app(settings)) as plain:
        face = identify(plain, photos_dir / "people" / "lennon" / "1.jpg")["faces"][0]
        assert face["status"] == "unknown" and face["unknown_face_id"] is None
        r = plain.get("/v1/unknowns/clusters", headers=ADMIN)
        assert (r.status_code, r.json()["code"]) == (404, "unknowns_off")
    assert not server.client().keys("*unknowns*")
