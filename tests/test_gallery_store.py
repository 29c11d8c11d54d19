"""The gallery in a real Redis (Debian redis-server): subjects, faces, the revision and change stream,
and the in-process indexes (VectorIndex, LiveIndex kept in sync by several workers)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import redis

from service.errors import (
    DuplicatePhotoError,
    FaceNotFoundError,
    InvalidEmbeddingError,
    InvalidRequestError,
    SubjectExistsError,
    SubjectNotFoundError,
)
from service.gallery.index import LiveIndex, SubjectHit, VectorIndex
from service.gallery.store import (
    FaceRecord,
    GalleryStore,
    NewFace,
    check_embedding,
    embedding_sha256,
    migrate_subject_faces_keys,
)
from tests.gallery_vectors import emb_face, near, random_unit

DIM = 16


# -- helpers ------------------------------------------------------------------------------------


def unit(rng: np.random.Generator, dim: int = DIM, n: int | None = None) -> np.ndarray:
    return random_unit(rng, dim, n)


def add_one(store: GalleryStore, subject_id: str, model_id: str, face: NewFace | np.ndarray) -> FaceRecord:
    if isinstance(face, np.ndarray):
        face = emb_face(face)
    (result,) = store.add_faces(subject_id, model_id, [face])
    assert isinstance(result, FaceRecord), result
    return result


def keys(client: redis.Redis) -> set[str]:
    return {k.decode() for k in client.keys("*")}


def last_entries(client: redis.Redis, store: GalleryStore, count: int) -> list[dict[str, str]]:
    """The last ``count`` change-stream entries, oldest first, as str dicts."""
    entries = client.xrevrange(store.changes_key, count=count)[::-1]
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


def gallery_faces(store: GalleryStore, model_id: str) -> dict[str, tuple[str, np.ndarray]]:
    """face id -> (subject id, embedding) of one model, read from Redis."""
    ids = [f.decode() for f in store.redis.smembers(store.model_faces_key(model_id))]
    out = {}
    for face_id in ids:
        record = store.get_face(face_id, with_embedding=True)
        assert record.model_id == model_id
        out[face_id] = (record.subject_id, record.embedding)
    return out


def index_entries(index: VectorIndex) -> dict[str, tuple[str, np.ndarray]]:
    """face id -> (subject id, vector) as the index holds them, checking its row bookkeeping."""
    n = len(index)
    assert len(index._face_ids) == len(index._row) == n
    out = {}
    for row, face_id in enumerate(index._face_ids):
        assert index._row[face_id] == row
        subject = index._subject_names[int(index._subject_codes[row])]
        out[face_id] = (subject, index._matrix[row].copy())
    return out


def assert_same_entries(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for face_id, (subject, vector) in want.items():
        assert got[face_id][0] == subject, face_id
        np.testing.assert_array_equal(got[face_id][1], vector)


def reference_subject_scores(query: np.ndarray, faces: dict[str, tuple[str, np.ndarray]]) -> dict[str, float]:
    """Brute force in float64: each subject's best cosine."""
    best: dict[str, float] = {}
    for subject, vector in faces.values():
        score = float(np.dot(query.astype(np.float64), vector.astype(np.float64)))
        best[subject] = max(score, best.get(subject, -np.inf))
    return best


def assert_hits_match_reference(
    hits: list[SubjectHit], query: np.ndarray, faces: dict[str, tuple[str, np.ndarray]], k: int, tol=1e-5
) -> None:
    """Each subject once, best first, the reference's top-k scores; every hit's score is its subject's
    best and its face is one of that subject's faces with that score (ties may come in any order)."""
    best = reference_subject_scores(query, faces)
    want = sorted(best.values(), reverse=True)[:k]
    subjects = [h.subject_id for h in hits]
    assert len(hits) == min(k, len(best))
    assert len(set(subjects)) == len(subjects), subjects
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    np.testing.assert_allclose(scores, want, atol=tol, rtol=0)
    for hit in hits:
        assert abs(best[hit.subject_id] - hit.score) <= tol
        subject, vector = faces[hit.face_id]
        assert subject == hit.subject_id
        assert abs(float(np.dot(query.astype(np.float64), vector)) - hit.score) <= tol


@pytest.fixture
def store(redis_client: redis.Redis) -> GalleryStore:
    return GalleryStore(redis_client)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


# -- subjects -----------------------------------------------------------------------------------


