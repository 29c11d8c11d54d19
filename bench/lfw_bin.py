"""LFW's 6,000 View-2 pairs as an insightface ``.bin`` set, against ``sphereface evaluate lfw``.

Builds the ``.bin`` (every image aligned onto the ArcFace 112x112 template with the same landmarks
``evaluate lfw`` uses, JPEG quality 95 as insightface's aligned faces were written), then evaluates
each model both ways and compares the accuracies and every pair's cosine:

    python bench/lfw_bin.py --data ../shared/data/lfw --model default --model sphereface_celeba \\
        --json docs/results/lfw_bin.json

is what ``make bench-lfw-bin`` runs; the equivalent commands are
``sphereface evaluate bin .cache/bench/lfw_file.bin --model M`` and
``sphereface evaluate lfw --model M --data ../shared/data/lfw --landmarks file``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

# bench/ holds a models.py of its own: the repository's packages come first.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

from bench.machine import cpu_model  # noqa: E402
from training.evaluation.bin_eval import embed_bin, score_pairs  # noqa: E402
from training.evaluation.bin_sets import lfw_bin, read_bin, write_bin  # noqa: E402
from training.evaluation.lfw import run_lfw_evaluation  # noqa: E402
from training.evaluation.lfw_files import pair_features, read_pairs  # noqa: E402
from training.evaluation.report import write_json  # noqa: E402
from training.evaluation.verification import unit_rows  # noqa: E402


def build(data: Path, out: Path, landmarks: str, pairs_per_fold: int | None) -> dict[str, Any]:
    started = time.perf_counter()
    verification_set = lfw_bin(data, pairs_per_fold, landmarks=landmarks, progress=True)
    write_bin(out, verification_set.images, verification_set.is_same, protocol=2)
    return {
        "path": str(out),
        "pairs": len(verification_set),
        "images": len(verification_set.images),
        "mean_jpeg_bytes": float(np.mean([len(i) for i in verification_set.images])),
        "file_mb": out.stat().st_size / 1e6,
        "landmarks": landmarks,
        "seconds": time.perf_counter() - started,
    }


def compare(model: str, data: Path, bin_path: Path, landmarks: str, pairs_per_fold: int | None) -> dict:
    """One model: ``evaluate bin`` and ``evaluate lfw`` on the same pairs, and their differences."""
    from models.align import get_template
    from models.arcface_crop import padding_share
    from models.embedder import Embedder
    from models.registry import resolve_model

    model_dir = resolve_model(model)
    started = time.perf_counter()
    embedder = Embedder(model_dir)
    verification_set = read_bin(bin_path)
    features = embed_bin(embedder, verification_set, progress=True)
    scores = score_pairs(features.fused, features.summed, verification_set.is_same)
    bin_seconds = time.perf_counter() - started
    lfw = run_lfw_evaluation(model_dir, data, landmarks, pairs_per_fold=pairs_per_fold)
    pairs = read_pairs(data / "pairs.txt")
    pairs = pairs if pairs_per_fold is None else pairs.subset(pairs_per_fold)
    left, right = pair_features(lfw.features, lfw.names, pairs)
    lfw_cosine = np.sum(unit_rows(left.astype(np.float64)) * unit_rows(right.astype(np.float64)), axis=1)
    fused = unit_rows(features.fused.astype(np.float64))
    bin_cosine = np.sum(fused[0::2] * fused[1::2], axis=1)
    gap = np.abs(bin_cosine - lfw_cosine)
    return {
        "model": model,
        "model_id": embedder.manifest.model_id,
        "template": embedder.manifest.template,
        "padding_share": padding_share(get_template(embedder.manifest.template)),
        "bin": {
            **scores.to_dict(),
            "seconds": bin_seconds,
            "images_per_s": len(verification_set.images) / bin_seconds,
        },
        "lfw": {
            "accuracy": lfw.accuracy,
            "std": lfw.std,
            "cosine_accuracy": lfw.cosine.accuracy,
            "cosine_std": lfw.cosine.std,
            "roc_cosine": lfw.roc.to_dict(),
            "seconds": lfw.timing["total"],
            "images_per_s": lfw.timing["images_per_s"],
        },
        "difference_points": {
            "cosine_protocol": 100 * (scores.cosine.accuracy - lfw.cosine.accuracy),
            "sphereface_protocol": 100 * (scores.sphereface.accuracy - lfw.accuracy),
            "insightface_vs_lfw_official": 100 * (scores.insightface.accuracy - lfw.accuracy),
        },
        "pair_cosine_gap": {
            "mean": float(gap.mean()),
            "median": float(np.median(gap)),
            "p99": float(np.quantile(gap, 0.99)),
            "max": float(gap.max()),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/lfw"))
    parser.add_argument("--model", action="append", default=None, help="repeatable; default: default")
    parser.add_argument("--landmarks", choices=("file", "detect"), default="file")
    parser.add_argument("--pairs-per-fold", type=int, default=None, help="a subset (default: all 600)")
    parser.add_argument("--bin", type=Path, default=None, help="where the .bin goes (.cache/bench/...)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    bin_path = args.bin or Path(".cache/bench") / f"lfw_{args.landmarks}.bin"
    report: dict[str, Any] = {
        "what": "LFW View 2 as an insightface .bin (ArcFace 112x112, JPEG q95) vs sphereface evaluate lfw",
        "command": "make bench-lfw-bin",
        "cpu": cpu_model(),
        "build": build(args.data, bin_path, args.landmarks, args.pairs_per_fold),
        "models": [],
    }
    for model in args.model or ["default"]:
        report["models"].append(compare(model, args.data, bin_path, args.landmarks, args.pairs_per_fold))
        entry = report["models"][-1]
        print(
            f"{entry['model_id']}: .bin cosine {100 * entry['bin']['cosine_protocol']['accuracy']:.2f}% vs "
            f"evaluate lfw cosine {100 * entry['lfw']['cosine_accuracy']:.2f}%; .bin SphereFace protocol "
            f"{100 * entry['bin']['sphereface_protocol']['accuracy']:.2f}% vs "
            f"{100 * entry['lfw']['accuracy']:.2f}%; insightface scoring "
            f"{100 * entry['bin']['insightface_protocol']['accuracy']:.2f}%; pair cosine gap mean "
            f"{entry['pair_cosine_gap']['mean']:.4f}"
        )
        if args.json:
            write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
