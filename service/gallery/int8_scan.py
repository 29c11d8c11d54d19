"""Exact top-k over millions of faces: an int8 scan that bounds every score, then an exact re-rank.

Scoring every stored vector in float32 reads ``4 * dim`` bytes per face: 5 GB per query at 10M
faces of 128 numbers, too slow on two cores. This module keeps a second, int8 copy of the vectors
(a quarter of the bytes) and scores the query against it with ONNX Runtime's ``MatMulInteger``
(u8 x s8 kernels, VNNI where the CPU has it). Every int8 score comes with a guaranteed error bound,
so the faces that could still be among the best are known exactly; only those are re-scored in
float32. The result is the brute-force top-k, not an approximation (tests/test_int8_scan.py
checks it against brute force).

The bound. A stored unit vector ``x`` is ``step * c + e`` with integer codes ``c`` in
``[-127, 127]`` (one global ``step``) and a residual ``e`` with ``||e|| <= R`` (the largest
residual norm stored, kept as faces are added). The query ``q`` is ``a * d + f`` with int8 codes
``d``, its own scale ``a`` and residual ``f``. Then

    q . x = a step (d . c) + a (d . e) + f . x,   |a (d . e) + f . x| <= a ||d|| R + ||f|| ||x||

so ``q . x`` lies within ``eps`` of ``a step (d . c)``, ``eps = a ||d|| R + ||f|| X`` (``X`` the
largest stored norm, 1 for unit vectors) plus a float rounding allowance. With max aggregation
over a subject's faces, let ``T`` be the k-th largest *lower* bound among distinct subjects: the k
best subjects all score at least ``T``, so each one's best face has an upper bound of at least
``T``. Re-scoring exactly every face whose upper bound reaches ``T`` therefore finds the k best
subjects and their exact scores (a subject outside them can only be under-estimated).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

#: The ONNX graph: MatMulInteger(codes u8 [N, D], zero point 128, query s8 [D, Q]) -> int32 [N, Q].
SCORES_MODEL = Path(__file__).with_name("int8_scores.onnx")
#: Stored codes are ``c + ZERO_POINT`` as uint8 (the u8 x s8 kernels are ONNX Runtime's fastest).
ZERO_POINT = 128
#: Components beyond ``CLIP_SIGMAS`` standard deviations of a random unit vector are clipped (the
#: clipped part goes into the residual, so the bound stays exact; it is only looser for such rows).
CLIP_SIGMAS = 6.0
#: Rows scored per ONNX Runtime call (bounds the int32 scratch to 4 MB per query).
BLOCK_ROWS = 1 << 20
#: Relative float32 rounding allowance added to every bound.
ROUNDING = 1e-5


def code_step(dim: int) -> float:
    """The global quantisation step for ``dim``-dimensional unit vectors."""
    return CLIP_SIGMAS / math.sqrt(dim) / 127.0


def quantize_rows(vectors: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes ``c + 128``, float32 residual norms ``||x - step c||``) of float32 rows."""
    vectors = np.asarray(vectors, dtype=np.float32)
    codes = np.clip(np.rint(vectors / step), -127, 127)
    residual = np.linalg.norm(vectors - codes * np.float32(step), axis=1).astype(np.float32)
    return (codes + ZERO_POINT).astype(np.uint8), residual


def quantize_query(query: np.ndarray) -> tuple[np.ndarray, float, float, float]:
    """(int8 codes ``d``, scale ``a``, ``||d||``, residual norm ``||q - a d||``) of one query."""
    query = np.asarray(query, dtype=np.float64).ravel()
    peak = float(np.abs(query).max())
    scale = peak / 127.0 if peak > 0 else 1.0
    codes = np.clip(np.rint(query / scale), -127, 127)
    return (
        codes.astype(np.int8),
        scale,
        float(np.linalg.norm(codes)),
        float(np.linalg.norm(query - scale * codes)),
    )


@lru_cache(maxsize=4)
def _session(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(SCORES_MODEL), options, providers=["CPUExecutionProvider"])


def int_scores(codes: np.ndarray, query_codes: np.ndarray, threads: int = 0) -> np.ndarray:
    """``(codes - 128) . d`` for every row, int32 ``(N,)``, in blocks of :data:`BLOCK_ROWS`."""
    session = _session(threads)
    column = np.ascontiguousarray(query_codes.reshape(-1, 1))
    out = np.empty(len(codes), dtype=np.int32)
    for start in range(0, len(codes), BLOCK_ROWS):
        block = codes[start : start + BLOCK_ROWS]
        out[start : start + len(block)] = session.run(None, {"codes": block, "query": column})[0][:, 0]
    return out


