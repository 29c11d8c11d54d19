"""The service on a real Redis Cluster (3 primaries, 3 replicas): the --redis-cluster setting, API
keys and rate limits on the cluster client, and the guide's flow (create a subject, enroll,
identify) over HTTP through two app instances sharing the cluster."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from redis.cluster import RedisCluster

from models.cli import main as cli_main
from service.app import create_app, load_pipeline
from service.auth import authenticate, create_key, list_keys, revoke_key
from service.errors import InvalidApiKeyError, RedisSetupError
from service.gallery.store import GalleryStore
from service.rate_limit import Rate, RateLimitedError, RateLimiter
from service.redis_clients import gallery_client
from service.settings import Settings
from tests.gallery_vectors import emb_face, random_unit

ADMIN = {"X-API-Key": "cluster-admin-key"}


# -- settings -----------------------------------------------------------------------------------


def test_the_cluster_setting_reads_nodes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("SPHEREFACE_REDIS_URL", raising=False)
    monkeypatch.setenv("SPHEREFACE_REDIS_CLUSTER", "10.0.0.1:7000, node-b:7001,[::1]:7002")
    settings = Settings()
    settings.check_redis()
    assert settings.cluster_nodes() == [("10.0.0.1", 7000), ("node-b", 7001), ("::1", 7002)]


@pytest.mark.parametrize("value", ["localhost", "a:1,b", "a:0", "a:70000", ":7000", "a:port"])
def test_a_malformed_cluster_setting_is_refused(value: str) -> None:
    with pytest.raises(RedisSetupError, match="HOST:PORT"):
        Settings(redis_cluster=value, redis_url=None).check_redis()


def test_a_url_and_a_cluster_together_are_refused(monkeypatch, capsys) -> None:
    settings = Settings(redis_url="redis://localhost:6379/0", redis_cluster="localhost:7000")
    with pytest.raises(RedisSetupError, match="not both") as caught:
        settings.check_redis()
    assert caught.value.code == "redis_setup_failed"
    # The command says so before it starts anything.
    monkeypatch.setenv("REDIS_URL", "redis://localhost:6379/0")
    assert cli_main(["serve", "--redis-cluster", "localhost:7000"]) == 2
    assert "error [redis_setup_failed]" in capsys.readouterr().err
    monkeypatch.delenv("REDIS_URL")
    assert cli_main(["serve", "--redis-url", "redis://x:1/0", "--redis-cluster", "localhost:7000"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_cluster_that_does_not_answer_is_a_setup_error() -> None:
    settings = Settings(redis_url=None, redis_cluster="127.0.0.1:1", redis_timeout=0.2)
    with pytest.raises(RedisSetupError, match="does not answer as a cluster"):
        gallery_client(settings)


# -- keys and rate limits on the cluster client ----------------------------------------------------


@pytest.fixture
def cluster_client(redis_cluster):
    redis_cluster.flush()
    settings = Settings(redis_url=None, redis_cluster=redis_cluster.startup_nodes)
    client = gallery_client(settings)
    assert isinstance(client, RedisCluster)
    yield client
    client.close()


def test_api_keys_work_on_the_cluster_client(cluster_client) -> None:
    key, info = create_key(cluster_client, "read", "reader")
    admin, _ = create_key(cluster_client, "admin", "boss")
    assert authenticate(cluster_client, key, env_key=None).scope == "read"
    assert authenticate(cluster_client, admin, env_key=None).scope == "admin"
    assert sorted(k.name for k in list_keys(cluster_client)) == ["boss", "reader"]
    assert revoke_key(cluster_client, info.key_id)
    with pytest.raises(InvalidApiKeyError):
        authenticate(cluster_client, key, env_key=None)
    assert [k.name for k in list_keys(cluster_client)] == ["boss"]
    assert not revoke_key(cluster_client, info.key_id)


def test_rate_limits_work_on_the_cluster_client(cluster_client) -> None:
    limiter = RateLimiter({"read": Rate(per_second=0.5, burst=3)})
    taken = [limiter.check(cluster_client, "k1", "read") for _ in range(3)]
    assert [t.remaining for t in taken] == [2, 1, 0]
    with pytest.raises(RateLimitedError):
        limiter.check(cluster_client, "k1", "read")
    assert limiter.check(cluster_client, "k2", "read").remaining == 2  # a bucket per key


# -- the guide's flow over HTTP, two app instances on one cluster -----------------------------------


@pytest.fixture(scope="module")
def cluster_apps(redis_cluster, default_model_dir: Path):
    settings = Settings(
        model_dir=default_model_dir,
        redis_url=None,
        redis_cluster=redis_cluster.startup_nodes,
        api_key=ADMIN["X-API-Key"],
    )
    pipeline = load_pipeline(settings)  # one model for both instances
    redis_cluster.flush()
    with (
        TestClient(create_app(settings, pipeline)) as first,
        TestClient(create_app(settings, pipeline)) as second,
    ):
        yield first, second


def upload(path: Path, field: str = "photos"):
    return (field, (path.name, path.read_bytes(), "image/jpeg"))


@pytest.mark.shared_data
def test_enroll_through_one_instance_identify_through_another(cluster_apps, photos_dir) -> None:
    first, second = cluster_apps
    names = ("obama", "biden", "lennon", "clapton")
    photos = {name: sorted((photos_dir / "people" / name).glob("*.jpg")) for name in names}
    assert second.get("/readyz").json()["gallery_faces"] == 0
    for name in names:
        r = first.post("/v1/subjects", json={"id": name, "name": name.title()}, headers=ADMIN)
        assert r.status_code == 201, r.text
        r = first.post(f"/v1/subjects/{name}/faces", files=[upload(photos[name][0])], headers=ADMIN)
        assert r.status_code == 200 and r.json()["enrolled"] == 1, r.text
    store: GalleryStore = second.app.state.store
    assert store.cluster and len({store.partition_of(n) for n in names}) > 1
    for name in names:
        r = second.post("/v1/identify", files=[upload(photos[name][1], "photo")], headers=ADMIN)
        assert r.status_code == 200, r.text
        (face,) = r.json()["faces"]
        assert (face["status"], face["subject_id"], face["name"]) == ("known", name, name.title())
    listed = second.get("/v1/subjects", headers=ADMIN).json()
    assert [s["id"] for s in listed["subjects"]] == list(names) and listed["total"] == 4
    assert second.get("/readyz").json()["gallery_faces"] == 4
    # a subject deleted through one instance is gone from the next identification of the other
    assert first.delete("/v1/subjects/obama", headers=ADMIN).status_code in (200, 204)
    r = second.post("/v1/identify", files=[upload(photos["obama"][1], "photo")], headers=ADMIN)
    (face,) = r.json()["faces"]
    assert face["subject_id"] != "obama" and "obama" not in {c["subject_id"] for c in face["candidates"]}


def test_keys_and_gallery_commands_use_the_cluster_of_the_environment(
    redis_cluster, cluster_client, monkeypatch, capsys, tmp_path
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("SPHEREFACE_REDIS_URL", raising=False)
    monkeypatch.setenv("SPHEREFACE_REDIS_CLUSTER", redis_cluster.startup_nodes)
    data_dir = str(tmp_path / "data")
    assert cli_main(["keys", "--data-dir", data_dir, "create", "--scope", "read", "--name", "ops"]) == 0
    key = capsys.readouterr().out.strip()
    assert authenticate(cluster_client, key, env_key=None).scope == "read"
    assert cli_main(["keys", "--data-dir", data_dir, "list"]) == 0
    assert "ops" in capsys.readouterr().out
    store = GalleryStore(cluster_client)
    vectors = random_unit(np.random.default_rng(0), 8, 3)
    store.add_faces_bulk([(f"s{i}", emb_face(v)) for i, v in enumerate(vectors)], "m1", create_subjects=True)
    assert cli_main(["gallery", "--data-dir", data_dir, "models"]) == 0
    assert capsys.readouterr().out.split() == ["3", "m1"]
    assert not (tmp_path / "data" / "redis").exists()  # no local redis-server was started


@pytest.mark.shared_data
def test_sphereface_serve_redis_cluster_serves_the_gallery_from_the_cluster(
    redis_cluster, default_model_dir, photos_dir, workdir
) -> None:
    from service.serve_process import Service

    redis_cluster.flush()
    photo = sorted((photos_dir / "people" / "lennon").glob("*.jpg"))
    service = Service(
        default_model_dir, workdir / "data", options=["--redis-cluster", redis_cluster.startup_nodes]
    )
    try:
        http = service.client
        assert http.post("/v1/subjects", json={"id": "lennon"}).status_code == 201
        r = http.post("/v1/subjects/lennon/faces", files=[upload(photo[0])])
        assert r.status_code == 200 and r.json()["enrolled"] == 1, r.text
        (face,) = http.post("/v1/identify", files=[upload(photo[1], "photo")]).json()["faces"]
        assert (face["status"], face["subject_id"]) == ("known", "lennon")
    finally:
        assert service.stop() == 0
    client = redis_cluster.client()
    try:
        store = GalleryStore(client)
        assert store.get_subject("lennon").face_count == 1  # in the cluster, in its partition
        assert client.exists(store.subject_key("lennon")) and "{g" in store.subject_key("lennon")
    finally:
        client.close()
    assert not (workdir / "data" / "redis").exists()  # no local redis-server
