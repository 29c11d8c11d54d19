"""Gallery snapshots shared by the workers of one machine (service/gallery/snapshot.py), on a real
redis-server: one mapped copy of the vectors, each worker's changes layered on top, compaction,
and the fallbacks (stream trimmed past a snapshot, a new gallery epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from service.gallery import index as index_module
from service.gallery.index import LayeredIndex, LiveIndex, VectorIndex
from service.gallery.snapshot import SnapshotFolder
from service.gallery.store import GalleryStore
from tests.test_gallery_store import (
    DIM,
    add_one,
    assert_hits_match_reference,
    assert_same_entries,
    gallery_faces,
    unit,
)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261125)


@pytest.fixture
def shm(tmp_path):
    return tmp_path / "snapshots"


def entries(index) -> dict[str, tuple[str, np.ndarray]]:
    return {face: (subject, np.array(vector)) for face, subject, vector in index.entries()}


def populate(store: GalleryStore, rng, subjects: int = 30) -> None:
    for i in range(subjects):
        sid = f"p{i:02d}"
        store.create_subject(sid)
        for _ in range(int(rng.integers(1, 4))):
            add_one(store, sid, "m1", unit(rng))


def assert_matches_gallery(worker: LiveIndex, store: GalleryStore, rng, queries: int = 8) -> None:
    worker.refresh()
    want = gallery_faces(store, "m1")
    assert_same_entries(entries(worker.index), want)
    for _ in range(queries):
        query = unit(rng)
        assert_hits_match_reference(worker.search(query, 7)[0], query, want, 7)


def test_workers_map_one_snapshot(redis_client, other_client, rng, shm):
    store_a, store_b = GalleryStore(redis_client), GalleryStore(other_client)
    populate(store_a, rng)
    worker_a = LiveIndex(store_a, "m1", DIM, snapshots=shm)
    worker_b = LiveIndex(store_b, "m1", DIM, snapshots=shm)
    worker_a.refresh()
    worker_b.refresh()
    # a loaded Redis once and wrote the snapshot; b only mapped it.
    assert (worker_a.full_reloads, worker_a.snapshots_written, worker_a.snapshot_loads) == (1, 1, 1)
    assert (worker_b.full_reloads, worker_b.snapshots_written, worker_b.snapshot_loads) == (0, 0, 1)
    for worker in (worker_a, worker_b):
        assert isinstance(worker.index, LayeredIndex)
        assert isinstance(worker.index.base._matrix, np.memmap)  # mapped, not a private copy
        assert isinstance(worker.index.base._subject_codes, np.memmap)  # the ids too
        assert not worker.index.base._matrix.flags.writeable
    assert worker_a.index.base._matrix.filename == worker_b.index.base._matrix.filename
    assert_matches_gallery(worker_a, store_a, rng)
    assert_matches_gallery(worker_b, store_b, rng)


def test_changes_after_the_snapshot_are_layered_on_it(redis_client, other_client, rng, shm):
    store_a, store_b = GalleryStore(redis_client), GalleryStore(other_client)
    populate(store_a, rng)
    worker_a = LiveIndex(store_a, "m1", DIM, snapshots=shm)
    worker_a.refresh()
    snapshot = worker_a.index.meta
    faces = list(gallery_faces(store_a, "m1"))
    store_b.delete_face(faces[0])
    store_b.delete_subject("p03")
    store_b.create_subject("new")
    late = [add_one(store_b, "new", "m1", unit(rng)) for _ in range(3)]
    worker_a.refresh()
    assert worker_a.index.meta == snapshot  # still the same snapshot, the changes in its delta
    assert len(worker_a.index.delta) == 3 and worker_a.index.masked >= 1
    assert faces[0] not in worker_a.index and late[0].id in worker_a.index
    assert_matches_gallery(worker_a, store_a, rng)
    # A worker that starts now maps the same snapshot and applies the same changes from the stream.
    worker_b = LiveIndex(store_b, "m1", DIM, snapshots=shm)
    worker_b.refresh()
    assert worker_b.full_reloads == 0 and worker_b.index.meta == snapshot
    assert_matches_gallery(worker_b, store_b, rng)


def test_a_large_delta_is_compacted_and_followed(redis_client, other_client, rng, shm, monkeypatch):
    monkeypatch.setattr(index_module, "COMPACT_FACES", 4)
    monkeypatch.setattr(index_module, "CHECK_SECONDS", 0.0)
    store_a, store_b = GalleryStore(redis_client), GalleryStore(other_client)
    populate(store_a, rng, subjects=60)
    worker_a = LiveIndex(store_a, "m1", DIM, snapshots=shm)
    worker_b = LiveIndex(store_b, "m1", DIM, snapshots=shm)
    worker_a.refresh()
    worker_b.refresh()
    first = worker_a.index.meta
    for face in list(gallery_faces(store_b, "m1"))[:3]:  # masked in the snapshot, then compacted away
        store_b.delete_face(face)
    store_b.create_subject("crowd")
    for _ in range(first.faces // 10 + 2):  # past a tenth of the snapshot
        add_one(store_b, "crowd", "m1", unit(rng))
    worker_a.refresh()  # writes a new snapshot of its state and maps it
    assert worker_a.snapshots_written == 2
    assert worker_a.index.meta.revision == store_a.revision() > first.revision
    assert len(worker_a.index.delta) == 0
    worker_b.refresh()  # finds the newer snapshot and switches to it
    assert worker_b.index.meta == worker_a.index.meta and worker_b.snapshots_written == 0
    for worker, store in ((worker_a, store_a), (worker_b, store_b)):
        assert_matches_gallery(worker, store, rng)
    # Only the newest snapshots stay on disk.
    for _ in range(2):
        for _ in range(worker_a.index.meta.faces // 10 + 2):
            add_one(store_b, "crowd", "m1", unit(rng))
        worker_a.refresh()
    folder = SnapshotFolder(shm, "m1", worker_a.epoch.decode())
    assert len(list(folder.path.glob("rev-*.json"))) == 2
    assert worker_b.search(unit(rng), 3)[0]  # still answers (it switches to the newest)
    assert_matches_gallery(worker_b, store_b, rng)


def test_stream_trimmed_past_the_snapshot_loads_redis(redis_client, other_client, rng, shm):
    store_a, store_b = GalleryStore(redis_client), GalleryStore(other_client)
    populate(store_a, rng)
    LiveIndex(store_a, "m1", DIM, snapshots=shm).refresh()
    store_b.create_subject("late")
    add_one(store_b, "late", "m1", unit(rng))
    other_client.xtrim(store_b.changes_key, maxlen=0, approximate=False)
    worker = LiveIndex(store_b, "m1", DIM, snapshots=shm)
    worker.refresh()
    assert worker.full_reloads == 1 and worker.snapshots_written == 1  # the old one could not be used
    assert_matches_gallery(worker, store_b, rng)


def test_a_new_epoch_gets_its_own_snapshot(redis_client, rng, shm):
    store = GalleryStore(redis_client)
    populate(store, rng, subjects=5)
    worker = LiveIndex(store, "m1", DIM, snapshots=shm)
    worker.refresh()
    old_epoch = worker.epoch
    redis_client.flushall()
    populate(store, rng, subjects=4)
    worker.refresh()
    assert worker.epoch != old_epoch and worker.full_reloads == 2
    assert len(list(shm.iterdir())) == 2
    assert_matches_gallery(worker, store, rng)


def test_empty_gallery_snapshot(redis_client, rng, shm):
    store = GalleryStore(redis_client)
    worker = LiveIndex(store, "m1", DIM, snapshots=shm)
    worker.refresh()
    assert len(worker) == 0 and worker.search(unit(rng), 3) == [[]]
    store.create_subject("a")
    face = add_one(store, "a", "m1", unit(rng))
    assert worker.search(unit(rng), 3)[0][0].face_id == face.id


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_layered_index_equals_one_index_of_the_live_faces(tmp_path, rng, int8):
    """Random adds, removals and replacements on a snapshot: the same answers as brute force."""
    vectors = unit(rng, DIM, 400)
    ids = [f"f{i}" for i in range(400)]
    subjects = [f"s{i % 90}" for i in range(400)]
    folder = SnapshotFolder(tmp_path, "m1", "e")
    plain = VectorIndex(DIM)
    plain.add(ids, subjects, vectors)
    meta = folder.write(7, "1-0", 400, DIM, plain.chunks(size=64), with_codes=True)
    layered = LayeredIndex(folder.open(meta))
    if int8:
        layered.base.int8_scan_min_faces = 1
    live = dict(zip(ids, zip(subjects, vectors, strict=True), strict=True))
    for step in range(6):
        gone = [ids[i] for i in rng.choice(400, 25, replace=False)]
        layered.remove(gone)
        for face in gone:
            live.pop(face, None)
        changed = [ids[i] for i in rng.choice(400, 10, replace=False)] + [f"n{step}-{i}" for i in range(5)]
        new_vectors = unit(rng, DIM, len(changed))
        new_subjects = [f"s{int(rng.integers(0, 95))}" for _ in changed]
        layered.add(changed, new_subjects, new_vectors)
        live.update(zip(changed, zip(new_subjects, new_vectors, strict=True), strict=True))
        assert len(layered) == len(live)
        assert_same_entries(entries(layered), live)
        for _ in range(5):
            query = unit(rng)
            assert_hits_match_reference(layered.search(query, 6)[0], query, live, 6)
    if int8:
        assert layered.base._int8 is not None and isinstance(layered.base._int8.codes, np.memmap)


def test_unfinished_snapshot_is_invisible(tmp_path):
    folder = SnapshotFolder(tmp_path, "m1", "e")
    index = VectorIndex(DIM)
    index.add(["a"], ["s"], np.eye(DIM, dtype=np.float32)[:1])
    meta = folder.write(3, "5-0", 1, DIM, index.chunks(), with_codes=False)
    assert folder.latest() == meta
    (folder.path / f"{meta.stem}.json").unlink()  # as if the writer died before its last rename
    assert folder.latest() is None
    with pytest.raises(ValueError, match="got 1"):
        folder.write(4, "6-0", 2, DIM, index.chunks(), with_codes=False)


def test_a_full_snapshot_folder_leaves_the_worker_its_own_copy(redis_client, rng, shm, monkeypatch, caplog):
    """No room (a container's 64 MB /dev/shm): a warning, no half-written files, and search works."""
    import errno
    import os

    from service.gallery import snapshot

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot.os, "posix_fallocate", no_room)
    store = GalleryStore(redis_client)
    populate(store, rng, subjects=6)
    worker = LiveIndex(store, "m1", DIM, snapshots=shm)
    with caplog.at_level("WARNING"):
        worker.refresh()
    assert "shm_size" in caplog.text
    assert isinstance(worker.index, VectorIndex) and worker.snapshots_written == 0
    assert [p.name for p in shm.rglob("rev-*")] == []
    assert os.path.isdir(shm)
    store.create_subject("later")
    add_one(store, "later", "m1", unit(rng))
    assert_matches_gallery(worker, store, rng)