def kth_subject_value(values: np.ndarray, subject_codes: np.ndarray, k: int) -> float:
    """The k-th largest of the per-subject maxima of ``values`` (``-inf`` with fewer subjects)."""
    if len(values) == 0:
        return -math.inf
    order = np.argsort(-values, kind="stable")
    _, first = np.unique(subject_codes[order], return_index=True)
    if len(first) < k:
        return -math.inf
    return float(values[order[np.sort(first)[k - 1]]])


class Int8Scan:
    """The int8 copy of a float32 matrix's rows and the bound of every int8 score.

    ``codes`` and ``residuals`` grow with the matrix (:meth:`set_rows`, :meth:`move_row`); the
    largest residual and row norm only ever grow, which keeps the bound valid after removals.
    """

    def __init__(self, dim: int, capacity: int = 0) -> None:
        self.dim = dim
        self.step = code_step(dim)
        self.codes = np.full((capacity, dim), ZERO_POINT, dtype=np.uint8)
        self.max_residual = 0.0
        self.max_norm = 0.0

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes

    @classmethod
    def over(cls, codes: np.ndarray, max_residual: float, max_norm: float) -> Int8Scan:
        """The scan of codes written before (a snapshot's, mapped read-only) and their bound."""
        scan = cls(codes.shape[1])
        scan.codes, scan.max_residual, scan.max_norm = codes, max_residual, max_norm
        return scan

    def reserve(self, capacity: int, used: int) -> None:
        if capacity > len(self.codes):
            codes = np.full((capacity, self.dim), ZERO_POINT, dtype=np.uint8)
            codes[:used] = self.codes[:used]
            self.codes = codes

    def set_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Quantise ``vectors`` into the rows ``rows``; the bound widens to cover them."""
        for a in range(0, len(vectors), BLOCK_ROWS):
            part = np.asarray(vectors[a : a + BLOCK_ROWS], dtype=np.float32)
            codes, residual = quantize_rows(part, self.step)
            self.codes[rows[a : a + BLOCK_ROWS]] = codes
            if len(part):
                self.max_residual = max(self.max_residual, float(residual.max()))
                self.max_norm = max(self.max_norm, float(np.linalg.norm(part, axis=1).max()))

    def move_row(self, source: int, target: int) -> None:
        self.codes[target] = self.codes[source]

    def candidates(
        self,
        query: np.ndarray,
        n: int,
        subject_codes: np.ndarray,
        k: int,
        threads: int = 0,
        excluded: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows (of the first ``n``, less ``excluded``) that can hold the best face of one of the
        top-k subjects."""
        d, scale, d_norm, residual = quantize_query(query)
        q_norm = float(np.linalg.norm(query))
        to_score = scale * self.step
        eps = (
            scale * d_norm * self.max_residual
            + residual * self.max_norm
            + ROUNDING * (q_norm * self.max_norm + 1.0)
        )
        scores = int_scores(self.codes[:n], d, threads)
        if excluded is not None:
            scores[excluded] = np.iinfo(np.int32).min  # below every bound: never a candidate
        # A safe first threshold from the first block: its k-th best subject lower bound can only
        # be below the whole gallery's. It cuts the gallery to a few thousand rows in one pass.
        head = min(n, BLOCK_ROWS)
        take = min(head, max(64 * k, 1024))
        top = np.argpartition(-scores[:head], take - 1)[:take] if take < head else np.arange(head)
        threshold = kth_subject_value(scores[top] * to_score - eps, subject_codes[top], k)
        if threshold == -math.inf:
            return _without(np.arange(n), excluded)
        rows = np.flatnonzero(scores >= math.floor((threshold - eps) / to_score))
        # The same argument on the survivors gives the final threshold.
        approx = scores[rows] * to_score
        threshold = kth_subject_value(approx - eps, subject_codes[rows], k)
        return _without(rows[approx + eps >= threshold], excluded)


def _without(rows: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
    """``rows`` less the excluded ones (with fewer live subjects than k, excluded rows can pass
    the threshold: their bound is low, not minus infinity)."""
    return rows if excluded is None else rows[~np.isin(rows, excluded)]
