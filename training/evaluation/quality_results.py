"""The face quality score on LFW, in one command: fit, error-versus-reject curves, enrollment
floor, degraded faces, several photos per person; writes ``quality.json`` and ``quality_edc.png``.

    python -m training.evaluation.quality_results --model default --lfw ../shared/data/lfw

The first run measures every LFW photo and 4,594 degraded copies with the face path (about 10
minutes on 2 CPU cores, cached under ``$SPHEREFACE_CACHE/quality``); later runs take about a minute.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from models.manifest import load_manifest
from models.registry import resolve_model
from training.evaluation.quality_aggregation import aggregation_study
from training.evaluation.quality_fit import (
    REJECT_GRID,
    Pairs,
    curves_of,
    final_model,
    genuine_pairs,
    heldout_scores,
    person_folds,
    prepared_features,
)
from training.evaluation.quality_lfw import VARIANTS, lfw_quality_records
from training.evaluation.report import new_axes, save_figure, write_json

FLOORS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def floor_table(
    quality: np.ndarray, records: dict[str, np.ndarray], pairs: Pairs, threshold: float
) -> list[dict]:
    """Per floor: the share of faces under it (originals, and each kind of degraded copy), and the
    false non-match rate of the genuine pairs of original photos with both faces above it."""
    clean = pairs.take(~pairs.degraded)
    rows = []
    for floor in FLOORS:
        below = quality < floor
        row: dict[str, Any] = {"floor": floor}
        for v, name in enumerate(VARIANTS):
            row[f"refused_{name}"] = round(float(below[records["variant"] == v].mean()), 4)
        kept = ~below[clean.a] & ~below[clean.b]
        miss = (clean.score < threshold) * clean.weight
        row["fnmr_kept_originals"] = round(float(miss[kept].sum() / clean.weight[kept].sum()), 5)
        row["fnmr_refused_originals"] = (
            round(float(miss[~kept].sum() / clean.weight[~kept].sum()), 5) if (~kept).any() else None
        )
        rows.append(row)
    return rows


RELIABILITY_BINS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0001)


def reliability_table(quality: np.ndarray, pairs: Pairs, threshold: float) -> list[dict]:
    """Is the score a probability? Per bin of a degraded copy's held-out quality: its faces, its
    genuine pairs with originals and the (weighted) share of them that match at ``threshold``."""
    copies = pairs.take(pairs.degraded)
    q, match = quality[copies.a], copies.score >= threshold
    rows = []
    for low, high in zip(RELIABILITY_BINS[:-1], RELIABILITY_BINS[1:], strict=True):
        sel = (q >= low) & (q < high)
        share = float(np.average(match[sel], weights=copies.weight[sel])) if sel.any() else None
        rows.append(
            {"from": low, "to": min(high, 1.0), "faces": int(len(np.unique(copies.a[sel]))),
             "pairs": int(sel.sum()), "match": None if share is None else round(share, 4)}
        )  # fmt: skip
    return rows


def degraded_ordering(quality: np.ndarray, records: dict[str, np.ndarray]) -> dict[str, list[dict]]:
    """Median held-out quality of the degraded copies by strength (the original photo's median
    quality first), per kind of degradation."""
    variant, param = records["variant"], np.abs(records["param"])
    out = {"original": [{"median_quality": round(float(np.median(quality[variant == 0])), 4)}]}
    edges = {1: (2, 3, 4, 5, 6), 2: (1, 2, 3, 4), 3: (20, 35, 50, 70)}
    for v, bounds in edges.items():
        rows = []
        for low, high in zip(bounds[:-1], bounds[1:], strict=True):
            sel = (variant == v) & (param >= low) & (param < high)
            rows.append(
                {"from": low, "to": high, "faces": int(sel.sum()),
                 "median_quality": round(float(np.median(quality[sel])), 4) if sel.any() else None}
            )  # fmt: skip
        out[VARIANTS[v]] = rows
    return out


def quality_cost(records: dict[str, np.ndarray], faces: int = 500, runs: int = 7) -> dict[str, Any]:
    """Microseconds per face of :func:`models.quality.face_quality` on ``faces`` LFW records
    (their crops as RGB, 150x150 for the default model), min/median/max over ``runs``."""
    from models.quality import face_quality

    crops = np.repeat(records["gray"][:faces, :, :, None], 3, axis=3)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        for i in range(len(crops)):
            face_quality(
                records["score"][i], records["box"][i], records["landmarks"][i], crops[i], records["raw"][i]
            )
        times.append((time.perf_counter() - started) / len(crops) * 1e6)
    return {
        "faces": int(len(crops)),
        "runs": runs,
        "us_per_face": [round(f(times), 1) for f in (min, np.median, max)],
    }


def run(
    model: str, lfw_dir: str | Path, *, seed: int = 0, workers: int = 2, progress: bool = True
) -> dict[str, Any]:
    """Everything ``quality.json`` holds (see the module docstring)."""
    started = time.perf_counter()
    model_dir = resolve_model(model)
    manifest = load_manifest(model_dir)
    threshold = manifest.thresholds["far_1e-03"].value
    records = lfw_quality_records(model_dir, lfw_dir, seed=seed, workers=workers, progress=progress)
    x, norm_scale = prepared_features(records)
    pairs = genuine_pairs(records)
    reference = np.median(x[records["variant"] == 0], axis=0)
    scores = heldout_scores(x, pairs, person_folds(records, seed), threshold, reference)
    quality = sigmoid(scores["combined"])
    fitted = final_model(x, pairs, threshold, records["variant"], manifest.model_id, norm_scale)
    return {
        "model_id": manifest.model_id,
        "threshold": {"value": threshold, "far": 1e-3},
        "faces": {name: int((records["variant"] == v).sum()) for v, name in enumerate(VARIANTS)},
        "genuine_pairs": {
            "originals": int((~pairs.degraded).sum()),
            "with_a_copy": int(pairs.degraded.sum()),
        },
        "seed": seed,
        "reject_grid": REJECT_GRID.tolist(),
        "curves": curves_of(scores, pairs, threshold),
        "floors": floor_table(quality, records, pairs, threshold),
        "degraded": degraded_ordering(quality, records),
        "reliability": reliability_table(quality, pairs, threshold),
        "aggregation": aggregation_study(records, quality),
        "model": asdict(fitted),
        "cost": quality_cost(records),
        "seconds": round(time.perf_counter() - started, 1),
    }


def plot_curves(result: dict[str, Any], path: str | Path) -> Path:
    """Error versus reject: FNMR at FMR 1e-3 against the share of pairs rejected, per score."""
    fig, ax = new_axes((9.0, 3.6), dpi=80)
    fig.delaxes(ax)
    grid = np.asarray(result["reject_grid"]) * 100
    for n, (part, curves) in enumerate(result["curves"].items()):
        axis = fig.add_subplot(1, 2, n + 1)
        for label, values in curves.items():
            style = {"lw": 2.2, "color": "black"} if label == "combined" else {"lw": 1.2}
            axis.plot(grid, np.asarray(values) * 100, label=label, **style)
        axis.set_title(f"LFW, {part}", fontsize=10)
        axis.set_xlabel("pairs rejected by the worse face's quality (%)")
        axis.set_ylabel("FNMR at FMR 1e-3 (%)")
        axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model name or folder")
    ap.add_argument("--lfw", default="../shared/data/lfw", help="LFW folder (images/, pairs.txt)")
    ap.add_argument("--out", default="docs/results", help="folder for quality.json and quality_edc.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    result = run(args.model, args.lfw, seed=args.seed, workers=args.workers)
    write_json(Path(args.out) / "quality.json", result)
    plot_curves(result, Path(args.out) / "quality_edc.png")
    print(json.dumps({"model": result["model"], "floors": result["floors"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
