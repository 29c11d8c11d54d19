"""ONNX Runtime threads per MTCNN stage: which setting detects the phone photos fastest.

Every combination of P-Net threads and R-Net/O-Net threads (1 or 2 each) detects the same real
photos (``photos/``, decoded once, the service's ``max_image_side`` 1024) in two ways: one photo
at a time (``/v1/embed``, ``/v1/identify``) and two photos side by side on two Python threads
(``/v1/verify``). Rounds are interleaved (the order of the variants rotates each round); each
figure is the median ms per photo (one photo) or per pair (side by side) over the rounds, with
the range of the round values.

    .venv/bin/python bench/detector_threads.py --json docs/results/bench_detector_threads.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.image import decode_image  # noqa: E402
from models.mtcnn import MTCNNDetector  # noqa: E402

THREAD_CHOICES = (1, 2)


def detectors(max_side: int) -> dict[str, MTCNNDetector]:
    """One detector per (P-Net threads, R-Net and O-Net threads), sharing P-Net sessions."""
    pnets = {t: MTCNNDetector(intra_op_threads=t, max_image_side=max_side).pnet for t in THREAD_CHOICES}
    out = {}
    for p, r in itertools.product(THREAD_CHOICES, THREAD_CHOICES):
        det = MTCNNDetector(intra_op_threads=r, max_image_side=max_side)
        det.pnet = pnets[p]
        out[f"pnet {p} / rnet+onet {r}"] = det
    return out


def time_round(det: MTCNNDetector, images: list[np.ndarray], pool: ThreadPoolExecutor) -> tuple[float, float]:
    """(ms per photo one at a time, ms per pair of photos detected side by side)."""
    t0 = time.perf_counter()
    for image in images:
        det.detect(image)
    one = (time.perf_counter() - t0) / len(images) * 1e3
    pairs = list(zip(images[0::2], images[1::2], strict=False))
    t0 = time.perf_counter()
    for a, b in pairs:
        list(pool.map(det.detect, (a, b)))
    return one, (time.perf_counter() - t0) / len(pairs) * 1e3


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": float(np.median(values)), "min_ms": min(values), "max_ms": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-side", type=int, default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    paths = sorted((args.data / "photos").rglob("*.jpg"))
    if len(paths) < 2:
        p.error(f"no photos under {args.data / 'photos'} (../shared/data is needed)")
    images = [decode_image(path.read_bytes()) for path in paths]
    variants = detectors(args.max_side)
    pool = ThreadPoolExecutor(2)
    for det in variants.values():  # warm-up
        for image in images[:3]:
            det.detect(image)
    one: dict[str, list[float]] = {k: [] for k in variants}
    side: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            a, b = time_round(variants[name], images, pool)
            one[name].append(a)
            side[name].append(b)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    report = {
        "command": "python bench/detector_threads.py " + " ".join(sys.argv[1:]),
        "photos": len(images),
        "max_side": args.max_side,
        "rounds": args.rounds,
        "loadavg": list(os.getloadavg()),
        "one_photo": {k: summary(v) for k, v in one.items()},
        "two_photos_side_by_side": {k: summary(v) for k, v in side.items()},
    }
    print("| P-Net / R-Net+O-Net threads | one photo, ms per photo | two side by side, ms per pair |")
    print("|---|---|---|")
    for name in names:
        o, s = report["one_photo"][name], report["two_photos_side_by_side"][name]
        print(
            f"| {name} | {o['median_ms']:.1f} ({o['min_ms']:.1f}-{o['max_ms']:.1f}) "
            f"| {s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