def test_create_subject_with_given_and_generated_id(store: GalleryStore):
    alice = store.create_subject("alice.smith", "Alice Smith", {"employee": 1042, "tags": ["a"]})
    assert alice.id == "alice.smith"
    assert alice.name == "Alice Smith"
    assert alice.metadata == {"employee": 1042, "tags": ["a"]}
    assert alice.face_count == 0
    assert alice.created_at == alice.updated_at and alice.created_at.endswith("Z")
    assert store.get_subject("alice.smith") == alice

    generated = store.create_subject()
    # A generated id is 8 random bytes as 16 lowercase hex digits (a valid subject id), fresh each time.
    assert re.fullmatch(r"[0-9a-f]{16}", generated.id), generated.id
    fetched = store.get_subject(generated.id)
    assert fetched.name is None and fetched.metadata == {}
    more = [store.create_subject().id for _ in range(200)]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in more), more
    assert len(set(more) | {generated.id}) == 201
    assert store.revision() == 0  # subjects alone change no face: nothing for the indexes


def test_duplicate_subject_id(store: GalleryStore):
    first = store.create_subject("bob", "Bob", {"v": 1})
    with pytest.raises(SubjectExistsError, match="'bob' already exists"):
        store.create_subject("bob", "Other Bob", {"v": 2})
    assert store.get_subject("bob") == first
    assert store.list_subjects()[1] == 1


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "caf\u00e9", "a/b", "a,b", "a*", "{x}"])
def test_invalid_subject_id(store: GalleryStore, bad: str):
    with pytest.raises(InvalidRequestError, match="is not valid"):
        store.create_subject(bad)
    assert keys(store.redis) == set()


@pytest.mark.parametrize("good", ["x" * 128, "A_b.c-d@e:f", "0"])
def test_valid_subject_id_edges(store: GalleryStore, good: str):
    assert store.create_subject(good).id == good
    assert store.get_subject(good).id == good


def test_get_missing_subject(store: GalleryStore):
    with pytest.raises(SubjectNotFoundError, match="'ghost' does not exist"):
        store.get_subject("ghost")


def test_list_subjects_pages_in_creation_order(store: GalleryStore, rng):
    ids = [f"s{i:02d}" for i in range(7)][::-1]  # creation order differs from name order
    for sid in ids:
        store.create_subject(sid, name=sid.upper())
    add_one(store, ids[2], "m1", unit(rng))
    add_one(store, ids[2], "m2", unit(rng))

    pages = [store.list_subjects(offset, 3) for offset in (0, 3, 6, 9)]
    assert [total for _, total in pages] == [7, 7, 7, 7]
    assert [[s.id for s in page] for page, _ in pages] == [ids[0:3], ids[3:6], ids[6:], []]
    everyone, total = store.list_subjects(0, 100)
    assert total == 7 and [s.id for s in everyone] == ids
    assert {s.id: s.face_count for s in everyone} == {sid: (2 if sid == ids[2] else 0) for sid in ids}
    assert everyone[0].name == ids[0].upper()

    for offset, limit in ((0, 0), (-1, 3), (2, -1)):
        with pytest.raises(InvalidRequestError):
            store.list_subjects(offset, limit)


def test_search_subjects_by_id_or_name_in_any_case_across_batches(store: GalleryStore, rng, monkeypatch):
    import service.gallery.store as store_module

    monkeypatch.setattr(store_module, "SEARCH_BATCH", 3)  # 8 subjects: three round trips
    people = {
        "ada": "Ada Lovelace",
        "alan.t": "Alan Turing",
        "grace": "Grace Hopper",
        "x17": "Annie Easley",
        "katherine": None,
        "dorothy": "Dorothy Vaughan",
        "mary": "Mary Jackson",
        "lovelace-fan": "Someone Else",
    }
    for sid, name in people.items():
        store.create_subject(sid, name=name)
    add_one(store, "grace", "m1", unit(rng))

    def found(query: str, offset: int = 0, limit: int = 50) -> tuple[list[str], int]:
        page, total = store.list_subjects(offset, limit, "m1", query=query)
        return [s.id for s in page], total

    assert found("LOVELACE") == (["ada", "lovelace-fan"], 2)  # a name and an id, in creation order
    assert found("an") == (["alan.t", "x17", "dorothy", "lovelace-fan"], 4)  # "fan" too
    assert found("an", offset=1, limit=2) == (["x17", "dorothy"], 4)  # paging within the matches
    assert found("kath") == (["katherine"], 1)  # a subject without a name, found by its id
    assert found("nobody") == ([], 0)
    assert found("  ") == (list(people), 8)  # a blank query lists everyone
    (grace,), _ = store.list_subjects(0, 5, "m1", query="hopper")
    assert grace.face_count == 1


def test_an_id_cannot_reach_another_subjects_keys(store: GalleryStore, rng):
    """Before: the subject "victim:faces" had the key of victim's face set, and WRONGTYPE
    errors broke the listing, enrollment and deletion of victim for everyone."""
    store.create_subject("victim", name="Victim")
    store.create_subject("victim:faces", name="Attacker")
    add_one(store, "victim", "m1", unit(rng))
    add_one(store, "victim:faces", "m1", unit(rng))
    listed, total = store.list_subjects(0, 10, "m1")
    assert total == 2 and [(s.id, s.face_count) for s in listed] == [("victim", 1), ("victim:faces", 1)]
    assert store.get_subject("victim", "m1").name == "Victim"
    assert store.delete_subject("victim") == 1
    assert [s.id for s in store.list_subjects()[0]] == ["victim:faces"]
    assert len(store.subject_faces("victim:faces")) == 1


