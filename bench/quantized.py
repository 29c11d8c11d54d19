"""The int8 copy of a model (``sphereface quantize``) against the float model: speed and agreement.

Both embedders run the same real aligned crops (the largest face of the phone photos and of
celeba_faces photos, as the service aligns them) in ONNX Runtime with ``--threads`` threads, at
batch 1 and 32, in 5 interleaved rounds (float, int8, int8, float, ...): median ms per batch with
the range of the round medians and the ratio float / int8. Agreement: the cosine between the two
models' fused embeddings of each crop.

    .venv/bin/python bench/quantized.py --int8 .cache/models/dlib_resnet_v1_int8 \\
        --json docs/results/bench_quantized.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.embedder import Embedder  # noqa: E402
from models.quantize import calibration_crops  # noqa: E402
from models.registry import resolve_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--int8", type=Path, required=True)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    float_dir = resolve_model(args.model)
    photos = sorted((args.data / "photos" / "people").glob("*/*.jpg"))
    photos += sorted((args.data / "lfw" / "images").rglob("*.jpg"))[::200]
    crops = calibration_crops(float_dir, photos, 64)
    models = {
        "float": Embedder(float_dir, intra_op_threads=args.threads),
        "int8": Embedder(args.int8, intra_op_threads=args.threads),
    }
    cosines = np.sum(models["float"].embed(crops) * models["int8"].embed(crops), axis=1)
    report = {
        "command": "python bench/quantized.py " + " ".join(sys.argv[1:]),
        "float": str(float_dir),
        "int8": str(args.int8),
        "crops": len(crops),
        "threads": args.threads,
        "cosine_float_int8": {"min": float(cosines.min()), "median": float(np.median(cosines))},
        "batches": {},
    }
    for batch in (1, 32):
        parts = [crops[i : i + batch] for i in range(0, len(crops) - batch + 1, batch)][
            : 32 if batch == 1 else 2
        ]
        for embedder in models.values():
            embedder.raw(parts[0])  # warm up
        per_round: dict[str, list[float]] = {name: [] for name in models}
        for r in range(args.rounds):
            for name in models if r % 2 == 0 else reversed(models):
                times = []
                for part in parts:
                    started = time.perf_counter()
                    models[name].raw(part)
                    times.append(time.perf_counter() - started)
                per_round[name].append(float(np.median(times)) * 1e3)
        ratios = [f / i for f, i in zip(per_round["float"], per_round["int8"], strict=True)]
        report["batches"][str(batch)] = {
            name: {"median_ms": float(np.median(v)), "min_ms": min(v), "max_ms": max(v)}
            for name, v in per_round.items()
        } | {
            "ratio_float_over_int8": {
                "median": float(np.median(ratios)),
                "min": min(ratios),
                "max": max(ratios),
            }
        }
        b = report["batches"][str(batch)]
        print(
            f"batch {batch}: float {b['float']['median_ms']:.1f} ms, int8 {b['int8']['median_ms']:.1f} ms, "
            f"ratio {b['ratio_float_over_int8']['median']:.2f}x "
            f"({b['ratio_float_over_int8']['min']:.2f}-{b['ratio_float_over_int8']['max']:.2f})"
        )
    print(
        f"cosine float/int8 over {len(crops)} crops: min {cosines.min():.4f}, median {np.median(cosines):.4f}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
