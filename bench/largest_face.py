"""The largest face, coarse to fine against a full scan: speed, agreement, and LFW accuracy.

``MTCNNDetector.detect_largest`` (what policy ``largest``, /v1/verify's default, uses) scans the
pyramid from its smallest level and stops once the faces left to find are smaller than the one it
has; ``detect`` + the largest face scans every level. This script measures, with the service's
detector settings (``max_image_side`` 1024, 2 ONNX Runtime threads):

1. speed on the real photos of ``photos/`` (decoded once): one photo at a time, and two photos
   side by side on two Python threads as /v1/verify runs them; 5 interleaved rounds, each
   figure the median ms per photo (or per pair) with the range of the round values;
2. agreement on those photos: the same face (box IoU) and how far the landmarks move, as a
   fraction of the face's side;
3. with ``--lfw``: the official LFW protocol with the default model, the landmarks of each
   photo's largest face found each way, their error against LFW's reference landmarks, and how
   many of the photos get exactly the same landmarks (about 2.5 minutes per way on 2 cores).

    .venv/bin/python bench/largest_face.py --lfw ../shared/data/lfw \
        --json docs/results/bench_largest_face.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_model  # noqa: E402
from models.image import decode_image  # noqa: E402
from models.mtcnn import MTCNNDetector, select_faces  # noqa: E402

WAYS = ("full", "coarse-to-fine")


def largest(detector: MTCNNDetector, way: str, image: np.ndarray) -> list:
    if way == "coarse-to-fine":
        return detector.detect_largest(image)
    return select_faces(detector.detect(image), "largest", image.shape)


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two inclusive pixel boxes."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]) + 1)
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
    inter = w * h
    area = lambda box: (box[2] - box[0] + 1) * (box[3] - box[1] + 1)  # noqa: E731
    return float(inter / (area(a) + area(b) - inter))


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": float(np.median(values)), "min_ms": float(min(values)), "max_ms": float(max(values))}


def time_rounds(detector: MTCNNDetector, images: list[np.ndarray], rounds: int) -> dict[str, Any]:
    """Interleaved rounds: per way, ms per photo one at a time and per pair side by side."""
    pool = ThreadPoolExecutor(2)
    pairs = list(zip(images[0::2], images[1::2], strict=False))
    one: dict[str, list[float]] = {w: [] for w in WAYS}
    side: dict[str, list[float]] = {w: [] for w in WAYS}
    for way in WAYS:  # warm-up
        for image in images[:3]:
            largest(detector, way, image)
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            t0 = time.perf_counter()
            for image in images:
                largest(detector, way, image)
            one[way].append((time.perf_counter() - t0) / len(images) * 1e3)
            t0 = time.perf_counter()
            for a, b in pairs:
                list(pool.map(lambda img, w=way: largest(detector, w, img), (a, b)))
            side[way].append((time.perf_counter() - t0) / len(pairs) * 1e3)
    pool.shutdown()
    out: dict[str, Any] = {"one_photo": {w: summary(one[w]) for w in WAYS}}
    out["two_photos_side_by_side"] = {w: summary(side[w]) for w in WAYS}
    out["speedup_median"] = {
        kind: out[kind]["full"]["median_ms"] / out[kind]["coarse-to-fine"]["median_ms"]
        for kind in ("one_photo", "two_photos_side_by_side")
    }
    return out


def agreement(detector: MTCNNDetector, names: list[str], images: list[np.ndarray]) -> dict[str, Any]:
    """Per photo: whether both ways find a face, the IoU of their boxes and the landmark shift."""
    rows = []
    for name, image in zip(names, images, strict=True):
        full, fast = largest(detector, "full", image), largest(detector, "coarse-to-fine", image)
        row: dict[str, Any] = {
            "photo": name,
            "size": list(image.shape[:2]),
            "found": [bool(full), bool(fast)],
        }
        if full and fast:
            side = float(np.sqrt(full[0].area))
            shift = float(np.abs(full[0].landmarks - fast[0].landmarks).max())
            row.update(
                face_side_px=side,
                box_iou=box_iou(full[0].box, fast[0].box),
                landmark_shift_px=shift,
                landmark_shift_of_side=shift / side,
            )
        rows.append(row)
    both = [r for r in rows if "box_iou" in r]
    return {
        "photos": len(rows),
        "found_by_both": len(both),
        "found_by_one_only": sum(1 for r in rows if sum(r["found"]) == 1),
        "identical_landmarks": sum(1 for r in both if r["landmark_shift_px"] == 0.0),
        "min_box_iou": min((r["box_iou"] for r in both), default=None),
        "max_landmark_shift_of_side": max((r["landmark_shift_of_side"] for r in both), default=None),
        "per_photo": rows,
    }


class LargestFaceDetector:
    """What ``evaluate_lfw(landmarks="detect")`` calls: ``detect`` returns the one largest face."""

    def __init__(self, detector: MTCNNDetector, way: str) -> None:
        self.detector, self.way = detector, way
        self.provider = detector.provider
        #: the landmarks of each photo's face, by a hash of its pixels (workers run out of order)
        self.points: dict[str, np.ndarray] = {}

    def detect(self, image: np.ndarray) -> list:
        faces = largest(self.detector, self.way, image)
        if faces:
            self.points[hashlib.sha1(image.tobytes()).hexdigest()] = faces[0].landmarks
        return faces

    def landmarks_in_box(self, image, box):
        return self.detector.landmarks_in_box(image, box)


def lfw_runs(lfw: Path, model: str) -> dict[str, Any]:
    """The official protocol with the largest face of each photo, found each way."""
    from models.registry import resolve_model
    from training.evaluation.lfw import run_lfw_evaluation

    out: dict[str, Any] = {"model": model}
    points = {}
    for way in WAYS:
        detector = LargestFaceDetector(MTCNNDetector(intra_op_threads=1), way)
        evaluation = run_lfw_evaluation(resolve_model(model), lfw, landmarks="detect", detector=detector)
        report = evaluation.to_dict()
        out[way] = {
            key: report.get(key)
            for key in (
                "accuracy",
                "std",
                "cosine_protocol",
                "faces_found_share",
                "landmark_error_px",
                "timing_s",
            )
        }
        points[way] = detector.points
    both = sorted(set(points["full"]) & set(points["coarse-to-fine"]))
    shifts = np.array([np.abs(points["full"][k] - points["coarse-to-fine"][k]).max() for k in both])
    out["agreement"] = {
        "photos_with_a_face_both_ways": len(both),
        "photos_with_a_face_one_way_only": len(set(points["full"]) ^ set(points["coarse-to-fine"])),
        "identical_landmarks": int((shifts == 0).sum()),
        "landmark_shift_px": {
            "median": float(np.median(shifts)) if len(shifts) else None,
            "p99": float(np.percentile(shifts, 99)) if len(shifts) else None,
            "max": float(shifts.max()) if len(shifts) else None,
        },
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-side", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lfw", type=Path, help="an LFW folder: also run the official protocol both ways")
    p.add_argument("--model", default="default", help="the model for --lfw")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    paths = sorted((args.data / "photos").rglob("*.jpg"))
    if len(paths) < 2:
        p.error(f"no photos under {args.data / 'photos'} (../shared/data is needed)")
    names = [str(path.relative_to(args.data / "photos")) for path in paths]
    images = [decode_image(path.read_bytes()) for path in paths]
    detector = MTCNNDetector(intra_op_threads=args.threads, max_image_side=args.max_side)
    started = time.time()
    result: dict[str, Any] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "env": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()),
        },
        "photos": len(paths),
        "max_side": args.max_side,
        "threads": args.threads,
        "rounds": args.rounds,
    }
    result["speed"] = time_rounds(detector, images, args.rounds)
    result["agreement"] = agreement(detector, names, images)
    if args.lfw:
        result["lfw"] = lfw_runs(args.lfw, args.model)
    result["env"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.time() - started
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def print_report(result: dict[str, Any]) -> None:
    speed = result["speed"]
    print(f"{result['photos']} photos, {result['rounds']} interleaved rounds, {result['env']['cpu_model']}")
    for kind, label in (
        ("one_photo", "ms per photo"),
        ("two_photos_side_by_side", "ms per pair, side by side"),
    ):
        for way in WAYS:
            s = speed[kind][way]
            print(f"  {label:28s} {way:15s} {s['median_ms']:6.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f})")
        print(f"  {'':28s} {'speed-up':15s} {speed['speedup_median'][kind]:6.2f}x")
    agree = result["agreement"]
    print(
        f"  same face in {agree['found_by_both']} of {agree['photos']} photos "
        f"(min box IoU {agree['min_box_iou']:.3f}); identical landmarks in {agree['identical_landmarks']}; "
        f"largest landmark shift {100 * agree['max_landmark_shift_of_side']:.1f}% of the face's side"
    )
    for way in WAYS if "lfw" in result else ():
        run = result["lfw"][way]
        err = run["landmark_error_px"] or {}
        print(
            f"  LFW {way:15s} {100 * run['accuracy']:.2f}% ± {100 * run['std']:.2f}%, "
            f"landmark error {err.get('mean', float('nan')):.3f} px mean, "
            f"faces found {run['faces_found_share']:.4f}"
        )
    if "lfw" in result:
        agree = result["lfw"]["agreement"]
        shift = agree["landmark_shift_px"]
        print(
            f"  LFW: identical landmarks in {agree['identical_landmarks']} of "
            f"{agree['photos_with_a_face_both_ways']} photos; shift median {shift['median']:.2f} px, "
            f"p99 {shift['p99']:.2f} px, max {shift['max']:.2f} px"
        )


if __name__ == "__main__":
    raise SystemExit(main())