def test_face_sets_of_an_older_gallery_are_renamed_once(store: GalleryStore, redis_client, rng):
    store.create_subject("ada")
    face = add_one(store, "ada", "m1", unit(rng))
    store.create_subject("x:faces")  # its hash has the old layout's face-set key of "x"
    # the layout before version 0.3: the face set at P subject:{id}:faces, no schema marker
    redis_client.rename("sf:subject-faces:ada", "sf:subject:ada:faces")
    redis_client.delete("sf:schema")
    assert store.subject_faces("ada") == []

    fresh = GalleryStore(redis_client)
    assert fresh.ensure_schema() == 1
    assert [f.id for f in fresh.subject_faces("ada")] == [face.id]
    assert not redis_client.exists("sf:subject:ada:faces")
    assert fresh.get_subject("x:faces").id == "x:faces"  # a subject hash is not a face set
    assert int(redis_client.get("sf:schema")) == 2
    redis_client.rename("sf:subject-faces:ada", "sf:subject:ada:faces")
    assert migrate_subject_faces_keys(redis_client) == 0  # recorded as done: no second scan


def test_update_subject(store: GalleryStore):
    created = store.create_subject("carol", "Carol", {"team": "a", "level": 1})

    renamed = store.update_subject("carol", name="Carol C.")
    assert renamed.name == "Carol C."
    assert renamed.metadata == {"team": "a", "level": 1}  # untouched
    assert renamed.created_at == created.created_at
    assert renamed.updated_at >= created.updated_at

    replaced = store.update_subject("carol", metadata={"team": "b"})
    assert replaced.metadata == {"team": "b"}  # replaced, not merged
    assert replaced.name == "Carol C."
    assert json.loads(store.redis.hget(store.subject_key("carol"), "metadata")) == {"team": "b"}

    both = store.update_subject("carol", name="C", metadata={})
    assert (both.name, both.metadata) == ("C", {})
    assert store.get_subject("carol") == both
    assert store.revision() == 0


def test_update_missing_subject(store: GalleryStore):
    with pytest.raises(SubjectNotFoundError, match="'nobody' does not exist"):
        store.update_subject("nobody", name="X", metadata={"a": 1})
    assert keys(store.redis) == set()  # not created by the update


def test_delete_subject_removes_faces_photos_and_sets(store: GalleryStore, rng):
    store.create_subject("dave", "Dave", {"x": 1})
    m1 = store.add_faces("dave", "m1", [emb_face(unit(rng)) for _ in range(3)])
    m2 = store.add_faces("dave", "m2", [NewFace(unit(rng, 8), "a" * 64, box=[1, 2, 3, 4])])
    assert all(isinstance(r, FaceRecord) for r in m1 + m2)
    assert store.get_subject("dave").face_count == 4
    rev = store.revision()
    assert store.redis.exists(*(store.face_key(r.id) for r in m1 + m2)) == 4

    assert store.delete_subject("dave") == 4
    assert store.revision() == rev + 4
    assert keys(store.redis) == {store.rev_key, store.changes_key}
    with pytest.raises(SubjectNotFoundError):
        store.get_subject("dave")
    for record in m1 + m2:
        with pytest.raises(FaceNotFoundError):
            store.get_face(record.id)
    assert store.list_subjects() == ([], 0)
    entries = last_entries(store.redis, store, 4)
    assert {e["face"] for e in entries} == {r.id for r in m1 + m2}
    assert {e["op"] for e in entries} == {"remove"} and {e["subject"] for e in entries} == {"dave"}

    # The photos are free again: the same id and the same photos enroll anew.
    store.create_subject("dave")
    again = store.add_faces("dave", "m2", [NewFace(unit(rng, 8), "a" * 64)])
    assert isinstance(again[0], FaceRecord)
    with pytest.raises(SubjectNotFoundError):
        store.delete_subject("nobody")


def test_delete_subject_leaves_other_subjects_alone(store: GalleryStore, rng):
    store.create_subject("keep")
    store.create_subject("drop")
    kept = add_one(store, "keep", "m1", unit(rng))
    add_one(store, "drop", "m1", unit(rng))
    store.delete_subject("drop")
    assert store.get_face(kept.id).subject_id == "keep"
    assert store.redis.smembers(store.model_faces_key("m1")) == {kept.id.encode()}
    assert [s.id for s in store.list_subjects()[0]] == ["keep"]


