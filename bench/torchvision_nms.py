"""Time recorded ``batched_nms`` calls in the real torchvision (its C++ CPU kernel).

facenet-pytorch's MTCNN calls ``torchvision.ops.batched_nms``. torchvision cannot be installed
beside the project's torch, so the face-path and service benchmarks run facenet-pytorch with a
pure-torch stand-in (``bench/torchvision_standin.py``), record the stand-in's calls (boxes, scores,
categories, threshold and the indices it kept) and hand them to this script, which runs in a
separate environment that has torchvision (``make torchvision-env``: torch 2.14.1 and
torchvision 0.29.1 from the machine's disk, in ``.cache/bench/torchvision-venv``). The baseline's
time with torchvision's own NMS is then its measured time, less the stand-in's NMS time, plus the
time this script measures for the same calls.

It also checks that torchvision keeps the same boxes as the stand-in, call by call (the stand-in's
kept indices are part of the recording).

Usage (the benchmarks call it)::

    .cache/bench/torchvision-venv/bin/python bench/torchvision_nms.py CALLS.npz --threads 2 --json OUT.json

``CALLS.npz`` holds, for call ``k``: ``boxes_k`` (n, 4) float32, ``scores_k`` (n,), ``idxs_k``
(n,), ``iou_threshold_k`` (), ``kept_k`` (m,) int64; and ``calls`` (), their number.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: The environment ``make torchvision-env`` builds (torch 2.14.1 + torchvision 0.29.1).
DEFAULT_PYTHON = REPO / ".cache" / "bench" / "torchvision-venv" / "bin" / "python"


def time_calls(calls: list[dict], repeats: int, threads: int) -> dict:
    """Median seconds of each call over ``repeats`` runs (after one warm-up run), and agreement."""
    import torch
    import torchvision
    from torchvision.ops import batched_nms

    torch.set_num_threads(threads)
    seconds, same = [], 0
    for call in calls:
        boxes = torch.from_numpy(call["boxes"])
        scores = torch.from_numpy(call["scores"])
        idxs = torch.from_numpy(call["idxs"]).to(torch.int64)
        kept = batched_nms(boxes, scores, idxs, call["iou_threshold"])  # warm-up, and the answer
        same += int(np.array_equal(kept.numpy(), call["kept"]))
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            batched_nms(boxes, scores, idxs, call["iou_threshold"])
            runs.append(time.perf_counter() - start)
        seconds.append(float(np.median(runs)))
    return {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "threads": threads,
        "repeats": repeats,
        "calls": len(calls),
        "seconds": seconds,
        "same_kept_as_standin": same,
    }


def load_calls(path: Path) -> list[dict]:
    with np.load(path) as data:
        n = int(data["calls"])
        return [
            {
                "boxes": data[f"boxes_{k}"],
                "scores": data[f"scores_{k}"],
                "idxs": data[f"idxs_{k}"],
                "iou_threshold": float(data[f"iou_threshold_{k}"]),
                "kept": data[f"kept_{k}"],
            }
            for k in range(n)
        ]


def save_calls(path: Path, calls: list[dict]) -> None:
    """Write recorded stand-in calls in the layout :func:`load_calls` reads."""
    arrays: dict[str, np.ndarray] = {"calls": np.array(len(calls))}
    for k, call in enumerate(calls):
        for key in ("boxes", "scores", "idxs", "kept"):
            arrays[f"{key}_{k}"] = np.asarray(call[key])
        arrays[f"iou_threshold_{k}"] = np.array(call["iou_threshold"])
    np.savez(path, **arrays)


def record_per_item(standin: Any, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[list[dict]]:
    """Run ``fn`` on every item with the stand-in recording; the recorded calls of each item."""
    standin.RECORD = []
    groups = []
    try:
        for item in items:
            start = len(standin.RECORD)
            fn(item)
            groups.append(standin.RECORD[start:])
    finally:
        standin.RECORD = None
    return groups


def real_nms_per_item(
    groups: list[list[dict]], threads: int, python: Path = DEFAULT_PYTHON, repeats: int = 5
) -> dict[str, Any] | None:
    """Seconds the real torchvision takes for each item's recorded calls (None: no environment)."""
    if not Path(python).is_file():
        return None
    calls = [call for group in groups for call in group]
    with tempfile.TemporaryDirectory(prefix="sf-tv-nms-") as tmp:
        save_calls(Path(tmp) / "calls.npz", calls)
        out = Path(tmp) / "out.json"
        command = [str(python), __file__, str(Path(tmp) / "calls.npz"), "--threads", str(threads)]
        subprocess.run([*command, "--repeats", str(repeats), "--json", str(out)], check=True)
        result = json.loads(out.read_text())
    seconds = iter(result.pop("seconds"))
    per_item = [float(sum(next(seconds) for _ in group)) for group in groups]
    return {**result, "per_item_seconds": per_item, "mean_ms_per_item": 1e3 * float(np.mean(per_item))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calls", type=Path, help="recorded calls (.npz)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per call (default 5)")
    p.add_argument("--json", type=Path, required=True, help="write the timings here")
    args = p.parse_args(argv)
    result = time_calls(load_calls(args.calls), args.repeats, args.threads)
    args.json.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
