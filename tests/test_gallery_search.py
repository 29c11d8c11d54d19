"""Identification by the Redis Query Engine (Redis Stack, FLAT KNN) against the exact in-process
search, with RESP2 and RESP3 clients."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from service.errors import RedisSetupError
from service.gallery.index import LiveIndex, SubjectHit, VectorIndex
from service.gallery.redis_search import RedisKnnSearch
from service.gallery.store import FaceRecord, GalleryStore
from tests.gallery_vectors import emb_face, near, random_unit

DIM = 32
OTHER_DIM = 12


def unit(rng: np.random.Generator, dim: int = DIM, n: int | None = None) -> np.ndarray:
    return random_unit(rng, dim, n)


def enroll(store: GalleryStore, model_id: str, items: list[tuple[str, np.ndarray]]) -> list[FaceRecord]:
    """Enroll (subject, vector) pairs, creating the subjects; every one must succeed."""
    store.ensure_subjects([sid for sid, _ in items])
    results = store.add_faces_bulk([(sid, emb_face(v)) for sid, v in items], model_id)
    assert all(isinstance(r, FaceRecord) for r in results), results
    return results


def model_faces(store: GalleryStore, model_id: str) -> dict[str, tuple[str, np.ndarray]]:
    ids = [f.decode() for f in store.redis.smembers(store.model_faces_key(model_id))]
    records = [store.get_face(face_id, with_embedding=True) for face_id in ids]
    return {r.id: (r.subject_id, r.embedding) for r in records}


def assert_same_hits(got: list[SubjectHit], want: list[SubjectHit], query, faces, tol=1e-5) -> None:
    """``got`` (Redis KNN) equals ``want`` (exact numpy search): the same subjects in the same order
    with the same scores; only subjects whose best scores tie within ``tol`` may swap places."""
    best: dict[str, float] = {}
    for subject, vector in faces.values():
        best[subject] = max(float(np.dot(query.astype(np.float64), vector)), best.get(subject, -np.inf))
    assert len(got) == len(want)
    subjects = [h.subject_id for h in got]
    assert len(set(subjects)) == len(subjects), subjects
    np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=tol, rtol=0)
    for g, w in zip(got, want, strict=True):
        assert g.subject_id == w.subject_id or abs(best[g.subject_id] - w.score) <= tol, (g, w)
        assert abs(best[g.subject_id] - g.score) <= tol
        face_subject, vector = faces[g.face_id]  # a face of model m1, of that subject
        assert face_subject == g.subject_id
        assert abs(float(np.dot(query.astype(np.float64), vector)) - g.score) <= tol


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def protocol(request) -> int:
    return request.param


@pytest.fixture
def stack_client(protocol: int, redis_stack, redis_stack_client: redis.Redis):
    """An emptied Redis Stack: the RESP3 fixture client itself, or a RESP2 client like the app's."""
    if protocol == 3:
        yield redis_stack_client
        return
    client = redis.Redis.from_url(redis_stack.url, protocol=2)
    yield client
    client.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.fixture
def gallery(stack_client: redis.Redis, rng):
    """~50 subjects x 1-4 faces of model m1; model m2 (same size) holds the exact query vectors for
    subjects of its own, model m3 faces of another size."""
    store = GalleryStore(stack_client)
    centres = {f"person-{i:02d}": unit(rng) for i in range(50)}
    m1 = [(sid, near(rng, c, 0.7)) for sid, c in centres.items() for _ in range(int(rng.integers(1, 5)))]
    enroll(store, "m1", m1)
    queries = np.stack([near(rng, c, 0.4) for c in list(centres.values())[:30]] + list(unit(rng, n=10)))
    enroll(store, "m2", [(f"m2-only-{i}", q) for i, q in enumerate(queries)])  # would win every query
    enroll(store, "m2", [(sid, unit(rng)) for sid in list(centres)[:10]])
    enroll(store, "m3", [(sid, unit(rng, OTHER_DIM)) for sid in list(centres)[:20]])
    return store, queries


def test_knn_matches_the_exact_search(gallery, protocol: int, rng):
    store, queries = gallery
    client = store.redis
    knn = RedisKnnSearch(client, model_id="m1", dim=DIM)
    knn.ensure_index()  # created after the faces: waits for the engine to index them
    raw_info = client.execute_command("FT.INFO", knn.index_name)
    assert isinstance(raw_info, dict) == (protocol == 3)  # the fixture really speaks RESP3

    faces = model_faces(store, "m1")
    m2_faces = set(model_faces(store, "m2"))
    assert len(knn) == len(faces) == store.stats("m1").faces
    live = LiveIndex(store, "m1", DIM)
    exact = VectorIndex(DIM)
    exact.add(list(faces), [s for s, _ in faces.values()], np.stack([v for _, v in faces.values()]))

    n_subjects = len({s for s, _ in faces.values()})
    for k in (1, 5, 10, n_subjects + 7):
        got_all, live_all, want_all = (
            knn.search(queries, k),
            live.search(queries, k),
            exact.search(queries, k),
        )
        for query, got, from_live, want in zip(queries, got_all, live_all, want_all, strict=True):
            assert len(got) == min(k, n_subjects)
            assert_same_hits(got, want, query, faces)
            assert_same_hits(got, from_live, query, faces)
            assert not {h.face_id for h in got} & m2_faces
            assert not any(h.subject_id.startswith("m2-only") for h in got)

    assert knn.search(queries[:3], 0) == [[], [], []]
    assert knn.search(queries[0], 1)[0][0].score < 0.999  # the m2 copy of the query is not there