# -- faces --------------------------------------------------------------------------------------


def test_add_faces_returns_records(store: GalleryStore, rng):
    store.create_subject("erin")
    faces = [
        NewFace(unit(rng), "1" * 64, box=[10.0, 20.0, 110.0, 140.0], landmarks=[[1.5, 2.5]] * 5,
                detection_score=0.998),
        emb_face(unit(rng)),
    ]  # fmt: skip
    results = store.add_faces("erin", "m1", faces)
    assert all(isinstance(r, FaceRecord) for r in results)
    first, second = results
    assert first.id != second.id and len(first.id) == 24
    assert (first.subject_id, first.model_id, first.photo_sha256, first.source) == (
        "erin",
        "m1",
        "1" * 64,
        "photo",
    )
    assert first.box == [10.0, 20.0, 110.0, 140.0] and first.detection_score == 0.998
    assert second.source == "embedding" and second.box is None and second.detection_score is None

    stored = store.get_face(first.id)
    assert stored == first  # every field round-trips; no embedding unless asked
    assert stored.embedding is None
    assert store.get_face(second.id) == second
    assert [f.id for f in store.subject_faces("erin")] == sorted([first.id, second.id])
    assert store.get_subject("erin").face_count == 2
    assert store.redis.smembers(store.model_faces_key("m1")) == {first.id.encode(), second.id.encode()}
    assert store.redis.get(store.photo_key("m1", "1" * 64)) == first.id.encode()


def test_duplicate_photo(store: GalleryStore, rng):
    store.create_subject("fay")
    store.create_subject("gus")
    vector = unit(rng)
    first = add_one(store, "fay", "m1", NewFace(vector, "f" * 64))
    rev = store.revision()

    for subject in ("fay", "gus"):  # the photo key is per model, not per subject
        (dup,) = store.add_faces(subject, "m1", [NewFace(unit(rng), "f" * 64)])
        assert isinstance(dup, DuplicatePhotoError)
        assert first.id in dup.message
    assert store.revision() == rev  # a rejected face changes nothing
    assert store.get_subject("gus").face_count == 0

    other_model = add_one(store, "gus", "m2", NewFace(vector, "f" * 64))
    assert other_model.model_id == "m2"

    # Twice in one request: the second one is the duplicate.
    twice = store.add_faces("fay", "m1", [NewFace(unit(rng), "e" * 64), NewFace(unit(rng), "e" * 64)])
    assert isinstance(twice[0], FaceRecord) and isinstance(twice[1], DuplicatePhotoError)
    assert twice[0].id in twice[1].message

    # The same embedding sent twice is the same "photo".
    again = store.add_faces("gus", "m1", [emb_face(vector), emb_face(vector.copy())])
    assert isinstance(again[0], FaceRecord) and isinstance(again[1], DuplicatePhotoError)


def test_add_faces_for_unknown_subject(store: GalleryStore, rng):
    store.create_subject("hal")
    results = store.add_faces_bulk(
        [("hal", emb_face(unit(rng))), ("ghost", emb_face(unit(rng))), ("hal", emb_face(unit(rng)))], "m1"
    )
    assert isinstance(results[0], FaceRecord) and isinstance(results[2], FaceRecord)
    assert isinstance(results[1], SubjectNotFoundError) and "'ghost'" in results[1].message
    assert store.revision() == 2
    assert not store.redis.exists(store.subject_key("ghost"), store.subject_faces_key("ghost"))
    assert store.stats("m1").faces == 2


def test_max_faces_per_subject(redis_client: redis.Redis, rng):
    store = GalleryStore(redis_client, max_faces_per_subject=3)
    store.create_subject("ivy")
    results = store.add_faces("ivy", "m1", [emb_face(unit(rng)) for _ in range(4)])
    assert [type(r) for r in results] == [FaceRecord] * 3 + [InvalidRequestError]
    assert "3 faces" in results[3].message
    # The limit counts faces of every model.
    (other,) = store.add_faces("ivy", "m2", [emb_face(unit(rng))])
    assert isinstance(other, InvalidRequestError)
    assert store.get_subject("ivy").face_count == 3 and store.revision() == 3

    store.delete_face(results[0].id)
    assert isinstance(store.add_faces("ivy", "m2", [emb_face(unit(rng))])[0], FaceRecord)