def test_mapped_ids_find_rows_by_binary_search(tmp_path):
    from service.gallery.snapshot import MappedIds

    ids = ["f10", "f1", "a", "zz9", "f100"]
    index = VectorIndex(DIM)
    index.add(ids, ["s"] * 5, np.eye(DIM, dtype=np.float32)[:5])
    folder = SnapshotFolder(tmp_path, "m1", "e")
    snap = folder.open(folder.write(1, "1-0", 5, DIM, index.chunks(size=2), with_codes=False))
    mapped = snap.face_ids
    assert isinstance(mapped, MappedIds) and isinstance(snap.subject_codes, np.memmap)
    assert [mapped.get(f) for f in ids] == [0, 1, 2, 3, 4]
    assert mapped.get("f") is None and mapped.get("f1000") is None and "zz" not in mapped
    assert mapped[1:3] == ["f1", "a"] and list(mapped) == ids


def test_roots_of_dead_services_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from service.gallery.snapshot import remove_stale_roots

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tmp_path / f"sphereface-gallery-{int(done.stdout)}"
    alive = tmp_path / f"sphereface-gallery-{os.getpid()}"
    other = tmp_path / "sphereface-gallery-notapid"
    for folder in (dead, alive, other):
        (folder / "m1-e").mkdir(parents=True)
    assert remove_stale_roots(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()
