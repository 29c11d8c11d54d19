"""Seeded synthetic galleries for the search benchmarks (bench/service.py, bench/gallery_scan.py):
random unit vectors in subjects of 1 to 5 faces, queries with and without a planted subject, and
the brute-force top-k subjects they are checked against."""

from __future__ import annotations

import numpy as np

RANDOM_QUERIES = 50
NOISY_QUERIES = 50
NOISE = 0.6  # noisy query = unit(stored + NOISE * random unit): cosine about 0.86 to its source


def synthetic_gallery(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` seeded random unit vectors; subjects of 1 to 5 consecutive faces.

    Returns vectors ``(n, dim)`` float32, subject code per face ``(n,)``, first row per subject.
    """
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 6, size=n)
    ends = np.cumsum(counts)
    m = int(np.searchsorted(ends, n) + 1)
    starts = np.concatenate([[0], ends[: m - 1]]).astype(np.int64)
    codes = np.repeat(np.arange(m, dtype=np.int32), np.diff(np.append(starts, n)))
    vectors = np.empty((n, dim), dtype=np.float32)
    step = 1 << 17
    for s in range(0, n, step):
        block = rng.standard_normal((min(n, s + step) - s, dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        vectors[s : s + len(block)] = block
    return vectors, codes, starts


def make_queries(
    vectors: np.ndarray,
    codes: np.ndarray,
    seed: int,
    random: int = RANDOM_QUERIES,
    noisy: int = NOISY_QUERIES,
) -> tuple[np.ndarray, np.ndarray]:
    """``random`` random unit queries, then ``noisy`` noisy copies of stored vectors; the planted
    subject of each (-1: none)."""
    rng = np.random.default_rng(seed + 1)

    def unit(x: np.ndarray) -> np.ndarray:
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    rand = unit(rng.standard_normal((random, vectors.shape[1])))
    rows = rng.choice(len(vectors), noisy, replace=False)
    copies = unit(vectors[rows] + NOISE * unit(rng.standard_normal((noisy, vectors.shape[1]))))
    planted = np.concatenate([np.full(random, -1), codes[rows]])
    return np.ascontiguousarray(np.concatenate([rand, copies])), planted


def exact_top_subjects(
    vectors: np.ndarray, starts: np.ndarray, queries: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: per query the k best subjects (max over their faces) and their scores."""
    n = len(vectors)
    scores = np.empty((n, len(queries)), dtype=np.float32)
    step = 1 << 17
    for s in range(0, n, step):
        scores[s : s + step] = vectors[s : s + step] @ queries.T
    per_subject = np.maximum.reduceat(scores, starts, axis=0)  # (subjects, queries)
    del scores
    top = np.argpartition(-per_subject, k - 1, axis=0)[:k].T  # (queries, k)
    top_scores = np.take_along_axis(per_subject.T, top, axis=1)
    order = np.argsort(-top_scores, axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1), np.take_along_axis(top_scores, order, axis=1)