def test_get_face_embedding_round_trips_exactly(store: GalleryStore, rng):
    store.create_subject("jo")
    # Awkward float32 values: denormals, extremes, negative zero, values with all mantissa bits.
    vector = np.array(
        [1e-45, -3.4028235e38, 3.4028235e38, -0.0, 1 / 3, np.pi, -1e-38, 0.1] * 2, dtype=np.float32
    )
    vector[8:] = rng.standard_normal(8).astype(np.float32)
    record = add_one(store, "jo", "m1", NewFace(vector, "b" * 64))
    fetched = store.get_face(record.id, with_embedding=True)
    assert fetched.embedding.dtype == np.float32 and fetched.embedding.shape == (DIM,)
    assert fetched.embedding.tobytes() == vector.tobytes()  # bit for bit
    assert fetched.embedding.flags.writeable  # a copy, not a view of the reply
    assert store.redis.hget(store.face_key(record.id), "embedding") == vector.astype("<f4").tobytes()
    (listed,) = store.subject_faces("jo", with_embedding=True)
    assert listed.embedding.tobytes() == vector.tobytes()


def test_delete_face(store: GalleryStore, rng):
    store.create_subject("kim")
    vector = unit(rng)
    face = add_one(store, "kim", "m1", vector)
    other = add_one(store, "kim", "m1", unit(rng))
    rev = store.revision()

    store.delete_face(face.id)
    assert store.revision() == rev + 1
    with pytest.raises(FaceNotFoundError, match=face.id):
        store.get_face(face.id)
    assert store.redis.smembers(store.subject_faces_key("kim")) == {other.id.encode()}
    assert store.redis.smembers(store.model_faces_key("m1")) == {other.id.encode()}
    assert not store.redis.exists(store.photo_key("m1", embedding_sha256(vector)))

    with pytest.raises(FaceNotFoundError):
        store.delete_face(face.id)
    with pytest.raises(FaceNotFoundError):
        store.delete_face("0" * 24)
    assert store.revision() == rev + 1  # failed deletes change nothing
    add_one(store, "kim", "m1", vector)  # its photo may be enrolled again


def test_remove_faces_ignores_unknown_ids(store: GalleryStore, rng):
    store.create_subject("lee")
    a, b, c = (add_one(store, "lee", "m1", unit(rng)) for _ in range(3))
    assert store.remove_faces([a.id, "unknown", b.id, a.id]) == 2
    assert store.revision() == 5
    assert store.remove_faces(["unknown"]) == 0
    assert store.remove_faces([]) == 0
    assert store.revision() == 5
    assert [f.id for f in store.subject_faces("lee")] == [c.id]


def test_stats_per_model(store: GalleryStore, rng):
    assert (store.stats("m1").subjects, store.stats("m1").faces, store.stats("m1").revision) == (0, 0, 0)
    for sid in ("a", "b", "c"):
        store.create_subject(sid)
    for sid in ("a", "b"):
        add_one(store, sid, "m1", unit(rng))
    add_one(store, "a", "m2", unit(rng, 4))
    m1, m2, m3 = store.stats("m1"), store.stats("m2"), store.stats("m3")
    assert (m1.subjects, m1.faces, m1.revision) == (3, 2, 3)
    assert (m2.subjects, m2.faces, m2.revision) == (3, 1, 3)
    assert (m3.subjects, m3.faces, m3.revision) == (3, 0, 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, 2.0, 3.0], "must have 4 values for this model, got 3"),
        ([1.0] * 5, "got 5"),
        ([], "got 0"),
        ([1.0, float("nan"), 0.0, 0.0], "finite"),
        ([1.0, float("inf"), 0.0, 0.0], "finite"),
        ([1.0, 1e39, 0.0, 0.0], "finite"),  # overflows float32
        ([0.0, 0.0, 0.0, 0.0], "all zeros"),
        ([0.0, -0.0, 0.0, 0.0], "all zeros"),
    ],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_check_embedding_errors(values, message):
    with pytest.raises(InvalidEmbeddingError, match=message):
        check_embedding(values, 4)


def test_check_embedding_normalises():
    out = check_embedding([3.0, 4.0, 0.0, 0.0], 4)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.6, 0.8, 0.0, 0.0], rtol=1e-7)
    for values in ([[1.0, 2.0], [3.0, 4.0]], np.float64([-2, 0, 0, 0]), [1e-5, 0, 0, 2e-5], [3e30] * 4):
        out = check_embedding(values, 4)
        assert out.shape == (4,) and out.dtype == np.float32
        assert abs(float(np.linalg.norm(out.astype(np.float64))) - 1.0) < 1e-6
        direction = np.asarray(values, dtype=np.float64).reshape(-1)
        np.testing.assert_allclose(out, direction / np.linalg.norm(direction), rtol=1e-6)


# -- the revision counter and the change stream --------------------------------------------------


