"""Interleaved timing of contenders, and the statistics the benchmarks report from it."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Contender:
    """One timed implementation: ``fn(item)``; ``torch_threads`` is set before every torch call."""

    fn: Callable[[Any], Any]
    torch_threads: int | None = None

    def prepare(self) -> None:
        if self.torch_threads is not None and torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)


def _rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return list(names[shift:]) + list(names[:shift])


def run_interleaved(
    contenders: dict[str, Contender],
    items: Sequence[Any],
    repeats: int,
    warmup: int,
    label: str,
    budget_s: float = float("inf"),
) -> tuple[dict[str, np.ndarray], dict[str, list[Any]]]:
    """Time every contender on every item, ``repeats`` times, interleaved.

    For each repeat and item the contenders run one after the other, in an order rotated by one
    for every item, so that a burst of load from elsewhere falls on all of them alike. Thread
    settings are applied outside the timed region. The first pass always runs to the end; a
    further pass only starts when it is expected to finish within ``budget_s`` seconds of the
    start (every contender always sees the same items the same number of times).

    Returns seconds ``{name: (passes, len(items))}`` and the outputs of the first pass.
    """
    names = list(contenders)
    threads_before = torch.get_num_threads()
    for k, item in enumerate(items[:warmup]):
        for name in _rotated(names, k):
            contenders[name].prepare()
            contenders[name].fn(item)
    seconds = {name: np.zeros((repeats, len(items))) for name in names}
    outputs: dict[str, list[Any]] = {name: [None] * len(items) for name in names}
    gc.collect()
    gc.disable()
    began = time.perf_counter()
    passes = 0
    try:
        for r in range(repeats):
            elapsed = time.perf_counter() - began
            if r > 0 and elapsed * (r + 1) / r > budget_s:
                log(f"  {label}: stopping after {r} of {repeats} passes (time budget {budget_s:.0f} s)")
                break
            start = time.perf_counter()
            for k, item in enumerate(items):
                for name in _rotated(names, r + k):
                    contender = contenders[name]
                    contender.prepare()
                    t0 = time.perf_counter()
                    out = contender.fn(item)
                    seconds[name][r, k] = time.perf_counter() - t0
                    if r == 0:
                        outputs[name][k] = out
            passes = r + 1
            log(f"  {label}: pass {r + 1}/{repeats} done in {time.perf_counter() - start:.1f} s")
    finally:
        gc.enable()
        torch.set_num_threads(threads_before)
    return {name: s[:passes] for name, s in seconds.items()}, outputs


def compare_speed(
    timing: dict[str, dict[str, Any]], key: str, ours: str, theirs: str, threads: int, variants: list[int]
) -> dict[str, Any]:
    """Speed ratios ``theirs / ours`` of a timing statistic: at equal threads and best against best."""
    best_ours = min(variants, key=lambda t: timing[f"{ours}@{t}"][key])
    best_theirs = min(variants, key=lambda t: timing[f"{theirs}@{t}"][key])
    return {
        "threads": threads,
        "speedup_same_threads": timing[f"{theirs}@{threads}"][key] / timing[f"{ours}@{threads}"][key],
        "speedup_each_best": timing[f"{theirs}@{best_theirs}"][key] / timing[f"{ours}@{best_ours}"][key],
        "best_threads_ours": best_ours,
        "best_threads_theirs": best_theirs,
        "per_threads": {str(t): timing[f"{theirs}@{t}"][key] / timing[f"{ours}@{t}"][key] for t in variants},
    }


def pass_ratio_spread(
    theirs: np.ndarray, ours: np.ndarray, stat: Callable[[np.ndarray], float]
) -> dict[str, Any]:
    """The ratio theirs / ours of every interleaved pass (``stat`` of its times): median, min, max.

    One pass times every item once for both sides, so each pass gives one ratio; their spread is
    what a rerun can be expected to reproduce."""
    ratios = [float(stat(t) / stat(o)) for t, o in zip(theirs, ours, strict=True)]
    return {"passes": len(ratios), "median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios)}


def per_item_summary(seconds: np.ndarray) -> dict[str, Any]:
    """Per item the median over repeats; then the mean over items (ms)."""
    med = np.median(seconds, axis=0) * 1e3
    return {
        "passes": int(seconds.shape[0]),
        "mean_ms_per_item": float(med.mean()),
        "median_ms_per_item": float(np.median(med)),
        "total_ms_per_pass": float(med.sum()),
        "pass_mean_ms": [float(x) for x in seconds.mean(axis=1) * 1e3],
        "per_item_median_ms": [float(x) for x in med],
    }


def per_call_summary(seconds: np.ndarray, batch: int) -> dict[str, Any]:
    """Median (and spread) over every timed call (ms), and images/s at the median."""
    flat = seconds.reshape(-1) * 1e3
    median = float(np.median(flat))
    return {
        "median_ms_per_batch": median,
        "p10_ms": float(np.percentile(flat, 10)),
        "p90_ms": float(np.percentile(flat, 90)),
        "calls": int(flat.size),
        "passes": int(seconds.shape[0]),
        "images_per_s": batch / median * 1e3,
        "pass_median_ms": [float(np.median(row) * 1e3) for row in seconds],
    }


def latency_summary(seconds: np.ndarray) -> dict[str, Any]:
    """Median, p90, mean (ms) over every timed call of a ``(passes, items)`` array."""
    flat = np.asarray(seconds, dtype=np.float64).reshape(-1) * 1e3
    return {
        "median_ms": float(np.median(flat)),
        "p90_ms": float(np.percentile(flat, 90)),
        "mean_ms": float(flat.mean()),
        "min_ms": float(flat.min()),
        "max_ms": float(flat.max()),
        "calls": int(flat.size),
        "passes": int(np.shape(seconds)[0]) if np.ndim(seconds) == 2 else 1,
        "pass_median_ms": [float(np.median(r) * 1e3) for r in np.atleast_2d(seconds)],
    }
