"""Face-path benchmark on CPU: our ONNX Runtime detector and embedder against PyTorch references.

(a) Detection: our MTCNN on ONNX Runtime (``models.mtcnn``) against facenet-pytorch 2.6.0's own
    MTCNN code (PyTorch eager) with the same weights and settings (min face 20 px, thresholds
    0.6/0.7/0.9, factor 0.709, all faces kept), on LFW images (192x192) and on the large phone
    photos of ``../shared/data/photos``: mean ms per image, speed ratio, faces found by each, and
    how far apart the landmarks of faces both found are (matched by box IoU > 0.5).
(b) Embedding: our ONNX embedder (``models.embedder.Embedder``) against PyTorch eager for the same
    MobileFaceNet (``models.nets.mobilefacenet`` with the reference checkpoint, eval mode,
    ``torch.inference_mode``) on aligned LFW crops at batch 1 and 32.

Contenders run interleaved in the same process (A, B, A, B, ..., with the order rotated for
every image or batch) so that load from other work on the machine hits all of them alike, and
with the same number of threads (``torch.set_num_threads`` / ORT ``intra_op_num_threads``); ours
is also tried with 1 and 2 ORT threads.

facenet-pytorch pins an old torch, so it is never installed: its wheel (``make install`` puts it
in ``.cache/wheels``) is unpacked into a throwaway folder under ``.cache/bench`` together with a
pure-torch stand-in for the two torchvision functions it imports (``bench/torchvision_standin.py``),
and that folder goes on ``sys.path`` of this process only. Only ``facenet_pytorch.models.mtcnn``
is imported (the package's ``__init__`` also pulls in InceptionResnetV1, which needs ``requests``).

Usage::

    .venv/bin/python bench/face_path.py --model .cache/models/mobilefacenet_casia --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from bench.baselines import ensure_model  # noqa: E402
from bench.face_path_detector import bench_detector  # noqa: E402
from bench.face_path_embedder import bench_embedder  # noqa: E402
from bench.face_path_report import json_default, render, worst_speedup  # noqa: E402
from bench.face_path_settings import (  # noqa: E402
    DEFAULT_MODEL,
    EMBED_BATCHES,
    FACTOR,
    GOAL_DETECT_SPEEDUP,
    GOAL_EMBED_SPEEDUP,
    GOAL_LANDMARK_PX,
    MATCH_IOU,
    MIN_FACE,
    THRESHOLDS,
)
from bench.facenet_env import (  # noqa: E402
    DEFAULT_ENV,
    DEFAULT_WHEEL,
    TORCHVISION_PYTHON,
    load_facenet,
    prepare_facenet_env,
)
from bench.paths import SHARED_DATA  # noqa: E402
from bench.timing import log  # noqa: E402
from models.align import align_faces  # noqa: E402
from models.image import read_image  # noqa: E402

# --------------------------------------------------------------------------------------------
# Data


def lfw_sample(data: Path, count: int) -> list[tuple[str, np.ndarray]]:
    """``count`` LFW images spread evenly over landmarks.txt's list, with reference landmarks."""
    rows = []
    for line in (data / "lfw" / "landmarks.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) == 11:
            rows.append((parts[0], np.array([float(v) for v in parts[1:]]).reshape(5, 2)))
    if not rows:
        raise SystemExit(f"no landmarks in {data / 'lfw' / 'landmarks.txt'}")
    count = max(1, min(count, len(rows)))
    picks = np.unique(np.linspace(0, len(rows) - 1, count).round().astype(int))
    return [rows[i] for i in picks]


def photo_paths(data: Path) -> list[Path]:
    root = data / "photos"
    paths = sorted((root / "people").glob("*/*.jpg")) + sorted(p for p in (root / "scenes").iterdir())
    return [p for p in paths if p.is_file()]


# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="model folder (model.onnx + manifest.json); imported from --checkpoint when missing "
        f"(default: {DEFAULT_MODEL.relative_to(REPO)})",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="MobileFaceNet checkpoint for the PyTorch eager side "
        "(default: DATA/reference_models/mobilefacenet_casia/068.ckpt)",
    )
    p.add_argument(
        "--data", type=Path, default=SHARED_DATA, help=f"shared data folder (default: {SHARED_DATA})"
    )
    p.add_argument("--lfw-images", type=int, default=300, help="LFW images to use (default: 300)")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved timed passes over every image / batch; each gives one ratio, reported as "
        "median (min-max) (default: 5)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch.set_num_threads and ORT intra_op_num_threads (default: CPU count)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=300.0,
        help="seconds per measurement after which no further pass is started; the first pass always "
        "completes (default: 300)",
    )
    p.add_argument(
        "--max-photos", type=int, default=0, help="use only the first N phone photos (default: 0 = all)"
    )
    p.add_argument("--fnp-wheel", type=Path, default=DEFAULT_WHEEL, help="facenet-pytorch wheel")
    p.add_argument("--fnp-env", type=Path, default=DEFAULT_ENV, help="throwaway folder for facenet-pytorch")
    p.add_argument(
        "--torchvision-python",
        type=Path,
        default=TORCHVISION_PYTHON,
        help="Python of an environment with the real torchvision, to time facenet-pytorch's NMS calls "
        "in its C++ kernel (default: the one `make torchvision-env` builds; without it only the NMS "
        "bounds are reported)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every number to this JSON file")
    args = p.parse_args(argv)
    if args.lfw_images < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--lfw-images, --repeats and --threads must be at least 1")
    if args.checkpoint is None:
        args.checkpoint = args.data / "reference_models" / "mobilefacenet_casia" / "068.ckpt"
    return args