def test_every_change_bumps_rev_once_and_appends_its_entry(store: GalleryStore, rng):
    client = store.redis

    def expect(ops: list[tuple[str, str, str, str]]) -> None:
        """After a change: rev moved by len(ops), and the stream's last entries are ``ops`` in order."""
        nonlocal rev, length
        assert store.revision() == rev + len(ops)
        assert client.xlen(store.changes_key) == length + len(ops)
        entries = last_entries(client, store, len(ops)) if ops else []
        want = [
            {"rev": str(rev + 1 + i), "op": op, "face": face, "subject": subject, "model": model}
            for i, (op, face, subject, model) in enumerate(ops)
        ]
        assert entries == want
        rev, length = rev + len(ops), length + len(ops)

    rev, length = 0, 0
    store.create_subject("p")
    store.create_subject("q")
    store.update_subject("q", name="Q")
    expect([])

    a = add_one(store, "p", "m1", unit(rng))
    expect([("add", a.id, "p", "m1")])
    bulk = store.add_faces_bulk([("q", emb_face(unit(rng))), ("p", emb_face(unit(rng, 4)))], "m2")
    expect([("add", bulk[0].id, "q", "m2"), ("add", bulk[1].id, "p", "m2")])

    # Rejected faces leave no trace.
    store.add_faces_bulk(
        [
            ("ghost", emb_face(unit(rng))),
            ("p", emb_face(store.get_face(a.id, with_embedding=True).embedding)),
        ],
        "m1",
    )
    expect([])

    store.delete_face(a.id)
    expect([("remove", a.id, "p", "m1")])
    with pytest.raises(FaceNotFoundError):
        store.delete_face(a.id)
    expect([])
    store.remove_faces([bulk[1].id, "nope", bulk[0].id])
    expect([("remove", bulk[1].id, "p", "m2"), ("remove", bulk[0].id, "q", "m2")])

    b = add_one(store, "q", "m1", unit(rng))
    store.delete_subject("p")  # no faces left: no change of the gallery's faces
    expect([("add", b.id, "q", "m1")])
    store.delete_subject("q")
    expect([("remove", b.id, "q", "m1")])

    ids = [entry_id for entry_id, _ in client.xrange(store.changes_key)]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split(b"-"))))


# -- LiveIndex: workers kept in sync through Redis ------------------------------------------------


def test_two_workers_see_each_others_changes(redis_client, other_client, rng):
    store_a, store_b = GalleryStore(redis_client), GalleryStore(other_client)
    worker_a, worker_b = LiveIndex(store_a, "m1", DIM), LiveIndex(store_b, "m1", DIM)
    assert worker_a.refresh() == worker_b.refresh() == 0
    assert len(worker_a) == len(worker_b) == 0

    store_a.create_subject("ann")
    store_b.create_subject("ben")
    ann = [add_one(store_a, "ann", "m1", unit(rng)) for _ in range(3)]
    ben = add_one(store_b, "ben", "m1", unit(rng))
    m2 = add_one(store_b, "ben", "m2", unit(rng))  # another model, same size: never in the index

    for worker in (worker_a, worker_b):
        assert worker.refresh() == 5
        assert_same_entries(index_entries(worker.index), gallery_faces(store_a, "m1"))
        assert m2.id not in worker.index

    query = store_a.get_face(ann[1].id, with_embedding=True).embedding
    hits = worker_b.search(query, 2)[0]
    assert hits[0].subject_id == "ann" and hits[0].face_id == ann[1].id
    assert hits[0].score == pytest.approx(1.0, abs=1e-6)
    assert [h.subject_id for h in hits] == ["ann", "ben"]

    # Worker b deletes, worker a sees it at its next search (search refreshes).
    store_b.delete_face(ann[1].id)
    store_b.delete_subject("ben")
    hits = worker_a.search(query, 5)[0]
    assert [h.subject_id for h in hits] == ["ann"] and hits[0].face_id != ann[1].id
    assert worker_a.revision == 8 and len(worker_a) == 2
    store_a.create_subject("cy")
    late = add_one(store_a, "cy", "m1", query)  # the deleted face's vector, under a new subject
    assert worker_b.search(query, 1)[0][0].face_id == late.id
    for worker in (worker_a, worker_b):
        worker.refresh()
        assert worker.revision == store_a.revision() == 9
        assert_same_entries(index_entries(worker.index), gallery_faces(store_a, "m1"))
        assert ben.id not in worker.index and m2.id not in worker.index
        assert worker.full_reloads == 1  # everything came from the stream


def test_other_model_of_another_size_is_ignored(store: GalleryStore, rng):
    store.create_subject("s")
    add_one(store, "s", "small", unit(rng, 4))
    kept = add_one(store, "s", "m1", unit(rng))
    live = LiveIndex(store, "m1", DIM)
    live.refresh()
    add_one(store, "s", "small", unit(rng, 4))  # applied from the stream: skipped, not reshaped
    live.refresh()
    assert list(index_entries(live.index)) == [kept.id]
    assert live.full_reloads == 1


