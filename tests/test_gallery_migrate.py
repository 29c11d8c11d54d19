"""``sphereface gallery migrate``: a gallery on one real redis-server copied into a real Redis
Cluster (3 primaries, 3 replicas), resumed, run again, checked, and served from the cluster."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from models.cli import main as cli_main
from service.auth import authenticate, create_key
from service.errors import FaceNotFoundError, MigrationMismatchError, MigrationRefusedError
from service.gallery import migrate as migrate_module
from service.gallery.face_images import FaceRegion
from service.gallery.index import LiveIndex
from service.gallery.migrate import GalleryMigration, cluster_face_id
from service.gallery.partitions import partition_of
from service.gallery.store import GalleryStore, NewFace, embedding_sha256
from tests.gallery_vectors import random_unit

MODELS = {"m1": 16, "m2": 8}
SUBJECTS = 24


@pytest.fixture
def cluster(redis_cluster):
    """The session's cluster, emptied before and after (other tests expect it usable)."""
    redis_cluster.flush()
    client = redis_cluster.client()
    yield client
    client.close()
    redis_cluster.flush()


@pytest.fixture
def source(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def face(rng: np.random.Generator, dim: int, with_region: bool) -> NewFace:
    vector = random_unit(rng, dim)
    region = FaceRegion(rng.bytes(300), rng.random((5, 2))) if with_region else None
    box = [float(x) for x in rng.random(4)]
    return NewFace(vector, embedding_sha256(vector), box=box, detection_score=0.9, region=region)


def make_gallery(client: redis.Redis, seed: int = 0) -> dict[str, str]:
    """Subjects with names and metadata, faces of two models (some with a stored region, some
    subjects without faces of one model, one subject with none) and two API keys; returns the
    keys by name."""
    rng = np.random.default_rng(seed)
    store = GalleryStore(client)
    for i in range(SUBJECTS):
        store.create_subject(f"person-{i:02d}", name=f"Person {i}", metadata={"n": i, "team": "ab"[i % 2]})
    for model_id, dim in MODELS.items():
        items = [
            (f"person-{i:02d}", face(rng, dim, with_region=i % 3 == 0))
            for i in range(SUBJECTS - 1)
            for _ in range(1 + i % 3)
            if not (model_id == "m2" and i % 4 == 1)
        ]
        assert all(not isinstance(r, Exception) for r in store.add_faces_bulk(items, model_id))
    keys = {}
    for scope in ("read", "admin"):
        keys[scope], _ = create_key(client, scope, f"{scope} key")
    return keys


def gallery_dump(client) -> dict[str, object]:
    """Every key of the gallery and its value (a stream as its length and last revision)."""
    dump: dict[str, object] = {}
    for key in client.scan_iter(match="sf:*", count=1000):
        name = key.decode()
        kind = client.type(key).decode()
        if kind == "hash":
            dump[name] = client.hgetall(key)
        elif kind == "set":
            dump[name] = client.smembers(key)
        elif kind == "zset":
            dump[name] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            dump[name] = (client.xlen(key), [e[1] for e in client.xrange(key)])
        else:
            dump[name] = client.get(key)
    return dump


def migrate(source, cluster, **options) -> GalleryMigration:
    return GalleryMigration(source, cluster, **options)


def test_face_ids_fit_their_partition_and_are_the_same_every_time() -> None:
    ids = [f"{i:024x}" for i in range(200)]
    for partition in (0, 17, 63):
        new = [cluster_face_id(i, partition) for i in ids]
        assert new == [cluster_face_id(i, partition) for i in ids]
        assert {partition_of(n, 64) for n in new} == {partition}
        assert len(set(new)) == len(new)
        kept = [i for i in ids if partition_of(i, 64) == partition]
        assert all(cluster_face_id(i, partition) == i for i in kept)


def test_migrate_copies_the_whole_gallery_and_every_path_works(source, cluster, tmp_path) -> None:
    keys = make_gallery(source)
    src, dst = GalleryStore(source), GalleryStore(cluster)
    running = {m: LiveIndex(dst, m, dim) for m, dim in MODELS.items()}  # a pod already on the cluster
    assert all(
        len(index.search(random_unit(np.random.default_rng(1), MODELS[m]), 1)[0]) == 0
        for m, index in running.items()
    )
    report = migrate(source, cluster).run(progress=False, id_map=tmp_path / "ids.csv")
    assert report.complete and report.subjects == report.subjects_copied == SUBJECTS
    assert report.faces_per_model == src.faces_per_model() == dst.faces_per_model()
    assert report.api_keys == report.api_keys_copied == 2
    with (tmp_path / "ids.csv").open() as f:
        rows = list(csv.DictReader(f))
    new_id = {r["old_id"]: r["new_id"] for r in rows}
    assert len(rows) == report.faces and report.faces_renamed == sum(o != n for o, n in new_id.items())
    assert report.faces_renamed > 0.8 * report.faces  # 63 in 64 ids do not fit their partition
    # subjects, in creation order, with their names, metadata, times and counts per model
    want, total = src.list_subjects(0, 100, model_id="m2")
    got, total_there = dst.list_subjects(0, 100, model_id="m2")
    assert (got, total_there) == (want, total)
    # every face: its record, vector and stored face image, under its id in the cluster
    for subject in want:
        faces = src.subject_faces(subject.id, with_embedding=True)
        there = {f.id: f for f in dst.subject_faces(subject.id, with_embedding=True)}
        assert sorted(there) == sorted(new_id[f.id] for f in faces)
        for f in faces:
            copy = there[new_id[f.id]]
            np.testing.assert_array_equal(copy.embedding, f.embedding)
            assert (copy.model_id, copy.box, copy.created_at, copy.has_region) == (
                f.model_id,
                f.box,
                f.created_at,
                f.has_region,
            )
            assert dst.get_face(copy.id).subject_id == subject.id
            region = src.face_region(f.id)
            copied = dst.face_region(copy.id)
            assert (region is None) == (copied is None)
            if region is not None:
                assert copied.jpeg == region.jpeg
                np.testing.assert_array_equal(copied.landmarks, region.landmarks)
    # the API keys authenticate on the cluster
    for scope, key in keys.items():
        assert authenticate(cluster, key, env_key=None).scope == scope
    # identification: the same top-k subjects, the hits' faces under their new ids
    rng = np.random.default_rng(5)
    for model_id, dim in MODELS.items():
        queries = random_unit(rng, dim, 8)
        before = LiveIndex(src, model_id, dim).search(queries, 5)
        after = LiveIndex(dst, model_id, dim).search(queries, 5)
        assert running[model_id].search(queries, 5) == after  # from the change streams
        assert running[model_id].full_reloads == 1  # the load of the empty cluster only
        for a, b in zip(before, after, strict=True):
            assert [(h.subject_id, new_id[h.face_id]) for h in a] == [(h.subject_id, h.face_id) for h in b]
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], rtol=1e-6)
    # a duplicate photo is refused on the cluster as on the source, and a face deletes by its id
    first = src.subject_faces("person-03", with_embedding=True)[0]
    dup = NewFace(first.embedding, first.photo_sha256)
    (refused,) = dst.add_faces("person-03", first.model_id, [dup])
    assert getattr(refused, "code", None) == "duplicate_photo"
    dst.delete_face(new_id[first.id])
    with pytest.raises(FaceNotFoundError):
        dst.get_face(new_id[first.id])