def check_inputs(args: argparse.Namespace) -> None:
    """Stop with a message naming the first input the benchmark needs that is missing."""
    for needed in (
        args.data / "lfw" / "landmarks.txt",
        args.data / "lfw" / "images",
        args.data / "photos",
        args.checkpoint,
    ):
        if not needed.exists():
            raise SystemExit(f"missing: {needed} (see ../shared/data/README.md)")


def facenet_mtcnn(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Any]:
    """facenet-pytorch's MTCNN with the shared detector settings, every face kept, on the CPU:
    ``(its environment, the MTCNN, the torchvision stand-in module)``."""
    fnp_env = prepare_facenet_env(args.fnp_wheel, args.fnp_env)
    MTCNN, standin = load_facenet(args.fnp_env)
    fnp = MTCNN(
        min_face_size=MIN_FACE,
        thresholds=list(THRESHOLDS),
        factor=FACTOR,
        keep_all=True,
        select_largest=False,
        device=torch.device("cpu"),
    )
    fnp.eval()
    return fnp_env, fnp, standin


def image_sets(args: argparse.Namespace) -> tuple[list[tuple[str, np.ndarray]], list[Path], dict[str, Any]]:
    """The LFW sample (with its reference landmarks) and the phone photos, as the detector's sets:
    ``(lfw sample, photo paths, {set name: images, names, reference landmarks}``)."""
    lfw = lfw_sample(args.data, args.lfw_images)
    lfw_images = [read_image(args.data / "lfw" / "images" / rel) for rel, _ in lfw]
    photos = photo_paths(args.data)
    if args.max_photos > 0:
        photos = photos[: args.max_photos]
    sets = {
        "lfw": {
            "images": lfw_images,
            "names": [rel for rel, _ in lfw],
            "reference": [ref for _, ref in lfw],
        },
        "photos": {
            "images": [read_image(p) for p in photos],
            "names": [str(p.relative_to(args.data / "photos")) for p in photos],
        },
    }
    return lfw, photos, sets


def lfw_crops(lfw_images: list[np.ndarray], lfw: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """The LFW images aligned by their reference landmarks, repeated up to the largest batch."""
    crops = np.concatenate(
        [align_faces(img, ref[None]) for img, (_, ref) in zip(lfw_images, lfw, strict=True)]
    )
    if len(crops) < max(EMBED_BATCHES):
        crops = np.concatenate([crops] * (max(EMBED_BATCHES) // len(crops) + 1))
    return crops


def run_config(args: argparse.Namespace, variants: list[int], counts: dict[str, int], imported: bool) -> dict:
    """The report's ``config``: threads, passes, image counts, detector settings, goals."""
    return {
        "threads": args.threads,
        "thread_variants": variants,
        "repeats": args.repeats,
        "time_budget_s": args.time_budget,
        "lfw_images": counts["lfw_images"],
        "photos": counts["photos"],
        "detector_settings": {
            "min_face_size": MIN_FACE,
            "thresholds": list(THRESHOLDS),
            "factor": FACTOR,
            "keep_all": True,
            "device": "cpu",
        },
        "match_iou": MATCH_IOU,
        "model_imported_now": imported,
        "goals": {
            "detector_speedup": GOAL_DETECT_SPEEDUP,
            "landmark_mean_px": GOAL_LANDMARK_PX,
            "embedder_speedup": GOAL_EMBED_SPEEDUP,
        },
    }


def run_env(fnp_env: dict[str, Any], loadavg_start: tuple[float, ...], started: float) -> dict[str, Any]:
    """The report's ``env``: versions, threads, machine load at start and now, wall time (s)."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_parallel_info": torch.__config__.parallel_info(),
        "onnxruntime": ort.__version__,
        "facenet_pytorch": fnp_env,
        "loadavg_start": list(loadavg_start),
        "loadavg_end": list(os.getloadavg()),
        "wall_s": time.time() - started,
    }


def goals_met(detector: dict[str, Any], embedder: dict[str, Any]) -> dict[str, bool]:
    """Per set and per batch: is the goal met (a speed goal by every ratio, see worst_speedup)?"""
    goals = {}
    for k, v in detector["sets"].items():
        sp = v["speed"]
        goals[f"detector_speedup_{k}"] = worst_speedup(sp) >= GOAL_DETECT_SPEEDUP
        goals[f"landmarks_{k}"] = (
            v["agreement"].get("landmarks", {}).get("mean_px", np.inf) <= GOAL_LANDMARK_PX
        )
    for k, v in embedder["batches"].items():
        sp = v["speed"]
        goals[f"embedder_speedup_b{k}"] = worst_speedup(sp) >= GOAL_EMBED_SPEEDUP
    return goals


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    check_inputs(args)
    threads = args.threads
    variants = sorted({1, 2, threads})
    torch.set_num_threads(threads)
    loadavg_start = os.getloadavg()
    started = time.time()

    fnp_env, fnp, standin = facenet_mtcnn(args)
    imported = ensure_model(args.model, args.checkpoint)

    log("loading images")
    lfw, photos, sets = image_sets(args)
    detector = bench_detector(
        sets, threads, variants, args.repeats, fnp, standin, args.time_budget, args.torchvision_python
    )

    lfw_images = sets["lfw"]["images"]
    crops = lfw_crops(lfw_images, lfw)
    embedder = bench_embedder(
        args.model, args.checkpoint, crops, threads, variants, args.repeats, args.time_budget
    )

    counts = {"lfw_images": len(lfw_images), "photos": len(photos)}
    report = {
        "config": run_config(args, variants, counts, imported),
        "env": run_env(fnp_env, loadavg_start, started),
        "detector": detector,
        "embedder": embedder,
    }
    report["goals_met"] = goals_met(detector, embedder)
    print(render(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=json_default) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