@pytest.mark.parametrize("then_more", [False, True], ids=["stream-empty", "changes-after-trim"])
def test_stream_trimmed_behind_a_worker_reloads(redis_client, other_client, rng, then_more: bool):
    store, other = GalleryStore(redis_client), GalleryStore(other_client)
    worker = LiveIndex(store, "m1", DIM)
    for sid in ("a", "b", "c"):
        store.create_subject(sid)
    faces = [add_one(store, sid, "m1", unit(rng)) for sid in ("a", "b", "c") for _ in range(2)]
    worker.refresh()
    assert worker.full_reloads == 1 and len(worker) == 6

    # Meanwhile the others change the gallery and the stream is trimmed to nothing.
    other.delete_face(faces[0].id)
    other.delete_subject("b")
    added = [add_one(other, "c", "m1", unit(rng)) for _ in range(2)]
    add_one(other, "c", "m2", unit(rng))
    assert other_client.xtrim(other.changes_key, maxlen=0, approximate=False) > 0
    assert other_client.xlen(other.changes_key) == 0
    if then_more:
        added.append(add_one(other, "a", "m1", unit(rng)))
        other.delete_face(added[0].id)

    assert worker.refresh() == store.revision()
    assert worker.full_reloads == 2
    want = gallery_faces(store, "m1")
    assert_same_entries(index_entries(worker.index), want)
    assert faces[0].id not in worker.index and added[-1].id in worker.index
    query = unit(rng)
    assert_hits_match_reference(worker.search(query, 10)[0], query, want, 10)

    # After the reload it follows the stream again.
    newest = add_one(other, "a", "m1", unit(rng))
    worker.refresh()
    assert newest.id in worker.index and worker.full_reloads == 2


@pytest.mark.parametrize("new_faces", [1, 3], ids=["revision-went-back", "same-revision-again"])
def test_gallery_flushed_behind_a_worker_reloads(redis_client, rng, new_faces: int):
    store = GalleryStore(redis_client)
    store.create_subject("a")
    for _ in range(3):
        add_one(store, "a", "m1", unit(rng))
    worker = LiveIndex(store, "m1", DIM)
    assert worker.refresh() == 3
    redis_client.flushall()  # e.g. a Redis restored from an old backup: the revision counts anew
    store.create_subject("z")
    fresh = [add_one(store, "z", "m1", unit(rng)) for _ in range(new_faces)]
    assert worker.refresh() == new_faces
    assert set(index_entries(worker.index)) == {f.id for f in fresh}
    assert worker.full_reloads == 2


def test_live_index_search_matches_bruteforce(store: GalleryStore, rng):
    centres = {f"subj{i:02d}": unit(rng) for i in range(12)}
    for sid in centres:
        store.create_subject(sid)
    items = [
        (sid, emb_face(near(rng, c, 0.6))) for sid, c in centres.items() for _ in range(rng.integers(1, 6))
    ]
    # Ties: two subjects share an identical vector (as photos: distinct photo hashes).
    tie = unit(rng)
    store.create_subject("tie-a")
    store.create_subject("tie-b")
    items += [
        ("tie-a", NewFace(tie, "1" * 64)),
        ("tie-a", NewFace(tie, "2" * 64)),
        ("tie-b", NewFace(tie, "3" * 64)),
    ]
    assert all(isinstance(r, FaceRecord) for r in store.add_faces_bulk(items, "m1"))
    store.add_faces_bulk([(sid, emb_face(unit(rng))) for sid in centres], "m2")  # never returned

    live = LiveIndex(store, "m1", DIM)
    faces = gallery_faces(store, "m1")
    n_subjects = len(centres) + 2
    queries = np.stack([near(rng, c, 0.5) for c in centres.values()] + list(unit(rng, n=8)) + [tie])
    for k in (1, 3, n_subjects, 40):
        results = live.search(queries, k)
        assert len(results) == len(queries)
        for query, hits in zip(queries, results, strict=True):
            assert_hits_match_reference(hits, query, faces, k)

    top = live.search(tie, 3)[0]
    assert {top[0].subject_id, top[1].subject_id} == {"tie-a", "tie-b"}  # each tied subject once
    assert top[0].score == top[1].score == pytest.approx(1.0, abs=1e-6)
    assert top[2].score < top[1].score
    assert live.full_reloads == 1


def test_live_index_follows_random_changes(store: GalleryStore, rng):
    subjects = [f"r{i}" for i in range(6)]
    for sid in subjects:
        store.create_subject(sid)
    live = LiveIndex(store, "m1", DIM, batch=7)  # small batches: several XRANGE pages per refresh
    live.refresh()
    for step in range(12):
        count = int(rng.integers(1, 12))
        store.add_faces_bulk([(str(rng.choice(subjects)), emb_face(unit(rng))) for _ in range(count)], "m1")
        current = [f.decode() for f in store.redis.smembers(store.model_faces_key("m1"))]
        if current:
            store.remove_faces(
                list(rng.choice(current, size=min(len(current), int(rng.integers(0, 6))), replace=False))
            )
        if step % 3 == 2:
            live.refresh()
            assert_same_entries(index_entries(live.index), gallery_faces(store, "m1"))
    live.refresh()
    faces = gallery_faces(store, "m1")
    assert_same_entries(index_entries(live.index), faces)
    for query in unit(rng, n=5):
        assert_hits_match_reference(live.search(query, 4)[0], query, faces, 4)
    assert live.full_reloads == 1