def test_a_stopped_migration_resumes_to_the_same_result_and_a_rerun_changes_nothing(
    source, cluster, redis_cluster, monkeypatch
) -> None:
    make_gallery(source)
    migrate(source, cluster).run(progress=False)
    whole = gallery_dump(cluster)
    redis_cluster.flush()
    monkeypatch.setattr(migrate_module, "FACES_PER_CHUNK", 4)  # subjects of up to 6 faces: chunks
    partial = migrate(source, cluster, max_subjects=5).run(progress=False)
    assert not partial.complete and partial.subjects_copied == 5
    assert GalleryStore(cluster).stats("m1").subjects == 5
    again = migrate(source, cluster, max_subjects=7).run(progress=False)
    assert again.subjects_copied == 7 and GalleryStore(cluster).stats("m1").subjects == 12
    rest = migrate(source, cluster).run(progress=False)
    assert rest.complete and rest.subjects_copied == SUBJECTS - 12
    resumed = gallery_dump(cluster)

    def without_marker(dump):
        return {k: v for k, v in dump.items() if not k.startswith("sf:migration:")}

    assert without_marker(resumed) == without_marker(whole)
    rerun = migrate(source, cluster).run(progress=False)
    assert rerun.complete and rerun.subjects_copied == rerun.faces_copied == rerun.api_keys_copied == 0
    assert gallery_dump(cluster) == resumed  # not a byte changed, streams and marker included


