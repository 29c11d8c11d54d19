"""The int8 scan with exact re-rank (service/gallery/int8_scan.py) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from service.gallery import int8_scan
from service.gallery.index import VectorIndex


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def brute_force(
    vectors: np.ndarray, subjects: list[str], query: np.ndarray, k: int
) -> list[tuple[str, float]]:
    scores = vectors @ query
    best: dict[str, float] = {}
    for s, v in zip(subjects, scores, strict=True):
        best[s] = max(best.get(s, -np.inf), float(v))
    return sorted(best.items(), key=lambda item: -item[1])[:k]


def assert_same_as_brute_force(index: VectorIndex, vectors, subjects, queries, k: int) -> None:
    for q in queries:
        got = [(h.subject_id, h.score) for h in index.search(q[None], k)[0]]
        want = brute_force(vectors, subjects, q, k)
        assert [s for s, _ in got] == [s for s, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], atol=1e-5)


@pytest.fixture(scope="module")
def gallery():
    """Clustered faces (subjects of 1-6 near-copies), so many faces score close to each other."""
    rng = np.random.default_rng(7)
    centres = unit(rng.standard_normal((3000, 64)))
    per = rng.integers(1, 7, size=len(centres))
    rows = np.repeat(np.arange(len(centres)), per)
    vectors = unit(centres[rows] + 0.3 * unit(rng.standard_normal((len(rows), 64))))
    subjects = [f"s{r}" for r in rows]
    queries = np.concatenate(
        [
            unit(rng.standard_normal((10, 64))),  # nobody in particular
            unit(vectors[rng.choice(len(vectors), 10)] + 0.5 * unit(rng.standard_normal((10, 64)))),
        ]
    )
    return vectors, subjects, queries


def test_bound_holds_for_every_row(gallery):
    """|q.x - approx| <= eps for every stored row, including a clipped spike vector."""
    vectors, _, queries = gallery
    spike = np.zeros((1, 64), np.float32)
    spike[0, 3] = 1.0  # far past the clip: its residual carries the clipped part
    rows = np.concatenate([vectors, spike])
    scan = int8_scan.Int8Scan(64, capacity=len(rows))
    scan.set_rows(np.arange(len(rows)), rows)
    assert scan.max_residual > 0.2  # the spike was clipped
    for q in queries:
        d, a, d_norm, residual = int8_scan.quantize_query(q)
        approx = a * scan.step * int8_scan.int_scores(scan.codes, d).astype(np.float64)
        eps = a * d_norm * scan.max_residual + residual * scan.max_norm
        err = np.abs(rows.astype(np.float64) @ q - approx)
        assert err.max() <= eps
        assert err.max() > 0  # quantised: not exact, the bound is doing work


def test_int_scores_match_numpy():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(1000, 32), dtype=np.uint8)
    query = rng.integers(-127, 128, size=32, dtype=np.int8)
    want = (codes.astype(np.int32) - 128) @ query.astype(np.int32)
    np.testing.assert_array_equal(int8_scan.int_scores(codes, query), want)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_int8_search_equals_brute_force(gallery, k):
    vectors, subjects, queries = gallery
    index = VectorIndex(64, int8_scan_min_faces=1)
    index.add([f"f{i}" for i in range(len(vectors))], subjects, vectors)
    assert_same_as_brute_force(index, vectors, subjects, queries, k)
    assert index._int8 is not None  # the int8 path answered


def test_candidates_are_few(gallery):
    """The bound prunes: a random query re-ranks a small fraction of the gallery."""
    vectors, subjects, queries = gallery
    index = VectorIndex(64, int8_scan_min_faces=1)
    index.add([f"f{i}" for i in range(len(vectors))], subjects, vectors)
    index.search(queries[:1], 5)
    n = len(index)
    counts = [len(index._int8.candidates(q, n, index._subject_codes[:n], 5)) for q in queries]
    assert max(counts) < n // 10


def test_int8_copy_follows_adds_removes_and_replacements(gallery):
    vectors, subjects, queries = gallery
    rng = np.random.default_rng(3)
    ids = [f"f{i}" for i in range(len(vectors))]
    index = VectorIndex(64, initial_capacity=16, int8_scan_min_faces=1)
    index.add(ids[:5000], subjects[:5000], vectors[:5000])
    index.search(queries[:1], 3)  # the int8 copy exists from here on
    index.add(ids[5000:], subjects[5000:], vectors[5000:])  # grows past the capacity
    removed = set(rng.choice(len(ids), 2000, replace=False).tolist())
    index.remove([ids[i] for i in removed])
    replaced = rng.choice([i for i in range(len(ids)) if i not in removed], 500, replace=False)
    new_vectors = vectors.copy()
    new_vectors[replaced] = unit(rng.standard_normal((len(replaced), 64)))
    index.add([ids[i] for i in replaced], [subjects[i] for i in replaced], new_vectors[replaced])
    keep = [i for i in range(len(ids)) if i not in removed]
    assert len(index) == len(keep)
    assert_same_as_brute_force(index, new_vectors[keep], [subjects[i] for i in keep], queries, 5)


def test_wide_vectors_stay_on_float32():
    """At 512 numbers the int8 product is slower than float32 here (bench/gallery_scan.py)."""
    index = VectorIndex(512, int8_scan_min_faces=1)
    v = unit(np.random.default_rng(0).standard_normal((50, 512)))
    index.add([f"f{i}" for i in range(50)], [f"s{i}" for i in range(50)], v)
    assert index.search(v[:1], 1)[0][0].face_id == "f0"
    assert index._int8 is None


def test_fewer_subjects_than_k_returns_them_all():
    index = VectorIndex(8, int8_scan_min_faces=1)
    v = unit(np.eye(8, dtype=np.float32)[:3] + 0.1)
    index.add(["a", "b", "c"], ["x", "x", "y"], v)
    hits = index.search(v[:1], 5)[0]
    assert [h.subject_id for h in hits] == ["x", "y"]


def test_committed_graph_is_what_the_script_writes():
    pytest.importorskip("onnx")
    from service.gallery.make_int8_scores_onnx import build_model_bytes

    assert int8_scan.SCORES_MODEL.read_bytes() == build_model_bytes()