# -- VectorIndex ----------------------------------------------------------------------------------


def test_vector_index_empty():
    index = VectorIndex(4)
    assert len(index) == 0 and "x" not in index
    assert index.search(np.eye(4, dtype=np.float32)[:3], 5) == [[], [], []]
    assert index.search(np.zeros(4, dtype=np.float32), 1) == [[]]
    index.add(["f"], ["s"], np.eye(4, dtype=np.float32)[:1])
    index.remove(["f", "f", "unknown"])
    assert len(index) == 0 and index.search(np.ones(4), 3) == [[]]


def test_vector_index_k_one_and_k_zero():
    index = VectorIndex(3)
    index.add(["f1", "f2", "f3"], ["a", "b", "b"], [[1, 0, 0], [0, 1, 0], [0.6, 0.8, 0]])
    (hits,) = index.search(np.float32([0.8, 0.6, 0]), 1)
    assert len(hits) == 1
    assert (hits[0].subject_id, hits[0].face_id) == ("b", "f3")
    assert hits[0].score == pytest.approx(0.96)
    assert index.search(np.float32([1, 0, 0]), 0) == [[]]
    assert [h.subject_id for h in index.search(np.float32([1, 0, 0]), 5)[0]] == ["a", "b"]


def test_vector_index_add_existing_face_replaces_it():
    index = VectorIndex(2)
    index.add(["f1", "f2"], ["a", "b"], [[1, 0], [0, 1]])
    index.add(["f1"], ["c"], [[0, 1]])  # same face id: new vector and subject
    assert len(index) == 2
    assert index_entries(index)["f1"][0] == "c"
    hits = index.search(np.float32([1, 0]), 5)[0]
    assert {h.subject_id for h in hits} == {"b", "c"}  # "a" has no face any more
    assert all(h.score == pytest.approx(0.0) for h in hits)
    hits = index.search(np.float32([0, 1]), 5)[0]
    assert {(h.subject_id, h.face_id) for h in hits} == {("b", "f2"), ("c", "f1")}
    with pytest.raises(ValueError, match="same length"):
        index.add(["x", "y"], ["s"], [[1, 0], [0, 1]])


def test_vector_index_subject_with_many_faces_and_k_beyond_subjects(rng):
    # One subject with many faces near the query fills the first candidate set (64 rows): the
    # search must widen it to find the other subjects, each once.
    index = VectorIndex(DIM, initial_capacity=4)
    query = unit(rng)
    faces = {f"crowd{i}": ("crowd", near(rng, query, 0.05)) for i in range(300)}
    faces |= {f"o{i}": (f"other{i % 7}", unit(rng)) for i in range(40)}
    index.add(list(faces), [s for s, _ in faces.values()], np.stack([v for _, v in faces.values()]))
    for k in (1, 5, 8, 100):
        hits = index.search(query, k)[0]
        assert hits[0].subject_id == "crowd"
        assert_hits_match_reference(hits, query, faces, k)


def test_vector_index_random_adds_and_removes_match_a_dict(rng):
    index = VectorIndex(8, initial_capacity=2)
    reference: dict[str, tuple[str, np.ndarray]] = {}
    next_id = 0
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not reference:
            n = int(rng.integers(1, 5))
            ids = []
            for _ in range(n):
                if reference and rng.random() < 0.2:
                    ids.append(str(rng.choice(list(reference))))  # replace an existing face
                else:
                    ids.append(f"f{next_id}")
                    next_id += 1
            subjects = [f"s{int(rng.integers(0, 10))}" for _ in ids]
            vectors = unit(rng, 8, n)
            index.add(ids, subjects, vectors)
            for face_id, subject, vector in zip(ids, subjects, vectors, strict=True):
                reference[face_id] = (subject, vector)
        else:
            present = list(reference)
            doomed = list(rng.choice(present, size=min(len(present), int(rng.integers(1, 6))), replace=False))
            doomed += ["missing", doomed[0]]  # unknown ids and repeats are ignored
            index.remove(doomed)
            for face_id in doomed:
                reference.pop(face_id, None)
        assert len(index) == len(reference)
        if step % 20 == 0 or step == 399:
            assert_same_entries(index_entries(index), reference)
    for query in unit(rng, 8, 10):
        assert_hits_match_reference(index.search(query, 6)[0], query, reference, 6)
