"""How the MTCNN detector uses its threads: which way detects the phone photos fastest.

Three ways detect the same real photos (``photos/``, decoded once; by default at full size, as
``make bench`` has them, then at the service's ``max_image_side`` 1024) with a full scan:
one thread; two ONNX Runtime threads for each stage, one stage at a time
(``side_by_side=False``); and two threads with the pyramid levels made and scanned side by side
and R-Net/O-Net running on crops while more are cut (the default). Each is timed one photo at a
time (``/v1/embed``, ``/v1/identify`` with policy ``all``) and two photos side by side on two
Python threads. Rounds are interleaved (the order of the ways rotates each round); each figure is
the median ms per photo (one photo) or per pair (side by side) over the rounds, with the range of
the round values. The ways must find the same faces and landmarks; the run stops if they do not.

    .venv/bin/python bench/detector_threads.py --rounds 7 --json docs/results/bench_detector_threads.json
"""

from __future__ import annotations

import argparse
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

WAYS = {
    "1 thread": {"intra_op_threads": 1},
    "2 threads, one stage at a time": {"intra_op_threads": 2, "side_by_side": False},
    "2 threads, side by side (default)": {"intra_op_threads": 2},
}


def detectors(max_side: int | None) -> dict[str, MTCNNDetector]:
    return {name: MTCNNDetector(max_image_side=max_side, **kwargs) for name, kwargs in WAYS.items()}


def check_same_faces(variants: dict[str, MTCNNDetector], images: list[np.ndarray]) -> None:
    """Raise if any way finds other boxes or landmarks than the first on any photo."""
    first, *others = variants.values()
    for index, image in enumerate(images):
        expected = first.detect(image)
        for name, det in zip(list(variants)[1:], others, strict=True):
            found = det.detect(image)
            same = len(found) == len(expected) and all(
                np.array_equal(f.box, g.box) and np.array_equal(f.landmarks, g.landmarks)
                for f, g in zip(found, expected, strict=True)
            )
            if not same:
                raise SystemExit(f"{name} found other faces than {list(variants)[0]} on photo {index}")


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


def measure(images: list[np.ndarray], max_side: int | None, rounds: int) -> dict:
    """Every way at one ``max_image_side``: checked for the same faces, then timed in rounds."""
    variants = detectors(max_side)
    check_same_faces(variants, images)
    for det in variants.values():  # warm-up
        for image in images[:3]:
            det.detect(image)
    one: dict[str, list[float]] = {k: [] for k in variants}
    side: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    with ThreadPoolExecutor(2) as pool:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                a, b = time_round(variants[name], images, pool)
                one[name].append(a)
                side[name].append(b)
            print(f"max side {max_side}: round {r + 1}/{rounds} done", file=sys.stderr)
    return {
        "max_side": max_side,
        "same_faces": True,
        "loadavg_end": list(os.getloadavg()),
        "one_photo": {k: summary(v) for k, v in one.items()},
        "two_photos_side_by_side": {k: summary(v) for k, v in side.items()},
    }


def render(result: dict) -> list[str]:
    side = result["max_side"] or "none (full photos)"
    out = [f"max_image_side {side}", ""]
    out += ["| threads | one photo, ms per photo | two side by side, ms per pair |", "|---|---|---|"]
    for name in result["one_photo"]:
        o, s = result["one_photo"][name], result["two_photos_side_by_side"][name]
        out.append(
            f"| {name} | {o['median_ms']:.1f} ({o['min_ms']:.1f}-{o['max_ms']:.1f}) "
            f"| {s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f}) |"
        )
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--max-side", type=int, nargs="+", default=[0, 1024], help="max_image_side values (0: the full photo)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    paths = sorted((args.data / "photos").rglob("*.jpg"))
    if len(paths) < 2:
        p.error(f"no photos under {args.data / 'photos'} (../shared/data is needed)")
    images = [decode_image(path.read_bytes(), max_pixels=50_000_000) for path in paths]
    report = {
        "command": "python bench/detector_threads.py " + " ".join(sys.argv[1:]),
        "photos": len(images),
        "rounds": args.rounds,
        "loadavg_start": list(os.getloadavg()),
        "results": [measure(images, side or None, args.rounds) for side in args.max_side],
    }
    for result in report["results"]:
        print("\n".join(render(result)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