def test_subject_with_many_faces_near_the_query_comes_once(stack_client: redis.Redis, rng):
    store = GalleryStore(stack_client)
    query = unit(rng)
    # 300 faces of one subject closer to the query than any other face: more than the first KNN
    # round asks for (64), so the search must ask again for more neighbours.
    enroll(store, "m1", [("crowd", near(rng, query, 0.05)) for _ in range(300)])
    enroll(store, "m1", [(f"other-{i % 12}", unit(rng)) for i in range(40)])
    knn = RedisKnnSearch(stack_client, model_id="m1", dim=DIM)
    knn.ensure_index()
    faces = model_faces(store, "m1")
    exact = VectorIndex(DIM)
    exact.add(list(faces), [s for s, _ in faces.values()], np.stack([v for _, v in faces.values()]))
    for k in (1, 5, 13, 20):
        got = knn.search(query, k)[0]
        assert got[0].subject_id == "crowd"
        assert [h.subject_id for h in got].count("crowd") == 1
        assert len(got) == min(k, 13)
        assert_same_hits(got, exact.search(query, k)[0], query, faces)


def test_index_follows_adds_and_deletes(stack_client: redis.Redis, rng):
    store = GalleryStore(stack_client)
    enroll(store, "m1", [(f"p{i}", unit(rng)) for i in range(20)])
    knn = RedisKnnSearch(stack_client, model_id="m1", dim=DIM)
    knn.ensure_index()
    assert len(knn) == 20

    query = unit(rng)
    (late,) = enroll(store, "m1", [("newcomer", query)])
    enroll(store, "m2", [("m2-person", query)])
    assert len(knn) == 21
    top = knn.search(query, 2)[0]
    assert (top[0].subject_id, top[0].face_id) == ("newcomer", late.id)
    assert top[0].score == pytest.approx(1.0, abs=1e-5)
    assert top[1].subject_id != "m2-person"

    (second,) = enroll(store, "m1", [("newcomer", near(rng, query, 0.1))])
    store.delete_face(late.id)
    assert len(knn) == 21
    top = knn.search(query, 1)[0][0]
    assert (top.subject_id, top.face_id) == ("newcomer", second.id) and top.score < 0.9999

    store.delete_subject("newcomer")
    assert len(knn) == 20
    hits = knn.search(query, 30)[0]
    assert len(hits) == 20 and "newcomer" not in {h.subject_id for h in hits}
    faces = model_faces(store, "m1")
    assert_same_hits(hits, LiveIndex(store, "m1", DIM).search(query, 30)[0], query, faces)


def test_ensure_index_is_idempotent_and_per_model(stack_client: redis.Redis, rng):
    store = GalleryStore(stack_client)
    knn = RedisKnnSearch(stack_client, model_id="m1", dim=DIM)
    knn.ensure_index()  # on an empty gallery
    assert len(knn) == 0
    assert knn.search(unit(rng, n=2), 5) == [[], []]
    enroll(store, "m1", [("a", unit(rng)), ("b", unit(rng))])
    knn.ensure_index()
    assert len(knn) == 2

    other = RedisKnnSearch(stack_client, model_id='m"2\\x', dim=DIM)  # quotes in a model id
    assert other.index_name != knn.index_name
    enroll(store, 'm"2\\x', [("c", unit(rng))])
    other.ensure_index()
    names = {n.decode() for n in stack_client.execute_command("FT._LIST")}
    assert names == {knn.index_name, other.index_name}
    assert len(other) == 1 and len(knn) == 2
    assert [h.subject_id for h in other.search(unit(rng), 5)[0]] == ["c"]
    assert {h.subject_id for h in knn.search(unit(rng), 5)[0]} == {"a", "b"}

    other.drop()
    assert {n.decode() for n in stack_client.execute_command("FT._LIST")} == {knn.index_name}
    assert store.stats('m"2\\x').faces == 1  # dropping the index keeps the faces


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_ensure_index_without_query_engine(redis_server, protocol: int):
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    try:
        knn = RedisKnnSearch(client, model_id="m1", dim=DIM)
        with pytest.raises(RedisSetupError, match="needs a Redis with the Query Engine") as info:
            knn.ensure_index()
        assert "SPHEREFACE_SEARCH=numpy" in info.value.message
        assert client.keys("*") == []
    finally:
        client.close()
