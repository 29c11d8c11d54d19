"""The gallery on a real Redis Cluster (3 primaries, 3 replicas): partitions, every script in one
slot, subjects spread over the primaries, and the in-process index exact over every partition."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import redis
from redis.exceptions import RedisClusterException

from service.errors import RedisUnavailableError
from service.gallery.index import LiveIndex
from service.gallery.partitions import CLUSTER_PARTITIONS, partition_tags
from service.gallery.store import FaceRecord, GalleryStore
from service.gallery.writes import WritePolicy
from tests.gallery_vectors import emb_face, random_unit
from tests.redis_cluster import LocalCluster, migrate_slot, owns

DIM = 16
#: Subjects of the spread test, and how far (as a fraction of a third) a primary's share may be
#: off: partitions are split 21/22/21 over the three slot ranges, and 1,000 subjects hashed to 64
#: partitions put about 333 +- 15 (one standard deviation) on each primary.
SPREAD_SUBJECTS = 1000
SPREAD_TOLERANCE = 0.15


@pytest.fixture
def cluster_client(redis_cluster):
    redis_cluster.flush()
    client = redis_cluster.client()
    yield client
    client.close()


@pytest.fixture
def store(cluster_client) -> GalleryStore:
    return GalleryStore(cluster_client, "sf:")


def primary_of(client, key: str) -> str:
    node = client.get_node_from_key(key)
    return f"{node.host}:{node.port}"


def add(store: GalleryStore, subject_id: str, vector: np.ndarray, model_id: str = "m1") -> FaceRecord:
    (record,) = store.add_faces_bulk([(subject_id, emb_face(vector))], model_id, create_subjects=True)
    assert isinstance(record, FaceRecord), record
    return record


def all_keys(client) -> list[str]:
    return [k.decode() for k in client.scan_iter(match="sf:*", count=1000)]


def brute_force(store: GalleryStore, model_id: str, query: np.ndarray, k: int) -> list[tuple[str, float]]:
    """Top-k subjects by best cosine over every face of the model, read from every partition."""
    best: dict[str, float] = {}
    for p in range(store.partitions):
        for face_id in store.redis.smembers(store.model_faces_key(model_id, p)):
            face = store.get_face(face_id.decode(), with_embedding=True)
            score = float(face.embedding @ query)
            best[face.subject_id] = max(score, best.get(face.subject_id, -2.0))
    return sorted(best.items(), key=lambda item: -item[1])[:k]


# -- layout -------------------------------------------------------------------------------------


def test_a_cluster_store_has_64_partitions_each_in_its_own_slot(store, cluster_client) -> None:
    assert store.cluster and store.partitions == CLUSTER_PARTITIONS == 64
    slots = [cluster_client.keyslot(store.rev_key_of(p)) for p in range(store.partitions)]
    assert len(set(slots)) == 64
    # partition p's slot lies in the p-th of 64 equal spans of the slots
    assert all(p * 256 <= slot < (p + 1) * 256 for p, slot in enumerate(slots))
    assert partition_tags(64) == partition_tags(64)  # a pure function of the partition number
    owners = collections.Counter(primary_of(cluster_client, store.rev_key_of(p)) for p in range(64))
    assert sorted(owners.values()) == [21, 21, 22]


def test_every_key_of_a_subject_and_its_faces_is_in_its_partition_slot(store, cluster_client) -> None:
    rng = np.random.default_rng(1)
    records = [add(store, f"s{i}", random_unit(rng, DIM)) for i in range(40)]
    records.append(add(store, "s0", random_unit(rng, DIM), model_id="m2"))
    for record in records:
        p = store.partition_of(record.subject_id)
        assert store.partition_of(record.id) == p  # a face id hashes to its subject's partition
        slot = cluster_client.keyslot(store.rev_key_of(p))
        for key in (
            store.subject_key(record.subject_id),
            store.subject_faces_key(record.subject_id),
            store.face_key(record.id),
            store.model_faces_key(record.model_id, p),
            store.changes_key_of(p),
            store.subjects_key_of(p),
        ):
            assert cluster_client.keyslot(key) == slot, key
    # Nothing outside the partitions: every key carries a partition's hash tag.
    tags = {f"{{{tag}}}" for tag in partition_tags(64)}
    keys = all_keys(cluster_client)
    assert keys and all(key[len("sf:") :].split(":", 1)[0] in tags for key in keys)
    assert store.revision() == 41
    assert sum(rev for rev, _ in store.positions()) == 41


def test_subjects_spread_evenly_over_the_primaries(store, cluster_client) -> None:
    started = time.perf_counter()
    for i in range(SPREAD_SUBJECTS):
        store.create_subject(f"person-{i:05d}")
    seconds = time.perf_counter() - started
    per_primary: collections.Counter[str] = collections.Counter()
    for p in range(store.partitions):
        key = store.subjects_key_of(p)
        per_primary[primary_of(cluster_client, key)] += cluster_client.zcard(key)
    third = SPREAD_SUBJECTS / 3
    print(
        f"\n{SPREAD_SUBJECTS} subjects created in {seconds:.2f} s;",
        f"per primary: {sorted(per_primary.values())}",
    )
    assert sum(per_primary.values()) == SPREAD_SUBJECTS and len(per_primary) == 3
    assert all(abs(n - third) <= SPREAD_TOLERANCE * third for n in per_primary.values()), per_primary


# -- whole-gallery reads fan out over the partitions ---------------------------------------------


def test_listing_paging_searching_and_counting_span_every_partition(store) -> None:
    rng = np.random.default_rng(2)
    ids = [f"p{i:02d}" for i in range(30)]
    for i, sid in enumerate(ids):
        store.create_subject(sid, name=f"Name {i}" if i % 3 else f"Special {i}")
    for sid in ids[:10]:
        add(store, sid, random_unit(rng, DIM))
    add(store, ids[0], random_unit(rng, DIM), model_id="m2")
    assert len({store.partition_of(sid) for sid in ids}) > 10
    # pages in creation order, across partitions
    seen = []
    for offset in range(0, 30, 7):
        page, total = store.list_subjects(offset, 7, model_id="m1")
        assert total == 30
        seen += [s.id for s in page]
    assert seen == ids
    first, _ = store.list_subjects(0, 2, model_id="m1")
    assert [(s.id, s.face_count, s.face_count_all_models) for s in first] == [("p00", 1, 2), ("p01", 1, 1)]
    walked = list(store.subject_ids(batch=2))  # partition after partition, 2 ids per read
    assert len(walked) == 30 and set(walked) == set(ids)
    found, total = store.list_subjects(0, 50, query="special")
    assert total == 10 and [s.id for s in found] == [ids[i] for i in range(0, 30, 3)]
    stats = store.stats("m1")
    assert (stats.subjects, stats.faces, stats.revision) == (30, 10, 11)
    assert store.faces_per_model() == {"m1": 10, "m2": 1}


def test_removing_faces_of_many_partitions_and_deleting_subjects(store) -> None:
    rng = np.random.default_rng(3)
    records = [add(store, f"r{i}", random_unit(rng, DIM)) for i in range(20)]
    records += [add(store, "r0", random_unit(rng, DIM)) for _ in range(3)]
    assert store.remove_faces([r.id for r in records[:10]] + ["not-a-face"]) == 10
    assert store.revision() == 33
    assert store.delete_subject("r0") == 3  # its three other faces
    assert (store.stats("m1").faces, store.stats("m1").subjects) == (10, 19)
    assert store.subject_faces("r15")[0].id == records[15].id


# -- the index follows every partition -----------------------------------------------------------


def test_index_equals_brute_force_after_random_changes_over_all_partitions(store, cluster_client) -> None:
    rng = np.random.default_rng(4)
    index = LiveIndex(store, "m1", DIM)
    other = LiveIndex(GalleryStore(cluster_client, "sf:"), "m1", DIM)  # another worker
    pool: dict[int, list[str]] = {}  # two subject ids in every partition
    for i in range(10_000):
        pool.setdefault(store.partition_of(f"u{i}"), []).append(f"u{i}")
    subjects = [sid for ids in pool.values() for sid in ids[:2]]
    assert len(subjects) == 128
    live: dict[str, FaceRecord] = {}
    for step in range(6):
        for i in range(48):
            sid = subjects[(48 * step + i) % 128] if step < 3 else subjects[rng.integers(0, 128)]
            record = add(store, sid, random_unit(rng, DIM))
            live[record.id] = record
        gone = rng.choice(sorted(live), size=12, replace=False)
        assert store.remove_faces(list(gone)) == 12
        for face_id in gone:
            del live[face_id]
        if step % 2:  # re-enroll a subject: delete it, enroll it again
            sid = next(iter(live.values())).subject_id
            store.delete_subject(sid)
            live = {f: r for f, r in live.items() if r.subject_id != sid}
            record = add(store, sid, random_unit(rng, DIM))
            live[record.id] = record
        for worker in (index, other):
            queries = random_unit(rng, DIM, 3)
            hits = worker.search(queries, 5)
            assert len(worker) == len(live)
            for query, got in zip(queries, hits, strict=True):
                want = brute_force(store, "m1", query, 5)
                assert [h.subject_id for h in got] == [sid for sid, _ in want]
                np.testing.assert_allclose([h.score for h in got], [s for _, s in want], rtol=1e-5)
    assert all(rev > 0 for rev, _ in store.positions())  # every partition changed
    assert len({store.partition_of(r.subject_id) for r in live.values()}) > 56
    assert index.revision == store.revision()
    assert index.full_reloads == 1  # followed the streams, never reloaded


def test_an_enrollment_by_one_worker_is_found_by_the_next_search_of_another(store, cluster_client) -> None:
    rng = np.random.default_rng(5)
    writer = GalleryStore(cluster_client, "sf:")
    reader = LiveIndex(GalleryStore(cluster_client, "sf:"), "m1", DIM)
    for i in range(10):
        add(writer, f"w{i}", random_unit(rng, DIM))
    assert len(reader.search(random_unit(rng, DIM, 1), 1)[0]) == 1
    for i in range(10):
        vector = random_unit(rng, DIM)
        record = add(writer, f"new{i}", vector)
        (top,) = reader.search(vector[None], 1)[0]
        assert (top.subject_id, top.face_id) == (f"new{i}", record.id)
        assert top.score == pytest.approx(1.0, abs=1e-5)
    writer.delete_subject("new3")
    assert "new3" not in {h.subject_id for h in reader.search(random_unit(rng, DIM, 1), 50)[0]}


def test_a_trimmed_stream_of_one_partition_makes_the_index_reload(store, cluster_client) -> None:
    rng = np.random.default_rng(6)
    index = LiveIndex(store, "m1", DIM)
    add(store, "t0", random_unit(rng, DIM))
    index.refresh()
    vector = random_unit(rng, DIM)
    record = add(store, "t1", vector)
    p = store.partition_of("t1")
    cluster_client.xtrim(store.changes_key_of(p), maxlen=0, approximate=False)
    (top,) = index.search(vector[None], 1)[0]
    assert top.face_id == record.id and index.full_reloads == 2


def test_a_flushed_cluster_is_a_new_gallery(store, redis_cluster, cluster_client) -> None:
    rng = np.random.default_rng(7)
    index = LiveIndex(store, "m1", DIM)
    add(store, "f0", random_unit(rng, DIM))
    assert len(index.search(random_unit(rng, DIM, 1), 5)[0]) == 1
    redis_cluster.flush()
    assert index.search(random_unit(rng, DIM, 1), 5) == [[]] and index.full_reloads == 2


def test_no_script_crosses_slots(store, cluster_client) -> None:
    """A script whose keys span slots is refused (by the client, before the primary would); every
    store operation goes through."""
    rng = np.random.default_rng(8)
    store.create_subject("x", name="X")
    record = add(store, "x", random_unit(rng, DIM))
    store.update_subject("x", name="Y")
    assert store.get_subject("x", "m1").face_count == 1
    store.delete_face(record.id)
    assert store.delete_subject("x") == 0
    with pytest.raises(RedisClusterException, match="same key slot"):
        cluster_client.eval("return 1", 2, store.rev_key_of(0), store.rev_key_of(1))


def test_a_photo_is_refused_twice_within_a_partition(store) -> None:
    """Photo keys live in the subject's partition: the same photo is refused again for a subject of
    that partition (another partition's subject does not see it: the documented limit)."""
    rng = np.random.default_rng(9)
    vector = random_unit(rng, DIM)
    first = add(store, "d0", vector)
    same = next(f"d{i}" for i in range(1, 500) if store.partition_of(f"d{i}") == store.partition_of("d0"))
    other = next(f"d{i}" for i in range(1, 500) if store.partition_of(f"d{i}") != store.partition_of("d0"))
    for subject_id in ("d0", same):
        (result,) = store.add_faces_bulk([(subject_id, emb_face(vector))], "m1", create_subjects=True)
        assert getattr(result, "code", None) == "duplicate_photo" and first.id in result.message
    assert isinstance(add(store, other, vector), FaceRecord)
    assert isinstance(add(store, "d0", vector, model_id="m2"), FaceRecord)  # per model, as on one Redis


# -- a primary fails --------------------------------------------------------------------------------


def test_the_gallery_survives_the_crash_of_a_primary(redis_binary) -> None:
    """A primary is killed: while its replica takes over, requests fail as 503 redis_unavailable
    (never another error); then writes and exact search go on, with nothing replicated lost.
    Writes are not retried and wait for no replica here (the promoted one has none left): this is
    the failover as a client of the bare cluster sees it; tests/test_cluster_durability.py has
    the one with replica-acknowledged writes."""
    cluster = LocalCluster(redis_binary).start()  # its own cluster: the session's stays whole
    try:
        client = cluster.client()
        store = GalleryStore(client, policy=WritePolicy(wait_replicas=0, retry_seconds=0))
        index = LiveIndex(GalleryStore(client), "m1", DIM)
        rng = np.random.default_rng(10)
        records = [add(store, f"c{i}", random_unit(rng, DIM)) for i in range(60)]
        index.refresh()
        cluster.wait_replicated()
        victim = primary_of(client, store.subject_key("c0"))
        cluster.kill_node(victim)
        failures = 0
        deadline = time.monotonic() + 30
        while True:  # the first requests may find no primary for the slot yet
            try:
                vector = random_unit(rng, DIM)
                record = add(store, "c0", vector)
                break
            except RedisUnavailableError:
                failures += 1
                assert time.monotonic() < deadline
                time.sleep(0.1)
        cluster.wait_ok()
        assert primary_of(client, store.subject_key("c0")) != victim
        (top,) = index.search(vector[None], 1)[0]
        assert (top.subject_id, top.face_id) == ("c0", record.id)
        assert store.stats("m1").faces == 61 and len(index) == 61
        assert {f.id for f in store.subject_faces("c0")} == {records[0].id, record.id}
        query = random_unit(rng, DIM)
        want = brute_force(store, "m1", query, 5)
        assert [h.subject_id for h in index.search(query[None], 5)[0]] == [sid for sid, _ in want]
        print(f"\nfailover: {failures} requests answered redis_unavailable before the replica took over")
        client.close()
    finally:
        cluster.stop()


# -- a partition moves to another primary -----------------------------------------------------------


def test_the_gallery_goes_on_while_a_partition_moves_to_another_primary(redis_binary) -> None:
    """The slot of a partition is migrated (as ``redis-cli --cluster reshard`` does) while the
    gallery is written: writes to that partition answer 503 redis_unavailable (TRYAGAIN) or go
    through, nothing else; afterwards every face is there and search equals brute force. The
    writes run between the migration's batches, in its thread: a retry could not outlast the
    migration, so the store retries nothing here (tests/test_cluster_durability.py grows a
    cluster while writes are retried)."""
    cluster = LocalCluster(redis_binary).start()
    try:
        client = cluster.client()
        store = GalleryStore(client, policy=WritePolicy(retry_seconds=0))
        index = LiveIndex(GalleryStore(client), "m1", DIM)
        rng = np.random.default_rng(11)
        p = store.partition_of("mover-0")
        movers = [f"mover-{i}" for i in range(2000) if store.partition_of(f"mover-{i}") == p][:8]
        live = {r.id: r for r in (add(store, sid, random_unit(rng, DIM)) for sid in movers)}
        stayers = [f"stay-{i}" for i in range(40) if store.partition_of(f"stay-{i}") != p][:20]
        live |= {r.id: r for r in (add(store, sid, random_unit(rng, DIM)) for sid in stayers)}
        index.refresh()
        slot = client.keyslot(store.rev_key_of(p))
        source = primary_of(client, store.rev_key_of(p))
        target = next(
            r["address"] for r in cluster.nodes() if "master" in r["flags"] and r["address"] != source
        )
        outcomes: collections.Counter[str] = collections.Counter()

        def write_meanwhile() -> None:
            for sid in (movers[int(rng.integers(0, len(movers)))], stayers[int(rng.integers(0, 20))]):
                where = "moving" if sid in movers else "other"
                try:
                    record = add(store, sid, random_unit(rng, DIM))
                    live[record.id] = record
                    outcomes[f"{where} ok"] += 1
                except RedisUnavailableError:
                    outcomes[f"{where} 503"] += 1
            assert len(index.search(random_unit(rng, DIM, 1), 3)[0]) == 3  # reads go on

        migrate_slot(cluster, slot, target, between_batches=write_meanwhile)
        assert owns(next(r for r in cluster.nodes() if r["address"] == target)["slots"], slot)
        for sid in movers:  # the moved partition takes writes again
            record = add(store, sid, random_unit(rng, DIM))
            live[record.id] = record
        assert primary_of(client, store.rev_key_of(p)) == target
        print(f"\nwrites while the slot moved: {dict(outcomes)}")
        # the other partitions never noticed; the moving one answered 503 or took the write
        assert outcomes["other ok"] > 0 and outcomes["other 503"] == 0
        assert outcomes["moving ok"] + outcomes["moving 503"] == outcomes["other ok"]
        assert store.stats("m1").faces == len(live) and len(index.search(random_unit(rng, DIM, 1), 1)[0]) == 1
        assert len(index) == len(live)
        for query in random_unit(rng, DIM, 3):
            want = brute_force(store, "m1", query, 5)
            assert [h.subject_id for h in index.search(query[None], 5)[0]] == [sid for sid, _ in want]
        client.close()
    finally:
        cluster.stop()


def test_an_index_whose_stream_read_is_refused_in_passing_retries_and_finds_the_face(
    cluster_client, store, monkeypatch
):
    """A change-stream read that loses its node (as in a failover) is retried with the store's
    policy, like the store's own reads: the next identification waits and finds the new face."""
    index = LiveIndex(store, "m1", DIM)
    rng = np.random.default_rng(5)
    add(store, "before", random_unit(rng, DIM))
    index.search(random_unit(rng, DIM, 1), 1)  # loaded; later faces come from the streams
    vector = random_unit(rng, DIM)
    add(store, "after", vector)
    real_xrange, refused = cluster_client.xrange, []

    def xrange_losing_its_node_once(*args, **kwargs):
        if not refused:
            refused.append(args[0])
            raise redis.ConnectionError("Connection refused (the node went away)")
        return real_xrange(*args, **kwargs)

    monkeypatch.setattr(cluster_client, "xrange", xrange_losing_its_node_once)
    assert index.search(vector[None], 1)[0][0].subject_id == "after"
    assert refused, "the stream was not read"


def test_the_faces_of_several_subjects_come_from_every_partition_at_once(store) -> None:
    """What identification re-ranks with (``faces_of_subjects``): each subject's faces, with
    their embeddings, whatever partitions the subjects live in; an unknown subject has none."""
    rng = np.random.default_rng(3)
    subjects = [f"person{i}" for i in range(12)]
    enrolled = {
        s: {add(store, s, random_unit(rng, DIM)).id for _ in range(1 + i % 3)} for i, s in enumerate(subjects)
    }
    found = store.faces_of_subjects([*subjects, "nobody"], with_embedding=True)
    assert {s: {f.id for f in found[s]} for s in subjects} == enrolled
    assert found["nobody"] == []
    assert all(f.embedding is not None and f.embedding.shape == (DIM,) for s in subjects for f in found[s])
    assert len({store.partition_of(s) for s in subjects}) > 3
