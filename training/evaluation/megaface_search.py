"""MegaFace's chunked search: every probe against up to millions of distractors, in bounded memory.

The distractors stream past in chunks of bounded size (``chunk_mb``) through a matrix product; for
each probe only its ``top_k`` best distractor scores are kept per size, and for verification only
the impostor scores above the threshold of the largest false-accept rate, so memory is bounded by
``probes x chunk + probes x top_k + max FAR x probes x N`` floats whatever the number of distractors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.errors import MegaFaceDataError

#: Distractor counts of MegaFace Challenge 1 (each one used when the set is large enough).
DISTRACTOR_SIZES = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
#: False-accept rates of the verification report (1e-6 is the papers' "MV" column).
VERIFICATION_FARS = (1e-3, 1e-4, 1e-5, 1e-6)
#: Ranks kept per probe (CMC up to this rank; rank-1 and rank-10 are reported).
TOP_K = 100


def distractor_sizes(available: int, requested: Sequence[int] | None = None) -> list[int]:
    """``requested`` (default :data:`DISTRACTOR_SIZES`) up to ``available``, plus ``available``
    itself when it lies beyond the last one (so every distractor is used once)."""
    if requested is not None:
        too_many = [n for n in requested if n > available]
        if too_many:
            raise MegaFaceDataError(f"asked for {too_many[0]} distractors but only {available} are there")
        return sorted(set(int(n) for n in requested))
    sizes = [n for n in DISTRACTOR_SIZES if n <= available]
    if available and (not sizes or available > sizes[-1]):
        sizes.append(available)
    return sizes


@dataclass
class _Variant:
    """The state of one variant (raw or cleaned) of the search while distractors stream past.

    ``top`` and ``pool`` live where ``ops`` computes (numpy on the CPU, torch tensors on a GPU);
    only the snapshots come back as numpy arrays.
    """

    ops: _NumpyOps
    rows: np.ndarray  # probe rows taking part
    top_k: int
    budget: int  # impostor scores to keep: floor(max FAR * rows * largest size) + 1
    top: Any = field(init=False)
    pool: list[Any] = field(default_factory=list)
    pool_size: int = 0
    pool_floor: float = -math.inf
    snapshots: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.top = self.ops.blank_top(len(self.rows), self.top_k)

    def consume(self, scores: Any) -> None:
        self.top = self.ops.merge_top_k(self.top, scores)
        if self.budget <= 0:
            return
        kept = self.ops.above(scores, self.pool_floor)
        if len(kept):
            self.pool.append(kept)
            self.pool_size += len(kept)
        if self.pool_size > 2 * self.budget:
            best = self.ops.largest(self.ops.concat(self.pool), self.budget)
            self.pool, self.pool_size, self.pool_floor = [best], len(best), float(best.min())

    def snapshot(self, size: int) -> None:
        pool = self.ops.concat(self.pool)
        if len(pool) > self.budget:
            pool = self.ops.largest(pool, self.budget)
        self.pool, self.pool_size = [pool], len(pool)
        self.snapshots[size] = (self.ops.numpy(self.top), self.ops.numpy(self.ops.descending(pool)))


class _NumpyOps:
    """The search's arithmetic with numpy (BLAS) on the CPU."""

    def __init__(self, probes: np.ndarray) -> None:
        self.probes = probes

    @contextmanager
    def exact(self) -> Iterator[None]:
        yield

    def scores(self, block: np.ndarray) -> np.ndarray:
        """``probes @ block.T``: ``(P, C)``."""
        return self.probes @ block.T

    def blank_top(self, rows: int, k: int) -> np.ndarray:
        return np.full((rows, k), -np.inf, dtype=np.float32)

    def merge_top_k(self, top: np.ndarray, scores: np.ndarray) -> np.ndarray:
        return merge_top_k(top, scores)

    def above(self, scores: np.ndarray, floor: float) -> np.ndarray:
        """The scores above ``floor``, flattened (a copy)."""
        return scores[scores > floor] if floor > -math.inf else scores.ravel().copy()

    def largest(self, values: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` largest of 1-D ``values``, in no order."""
        return np.partition(values, len(values) - n)[len(values) - n :]

    def concat(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.empty(0, np.float32)

    def descending(self, values: np.ndarray) -> np.ndarray:
        return np.sort(values)[::-1]

    def take_rows(self, scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """A copy of ``scores[rows]`` (all rows when ``rows`` is every row)."""
        return scores[rows] if len(rows) < len(scores) else scores.copy()

    def blank_columns(self, scores: np.ndarray, columns: np.ndarray) -> None:
        scores[:, columns] = -np.inf

    def numpy(self, values: np.ndarray) -> np.ndarray:
        return values


class _TorchOps(_NumpyOps):
    """The same arithmetic in torch on ``device``: scores, top-k and the impostor pool stay there,
    so a GPU search moves each distractor chunk in and only the snapshots out."""

    def __init__(self, probes: np.ndarray, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.probes = torch.from_numpy(probes).to(self.device)

    @contextmanager
    def exact(self) -> Iterator[None]:
        """Full fp32 products (no TF32), whatever the process set, so scores match numpy's."""
        torch = self.torch
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            with torch.no_grad():
                yield
        finally:
            torch.set_float32_matmul_precision(before)

    def scores(self, block: np.ndarray) -> Any:
        return self.probes @ self.torch.from_numpy(block).to(self.device).T

    def blank_top(self, rows: int, k: int) -> Any:
        return self.torch.full((rows, k), -math.inf, dtype=self.torch.float32, device=self.device)

    def merge_top_k(self, top: Any, scores: Any) -> Any:
        return self.torch.topk(self.torch.cat([top, scores], dim=1), top.shape[1], dim=1).values

    def above(self, scores: Any, floor: float) -> Any:
        return scores[scores > floor] if floor > -math.inf else scores.reshape(-1).clone()

    def largest(self, values: Any, n: int) -> Any:
        return self.torch.topk(values, n, sorted=False).values

    def concat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts) if parts else self.torch.empty(0, device=self.device)

    def descending(self, values: Any) -> Any:
        return self.torch.sort(values, descending=True).values

    def take_rows(self, scores: Any, rows: np.ndarray) -> Any:
        if len(rows) < len(scores):
            return scores[self.torch.from_numpy(rows).to(self.device)]
        return scores.clone()

    def blank_columns(self, scores: Any, columns: np.ndarray) -> None:
        scores[:, self.torch.from_numpy(columns).to(self.device)] = -math.inf

    def numpy(self, values: Any) -> np.ndarray:
        return values.cpu().numpy()


def merge_top_k(top: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Each row's ``k`` highest values of ``top`` (row-sorted, descending) and ``scores`` together."""
    rows, k = top.shape
    floor = top[:, -1]
    above = scores > floor[:, None]
    count = int(above.sum())
    if count == 0:
        return top
    if count > 4 * rows * k:
        both = np.concatenate([top, scores], axis=1)
        part = np.partition(both, both.shape[1] - k, axis=1)[:, -k:]
        return -np.sort(-part, axis=1)
    r, c = np.nonzero(above)
    row_of = np.concatenate([np.repeat(np.arange(rows), k), r])
    value = np.concatenate([top.ravel(), scores[r, c]])
    order = np.lexsort((-value, row_of))
    row_sorted = row_of[order]
    position = np.arange(len(order)) - np.searchsorted(row_sorted, row_sorted)
    keep = position < k
    out = np.empty_like(top)
    out[row_sorted[keep], position[keep]] = value[order][keep]
    return out


@dataclass
class SearchResult:
    """Per size: each probe's ``top_k`` distractor scores (descending) and the impostor scores
    kept for verification (descending), for every variant."""

    sizes: list[int]
    variants: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]
    rows: dict[str, np.ndarray]
    seconds: float
    device: str


def search_distractors(
    probes: np.ndarray,
    distractors: np.ndarray,
    order: np.ndarray,
    sizes: Sequence[int],
    *,
    removed_probes: np.ndarray | None = None,
    removed_distractors: np.ndarray | None = None,
    top_k: int = TOP_K,
    max_far: float = max(VERIFICATION_FARS),
    chunk_mb: float = 256.0,
    device: str = "cpu",
    progress: bool = True,
) -> SearchResult:
    """Stream ``distractors[order[:max(sizes)]]`` in chunks against every probe.

    ``probes`` ``(P, D)`` and ``distractors`` ``(M, D)`` are L2-normalised (``distractors`` may be a
    memmap). With removal masks a ``cleaned`` variant is computed next to ``raw``.
    """
    started = time.perf_counter()
    probes = np.ascontiguousarray(probes, dtype=np.float32)
    n_probes = len(probes)
    largest = max(sizes) if sizes else 0
    cleaned = removed_probes is not None or removed_distractors is not None
    all_rows = np.arange(n_probes)
    ops = _make_ops(probes, device)
    variants = {"raw": _Variant(ops, all_rows, top_k, math.floor(max_far * n_probes * largest) + 1)}
    if cleaned:
        kept = all_rows if removed_probes is None else np.flatnonzero(~removed_probes)
        variants["cleaned"] = _Variant(ops, kept, top_k, math.floor(max_far * len(kept) * largest) + 1)
    for size in sizes:
        if size == 0:
            for v in variants.values():
                v.snapshot(0)
    chunk = max(256, int(chunk_mb * 2**20 / (4 * max(n_probes, 1) * (2 if cleaned else 1))))
    stops = sorted({0, *[s for s in sizes if s > 0]})
    bounds = sorted({*range(0, largest, chunk), *stops, largest})
    bar = None
    if progress and largest:
        from tqdm import tqdm

        bar = tqdm(total=largest, desc="search distractors", unit="img", unit_scale=True, dynamic_ncols=True)
    try:
        with ops.exact():
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                idx = np.sort(order[a:b])
                block = np.ascontiguousarray(distractors[idx], dtype=np.float32)
                scores = ops.scores(block)
                variants["raw"].consume(scores)
                if cleaned:
                    v = variants["cleaned"]
                    part = ops.take_rows(scores, v.rows)
                    if removed_distractors is not None:
                        ops.blank_columns(part, removed_distractors[idx])
                    v.consume(part)
                if b in stops:
                    for v in variants.values():
                        v.snapshot(b)
                if bar is not None:
                    bar.update(b - a)
    finally:
        if bar is not None:
            bar.close()
    return SearchResult(
        sizes=list(sizes),
        variants={name: v.snapshots for name, v in variants.items()},
        rows={name: v.rows for name, v in variants.items()},
        seconds=time.perf_counter() - started,
        device=device,
    )


def _make_ops(probes: np.ndarray, device: str) -> _NumpyOps:
    """numpy on the CPU (``cpu``), else torch on ``device`` (``torch-cpu``: torch on the CPU, for tests)."""
    if device == "cpu":
        return _NumpyOps(probes)
    try:
        import torch
    except ImportError as exc:
        raise MegaFaceDataError(f"--device {device} needs torch (pip install -e '.[train]')") from exc
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MegaFaceDataError(f"--device {device}: torch sees no CUDA device")
    return _TorchOps(probes, "cpu" if device == "torch-cpu" else device)


# --------------------------------------------------------------------------------------------
# The distractor pool: several feature arrays searched as one
# --------------------------------------------------------------------------------------------


class _Stacked:
    """Row-wise concatenation of 2-D arrays (memmaps stay on disk) that fancy-indexes like one."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((len(idx), self.parts[0].shape[1]), dtype=np.float32)
        for w in np.unique(which):
            sel = which == w
            out[sel] = self.parts[w][idx[sel] - self.starts[w]]
        return out


def load_feature_file(path: str | Path, dim: int) -> np.ndarray:
    """A ``.npy`` of ``(n, dim)`` float32 distractor features, L2-normalised (memory-mapped)."""
    path = Path(path)
    if not path.is_file():
        raise MegaFaceDataError(f"feature file {path} does not exist")
    array = np.load(path, mmap_mode="r")
    if array.ndim != 2 or array.shape[1] != dim or array.dtype != np.float32:
        raise MegaFaceDataError(
            f"{path} holds {array.dtype} {array.shape}; expected float32 (n, {dim}) features of this model"
        )
    norms = np.linalg.norm(array[: min(len(array), 1000)], axis=1)
    if len(norms) and not np.allclose(norms, 1.0, atol=1e-3):
        raise MegaFaceDataError(
            f"{path}: features must be L2-normalised (row norms {norms.min():.3f}..{norms.max():.3f})"
        )
    return array