def test_a_migration_killed_mid_run_resumes_to_the_same_result(
    source, redis_server, cluster, redis_cluster, workdir
) -> None:
    rng = np.random.default_rng(3)
    store, subjects = GalleryStore(source), 1200
    vectors = random_unit(rng, 16, 2 * subjects)
    items = [(f"s{i // 2:04d}", NewFace(v, embedding_sha256(v))) for i, v in enumerate(vectors)]
    assert all(not isinstance(r, Exception) for r in store.add_faces_bulk(items, "m1", create_subjects=True))
    code = "import sys; from models.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", code, "gallery", "--data-dir", str(workdir / "data"), "migrate"]
    command += ["--to-cluster", redis_cluster.startup_nodes, "--redis-url", redis_server.url, "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("SPHEREFACE_REDIS_CLUSTER", None)
    run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = GalleryStore(cluster)
    deadline = time.monotonic() + 60
    while target.stats("m1").subjects < 100 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run.kill()
    _, err = run.communicate()
    copied = target.stats("m1").subjects
    assert run.returncode == -signal.SIGKILL, err.decode()
    assert 100 <= copied < subjects  # killed part way
    report = migrate(source, cluster).run(progress=False)
    assert report.complete and report.subjects_copied == subjects - copied
    resumed = gallery_dump(cluster)
    redis_cluster.flush()
    migrate(source, cluster).run(progress=False)

    def without_marker(dump):
        return {k: v for k, v in dump.items() if not k.startswith("sf:migration:")}

    assert without_marker(gallery_dump(cluster)) == without_marker(resumed)


def test_a_corrupted_face_in_the_cluster_fails_the_check(source, cluster, capsys) -> None:
    make_gallery(source)
    migrate(source, cluster).run(progress=False)
    dst = GalleryStore(cluster)
    victim = dst.subject_faces("person-07", with_embedding=True)[0]
    vector = victim.embedding.copy()
    vector[0] += 1e-3
    cluster.hset(dst.face_key(victim.id), "embedding", vector.astype("<f4").tobytes())
    with pytest.raises(MigrationMismatchError, match=f"{victim.id}.*checksum differs"):
        migrate(source, cluster).run(progress=False)
    # a face gone from its model's set is caught too
    cluster.hset(dst.face_key(victim.id), "embedding", victim.embedding.astype("<f4").tobytes())
    migrate(source, cluster).run(progress=False)
    other = dst.subject_faces("person-08")[0]
    cluster.srem(dst.model_faces_key(other.model_id, dst.partition_of("person-08")), other.id)
    with pytest.raises(MigrationMismatchError, match="person-08"):
        migrate(source, cluster).run(progress=False)


def test_a_dry_run_counts_and_writes_nothing(source, cluster) -> None:
    make_gallery(source)
    report = migrate(source, cluster).run(dry_run=True, progress=False)
    assert report.dry_run and report.subjects_copied == SUBJECTS and report.api_keys_copied == 2
    assert report.faces_copied == sum(GalleryStore(source).faces_per_model().values())
    assert gallery_dump(cluster) == {}


def test_an_empty_source_and_a_cluster_holding_another_gallery_are_refused(source, cluster) -> None:
    with pytest.raises(MigrationRefusedError, match="empty"):
        migrate(source, cluster).run(progress=False)
    GalleryStore(cluster).create_subject("someone-else")
    make_gallery(source)
    with pytest.raises(MigrationRefusedError, match="--into-nonempty"):
        migrate(source, cluster).run(progress=False)
    assert GalleryStore(cluster).stats("m1").subjects == 1  # nothing written
    report = migrate(source, cluster, into_nonempty=True).run(progress=False)
    assert report.complete and report.subjects_copied == SUBJECTS
    assert GalleryStore(cluster).stats("m1").subjects == SUBJECTS + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_migrates_and_refuses_what_is_not_a_cluster(
    source, redis_server, redis_cluster, cluster, workdir, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("SPHEREFACE_REDIS_CLUSTER", raising=False)
    make_gallery(source)
    base = ["gallery", "--data-dir", str(workdir / "data"), "migrate", "--no-progress"]
    nodes = redis_cluster.startup_nodes
    # a plain redis-server is not a cluster
    port = _free_port()
    plain = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        assert cli_main([*base, "--to-cluster", f"127.0.0.1:{port}", "--redis-url", redis_server.url]) == 2
        assert "error [redis_setup_failed]" in capsys.readouterr().err
    finally:
        plain.terminate()
        plain.wait()
    # a source that does not answer
    assert cli_main([*base, "--to-cluster", nodes, "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"]) == 2
    assert "error [migration_refused]: the source Redis cannot be reached" in capsys.readouterr().err
    assert (
        cli_main([*base, "--to-cluster", nodes, "--redis-url", redis_server.url, "--max-subjects", "0"]) == 2
    )
    assert "error [migration_refused]: --max-subjects must be at least 1" in capsys.readouterr().err
    # the dry run, then the migration
    assert cli_main([*base, "--to-cluster", nodes, "--redis-url", redis_server.url, "--dry-run"]) == 0
    assert "would copy 24 of 24 subjects" in capsys.readouterr().out
    ids = workdir / "ids.csv"
    args = [*base, "--to-cluster", nodes, "--redis-url", redis_server.url, "--id-map", str(ids)]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "copied 24 of 24 subjects" in out and "checked: every face" in out
    assert ids.exists() and len(ids.read_text().splitlines()) == 1 + sum(
        GalleryStore(source).faces_per_model().values()
    )
    # a corrupted copy: a clear error and a non-zero exit
    dst = GalleryStore(cluster)
    victim = dst.subject_faces("person-02")[0]
    cluster.hset(dst.face_key(victim.id), "box", "[0, 0, 1, 1]")
    assert cli_main(args) == 2
    assert "error [migration_mismatch]" in capsys.readouterr().err


# -- the service on the migrated cluster --------------------------------------------------------

ADMIN = {"X-API-Key": "migrate-admin-key"}


def upload(path: Path, field: str = "photos"):
    return (field, (path.name, path.read_bytes(), "image/jpeg"))


def identify(http, photo: Path) -> list[tuple[str, str, float]]:
    r = http.post("/v1/identify", files=[upload(photo, "photo")], params={"k": 3}, headers=ADMIN)
    assert r.status_code == 200, r.text
    (found,) = r.json()["faces"]
    return [(c["subject_id"], c["face_id"], c["score"]) for c in found["candidates"]]


@pytest.mark.shared_data
def test_the_service_on_the_migrated_cluster_answers_as_on_the_source(
    redis_server, source, cluster, redis_cluster, default_model_dir, photos_dir, workdir
) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app, load_pipeline
    from service.settings import Settings

    names = ("obama", "biden", "lennon", "clapton")
    photos = {name: sorted((photos_dir / "people" / name).glob("*.jpg")) for name in names}
    on_source = Settings(model_dir=default_model_dir, redis_url=redis_server.url, api_key=ADMIN["X-API-Key"])
    pipeline = load_pipeline(on_source)
    with TestClient(create_app(on_source, pipeline)) as http:
        for name in names:
            assert (
                http.post("/v1/subjects", json={"id": name, "name": name}, headers=ADMIN).status_code == 201
            )
            r = http.post(
                f"/v1/subjects/{name}/faces", files=[upload(p) for p in photos[name][:2]], headers=ADMIN
            )
            assert r.status_code == 200 and r.json()["enrolled"] == 2, r.text
        before = {name: identify(http, photos[name][-1]) for name in names}
    ids = workdir / "ids.csv"
    migrate(source, cluster).run(progress=False, id_map=ids)
    with ids.open() as f:
        new_id = {row["old_id"]: row["new_id"] for row in csv.DictReader(f)}
    on_cluster = Settings(
        model_dir=default_model_dir,
        redis_url=None,
        redis_cluster=redis_cluster.startup_nodes,
        api_key=ADMIN["X-API-Key"],
    )
    with TestClient(create_app(on_cluster, pipeline)) as http:
        for name in names:
            after = identify(http, photos[name][-1])
            assert after[0][0] == name
            assert [(s, new_id[f]) for s, f, _ in before[name]] == [(s, f) for s, f, _ in after]
            np.testing.assert_allclose([c[2] for c in after], [c[2] for c in before[name]], rtol=1e-5)
        face_id = after[0][1]
        r = http.get(f"/v1/faces/{face_id}/image", headers=ADMIN)
        assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
        listed = http.get(f"/v1/subjects/{name}/faces", headers=ADMIN).json()
        assert face_id in {f["id"] for f in listed["faces"]}
        assert http.delete(f"/v1/faces/{face_id}", headers=ADMIN).status_code in (200, 204)
        assert http.get(f"/v1/faces/{face_id}/image", headers=ADMIN).json()["code"] == "face_not_found"
        assert face_id not in {c[1] for c in identify(http, photos[name][-1])}
