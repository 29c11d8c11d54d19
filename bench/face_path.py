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
import cProfile
import gc
import hashlib
import importlib.util
import json
import os
import platform
import pstats
import shutil
import sys
import threading
import time
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from models.align import align_faces  # noqa: E402
from models.embedder import Embedder, preprocess  # noqa: E402
from models.image import read_image  # noqa: E402
from models.manifest import MANIFEST_NAME, MODEL_NAME  # noqa: E402
from models.mtcnn import MTCNNDetector, run_mtcnn_net  # noqa: E402
from models.mtcnn_convert import normalise_pixels  # noqa: E402

FNP_VERSION = "2.6.0"
DEFAULT_WHEEL = REPO / ".cache" / "wheels" / f"facenet_pytorch-{FNP_VERSION}-py3-none-any.whl"
DEFAULT_ENV = REPO / ".cache" / "bench" / f"facenet_pytorch-{FNP_VERSION}"
DEFAULT_MODEL = REPO / ".cache" / "models" / "mobilefacenet_casia"
DEFAULT_DATA = Path(os.environ.get("SPHEREFACE_SHARED_DATA", REPO.parent / "shared" / "data"))
STANDIN_SOURCE = Path(__file__).resolve().parent / "torchvision_standin.py"
TORCHVISION_PYTHON = REPO / ".cache" / "bench" / "torchvision-venv" / "bin" / "python"

# Detector settings shared by both implementations.
MIN_FACE = 20
THRESHOLDS = (0.6, 0.7, 0.9)
FACTOR = 0.709

# Goals stated for this benchmark.
GOAL_DETECT_SPEEDUP = 2.0
GOAL_LANDMARK_PX = 1.0
GOAL_EMBED_SPEEDUP = 1.5

MATCH_IOU = 0.5
EMBED_BATCHES = (1, 32)
DETECT_WARMUP = 5
EMBED_WARMUP = 5
EMBED_BATCH1_CROPS = 64

_STANDIN_PACKAGE = {
    "__init__.py": '"""Benchmark-only stand-in for torchvision (see bench/torchvision_standin.py)."""\n'
    "__standin__ = True\n__version__ = '0.0+bench-standin'\n",
    "ops/__init__.py": "from torchvision.ops.boxes import batched_nms, nms\n",
    "ops/boxes.py": "from torchvision._standin import batched_nms, nms\n",
    "transforms/__init__.py": "from torchvision.transforms import functional\n",
    "transforms/functional.py": "from torchvision._standin import to_tensor\n",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# facenet-pytorch in a throwaway folder


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_facenet_env(wheel: Path, env_dir: Path) -> dict[str, Any]:
    """Unpack the facenet-pytorch wheel into ``env_dir`` (once) and (re)write the stand-in."""
    if not wheel.is_file():
        raise SystemExit(
            f"facenet-pytorch wheel not found: {wheel}\n"
            f"run `make install` (it runs `pip download --no-deps facenet-pytorch=={FNP_VERSION}`)"
        )
    sha = _sha256(wheel)
    marker = env_dir / ".wheel-sha256"
    if not (marker.is_file() and marker.read_text().strip() == sha):
        log(f"unpacking {wheel.name} into {env_dir}")
        partial = env_dir.with_name(env_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(partial)
        (partial / ".wheel-sha256").write_text(sha + "\n")
        shutil.rmtree(env_dir, ignore_errors=True)
        partial.rename(env_dir)
    write_standin_package(env_dir)
    return {"wheel": str(wheel), "wheel_sha256": sha, "env_dir": str(env_dir)}


def write_standin_package(root: Path) -> Path:
    """``root/torchvision``: the stand-in as an importable package (files rewritten only when changed)."""
    package = root / "torchvision"
    files = {**_STANDIN_PACKAGE, "_standin.py": STANDIN_SOURCE.read_text()}
    for name, text in files.items():
        target = package / name
        if not (target.is_file() and target.read_text() == text):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return package


def load_facenet(env_dir: Path):
    """Import facenet-pytorch's MTCNN class from ``env_dir``; returns (MTCNN, stand-in module)."""
    if "torchvision" in sys.modules:
        raise RuntimeError("torchvision is already imported; the stand-in cannot be used")
    sys.path.insert(0, str(env_dir))
    import torchvision  # the stand-in written by prepare_facenet_env

    if getattr(torchvision, "__standin__", False) is not True:
        raise RuntimeError(f"expected the benchmark's torchvision stand-in, got {torchvision.__file__}")
    # Register the package without running its __init__ (which imports requests for the
    # InceptionResnetV1 weights download); the MTCNN module only needs torch and torchvision.
    spec = importlib.util.spec_from_loader("facenet_pytorch", loader=None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(env_dir / "facenet_pytorch")]
    sys.modules["facenet_pytorch"] = package
    from facenet_pytorch.models.mtcnn import MTCNN
    from torchvision import _standin

    warnings.filterwarnings("ignore", module=r"facenet_pytorch\..*")
    return MTCNN, _standin


# --------------------------------------------------------------------------------------------
# Detections in one format


@dataclass
class Found:
    """Detections of one image: boxes ``(n, 4)``, scores ``(n,)``, landmarks ``(n, 5, 2)``."""

    boxes: np.ndarray
    scores: np.ndarray
    points: np.ndarray

    def __len__(self) -> int:
        return len(self.boxes)


def found_from_ours(faces) -> Found:
    if not faces:
        return Found(np.zeros((0, 4)), np.zeros(0), np.zeros((0, 5, 2)))
    return Found(
        np.stack([f.box for f in faces]).astype(np.float64),
        np.array([f.score for f in faces], dtype=np.float64),
        np.stack([f.landmarks for f in faces]).astype(np.float64),
    )


def found_from_facenet(result) -> Found:
    boxes, probs, points = result
    if boxes is None or len(boxes) == 0:
        return Found(np.zeros((0, 4)), np.zeros(0), np.zeros((0, 5, 2)))
    return Found(
        np.asarray(boxes, dtype=np.float64).reshape(-1, 4),
        np.asarray(probs, dtype=np.float64).reshape(-1),
        np.asarray(points, dtype=np.float64).reshape(-1, 5, 2),
    )


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix ``(len(a), len(b))`` of ``(x1, y1, x2, y2)`` boxes."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def match_boxes(a: np.ndarray, b: np.ndarray, threshold: float = MATCH_IOU) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching by decreasing IoU; pairs ``(i, j, iou)`` with IoU > threshold."""
    iou = box_iou(a, b)
    pairs = []
    used_a, used_b = set(), set()
    for flat in np.argsort(-iou, axis=None, kind="stable"):
        i, j = np.unravel_index(flat, iou.shape)
        if iou[i, j] <= threshold:
            break
        if i in used_a or j in used_b:
            continue
        used_a.add(i)
        used_b.add(j)
        pairs.append((int(i), int(j), float(iou[i, j])))
    return pairs


# --------------------------------------------------------------------------------------------
# Interleaved timing


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
# (a) detector


def compare_detections(
    ours: list[Found], theirs: list[Found], names: list[str], reference: list[np.ndarray] | None
) -> dict[str, Any]:
    """Faces found by each, matching by IoU, and landmark distances of matched faces."""
    dists, offsets, corner, ious, score_diff, widths = [], [], [], [], [], []
    per_image = []
    only_ours = only_theirs = 0
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        pairs = match_boxes(a.boxes, b.boxes)
        only_ours += len(a) - len(pairs)
        only_theirs += len(b) - len(pairs)
        image_d = []
        for i, j, iou in pairs:
            delta = b.points[j] - a.points[i]  # (5, 2) facenet - ours
            d = np.linalg.norm(delta, axis=1)
            dists.append(d)
            offsets.append(delta)
            corner.append(b.boxes[j] - a.boxes[i])
            ious.append(iou)
            score_diff.append(b.scores[j] - a.scores[i])
            widths.append(a.boxes[i, 2] - a.boxes[i, 0])
            image_d.append(float(d.mean()))
        per_image.append(
            {
                "image": names[k],
                "faces_ours": len(a),
                "faces_facenet": len(b),
                "matched": len(pairs),
                "landmark_px_mean_per_match": image_d,
            }
        )
    out: dict[str, Any] = {
        "faces_ours": int(sum(len(f) for f in ours)),
        "faces_facenet": int(sum(len(f) for f in theirs)),
        "matched": len(dists),
        "only_ours": only_ours,
        "only_facenet": only_theirs,
        "images_with_count_difference": int(sum(len(a) != len(b) for a, b in zip(ours, theirs, strict=True))),
    }
    if dists:
        d = np.stack(dists)  # (m, 5)
        face_mean = d.mean(axis=1)
        off = np.stack(offsets)  # (m, 5, 2)
        out["landmarks"] = {
            "mean_px": float(face_mean.mean()),
            "median_px": float(np.median(face_mean)),
            "p90_px": float(np.percentile(face_mean, 90)),
            "max_px": float(face_mean.max()),
            "share_faces_within_1px": float(np.mean(face_mean <= 1.0)),
            "per_point_mean_px": [float(x) for x in d.mean(axis=0)],
            "mean_offset_facenet_minus_ours_xy": [float(x) for x in off.reshape(-1, 2).mean(axis=0)],
            "mean_px_per_100px_box_width": float(np.mean(100 * face_mean / np.maximum(widths, 1.0))),
        }
        out["boxes"] = {
            "mean_iou": float(np.mean(ious)),
            "mean_corner_offset_facenet_minus_ours": [float(x) for x in np.stack(corner).mean(axis=0)],
            "mean_abs_score_diff": float(np.mean(np.abs(score_diff))),
        }
    if reference is not None:
        out["vs_reference_landmarks"] = {
            "ours": _vs_reference(ours, reference),
            "facenet": _vs_reference(theirs, reference),
        }
    out["per_image"] = per_image
    return out


def _vs_reference(found: list[Found], reference: list[np.ndarray], limit_px: float = 10.0) -> dict[str, Any]:
    """Landmark distance to LFW's landmarks.txt for the detection nearest to it, per image."""
    best = []
    missed = 0
    for f, ref in zip(found, reference, strict=True):
        if len(f) == 0:
            missed += 1
            continue
        d = np.linalg.norm(f.points - ref[None], axis=2).mean(axis=1).min()
        if d > limit_px:
            missed += 1
        else:
            best.append(d)
    return {
        "mean_px": float(np.mean(best)) if best else None,
        "median_px": float(np.median(best)) if best else None,
        "images": len(best),
        "no_face_within_10px": missed,
    }


class _Tally:
    """Seconds and calls added up from any thread, and the threads they came from."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1
            self.threads.add(threading.get_ident())


class _TimedSession:
    """Wraps an ORT session to add up the time spent in ``run`` (for the profile pass); wrappers
    given the same ``tally`` add into one total."""

    def __init__(self, session, tally: _Tally | None = None) -> None:
        self._session = session
        self.tally = tally if tally is not None else _Tally()

    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._session.run(*args, **kwargs)
        finally:
            self.tally.add(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._session, name)


def _top_functions(profile: cProfile.Profile, count: int, per: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        if filename == "~":
            where = func
        else:
            path = Path(filename)
            try:
                path = path.relative_to(REPO)
            except ValueError:
                path = Path(path.name)
            where = f"{path}:{line}({func})"
        rows.append((tottime, where, calls, cumtime))
    rows.sort(reverse=True)
    return [
        {
            "function": w,
            "calls_per_image": c / per,
            "self_ms_per_image": t / per * 1e3,
            "cum_ms_per_image": ct / per * 1e3,
        }
        for t, w, c, ct in rows[:count]
    ]


def profile_ours(images: list[np.ndarray], threads: int) -> dict[str, Any]:
    """One pass of our detector under cProfile, with time inside each ORT session measured.

    With more than one thread the detector runs pyramid levels and network chunks in threads of
    its own, on one-thread copies of the networks: a network's time is then added up over the
    threads (it overlaps the rest, so there is no "outside ORT" remainder), and cProfile sees the
    calling thread only."""
    det = MTCNNDetector(
        "cpu", min_face_size=MIN_FACE, thresholds=THRESHOLDS, scale_factor=FACTOR, intra_op_threads=threads
    )
    for img in images[:DETECT_WARMUP]:
        det.detect(img)
    tallies = {name: _Tally() for name in ("pnet", "rnet", "onet")}
    for name, tally in tallies.items():
        setattr(det, name, _TimedSession(getattr(det, name), tally))
        det._one_thread[name] = _TimedSession(det._one_thread[name], tally)
    t0 = time.perf_counter()
    plain = [det.detect(img) for img in images]
    wall = time.perf_counter() - t0
    del plain
    ort_s = {name: tally.seconds for name, tally in tallies.items()}
    overlapped = any(tally.threads - {threading.get_ident()} for tally in tallies.values())
    prof = cProfile.Profile()
    prof.enable()
    for img in images:
        det.detect(img)
    prof.disable()
    n = len(images)
    ort_total = sum(ort_s.values())
    return {
        "ort_intra_op_threads": threads,
        "ms_per_image_unprofiled": wall / n * 1e3,
        "ort_run_ms_per_image": {k: v / n * 1e3 for k, v in ort_s.items()},
        "ort_overlaps_the_rest": overlapped,
        "outside_ort_ms_per_image": None if overlapped else (wall - ort_total) / n * 1e3,
        "top_functions": _top_functions(prof, 12, n),
    }


def profile_facenet(fnp, images: list[np.ndarray], threads: int) -> dict[str, Any]:
    """One cProfile'd pass of facenet-pytorch (at ``threads`` torch threads) over ``images``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prof = cProfile.Profile()
        prof.enable()
        for img in images:
            fnp.detect(img, landmarks=True)
        prof.disable()
    finally:
        torch.set_num_threads(before)
    return {
        "torch_threads": threads,
        "images": len(images),
        "top_functions": _top_functions(prof, 8, len(images)),
    }


def mtcnn_weight_parity(det: MTCNNDetector, fnp) -> dict[str, float]:
    """Max abs difference of our ONNX nets and facenet-pytorch's torch nets on the same pixels."""
    rng = np.random.default_rng(0)

    def both(session, torch_net, shape):
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        ours = run_mtcnn_net(session, pixels)
        return ours, [t.numpy() for t in torch_net(normalise_pixels(torch.from_numpy(pixels)))]

    def diff(a, b):
        return float(np.abs(a - b).max())

    with torch.inference_mode():
        (prob, reg), (t_reg, t_prob) = both(det.pnet, fnp.pnet, (2, 57, 83, 3))
        pnet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg))
        (prob, reg), (t_reg, t_prob) = both(det.rnet, fnp.rnet, (8, 24, 24, 3))
        rnet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg))
        (prob, reg, marks), (t_reg, t_marks, t_prob) = both(det.onet, fnp.onet, (8, 48, 48, 3))
        onet = max(diff(prob, t_prob[:, 1]), diff(reg, t_reg), diff(marks, t_marks))
    return {"pnet": pnet, "rnet": rnet, "onet": onet}


def _with_torchvision_nms(
    seconds: dict[str, np.ndarray],
    timing: dict[str, Any],
    standin_nms: dict[int, list[float]],
    images: list[np.ndarray],
    fnp,
    standin,
    threads: int,
    variants: list[int],
    tv_python: Path,
) -> dict[str, Any] | None:
    """facenet-pytorch's times with torchvision's own C++ NMS in place of the stand-in's.

    One more pass of facenet-pytorch records every stand-in ``batched_nms`` call; the real
    torchvision times the same calls in its own environment (``bench/torchvision_nms.py``); each
    image's time is then its measured time less the stand-in's NMS time plus torchvision's.
    Adds ``facenet_tvnms@T`` rows to ``timing``; returns the speed ratios against them, or None
    when there is no torchvision environment (``make torchvision-env``)."""
    from bench.torchvision_nms import real_nms_per_item, record_per_item

    if not tv_python.is_file():
        log(f"  no torchvision environment at {tv_python} (make torchvision-env): NMS bounds only")
        return None
    measured = {}
    for t in variants:
        torch.set_num_threads(t)
        groups = record_per_item(standin, lambda img: fnp.detect(img, landmarks=True), images)
        measured[t] = real_nms_per_item(groups, t, tv_python)
    torch.set_num_threads(threads)
    corrected = {}
    for t in variants:
        real = np.asarray(measured[t]["per_item_seconds"])
        stand = np.asarray(standin_nms[t]).reshape(-1, len(images))
        corrected[t] = seconds[f"facenet@{t}"] - stand + real[None, :]
        timing[f"facenet_tvnms@{t}"] = per_item_summary(corrected[t])
        timing[f"facenet@{t}"]["torchvision_nms"] = {
            k: v for k, v in measured[t].items() if k != "per_item_seconds"
        }
    speed = compare_speed(timing, "mean_ms_per_item", "ours", "facenet_tvnms", threads, variants)
    ours = seconds[f"ours@{threads}"]
    speed["same_threads_per_pass"] = pass_ratio_spread(corrected[threads], ours, np.mean)
    first = measured[threads]
    speed["torchvision"] = {k: first[k] for k in ("torch", "torchvision", "calls", "same_kept_as_standin")}
    return speed


def bench_detector(
    sets: dict[str, dict[str, Any]],
    threads: int,
    variants: list[int],
    repeats: int,
    fnp,
    standin,
    budget_s: float,
    tv_python: Path,
) -> dict[str, Any]:
    ours = {
        t: MTCNNDetector(
            "cpu", min_face_size=MIN_FACE, thresholds=THRESHOLDS, scale_factor=FACTOR, intra_op_threads=t
        )
        for t in variants
    }
    parity = mtcnn_weight_parity(ours[threads], fnp)
    results: dict[str, Any] = {"weights_max_abs_diff": parity, "sets": {}}

    class FacenetCall:
        """facenet-pytorch's detect; records the stand-in NMS seconds of every call, in call order."""

        def __init__(self) -> None:
            self.nms_seconds: list[float] = []

        def __call__(self, img):
            before = standin.TIMING["batched_nms_seconds"]
            out = fnp.detect(img, landmarks=True)
            self.nms_seconds.append(standin.TIMING["batched_nms_seconds"] - before)
            return out

    for set_name, spec in sets.items():
        images = spec["images"]
        calls = {t: FacenetCall() for t in variants}
        contenders = {f"ours@{t}": Contender(ours[t].detect) for t in variants}
        contenders.update({f"facenet@{t}": Contender(calls[t], torch_threads=t) for t in variants})
        log(
            f"(a) detector on {set_name}: {len(images)} images x {len(contenders)} contenders, "
            f"{repeats} passes"
        )
        seconds, outputs = run_interleaved(
            contenders, images, repeats, DETECT_WARMUP, f"detect/{set_name}", budget_s
        )
        timing = {name: per_item_summary(s) for name, s in seconds.items()}
        warm = min(DETECT_WARMUP, len(images))
        for t in variants:
            nms = np.asarray(calls[t].nms_seconds[warm:]).reshape(-1, len(images))
            timing[f"facenet@{t}"]["standin_nms"] = per_item_summary(nms)
        speed = compare_speed(timing, "mean_ms_per_item", "ours", "facenet", threads, variants)
        speed["same_threads_per_pass"] = pass_ratio_spread(
            seconds[f"facenet@{threads}"], seconds[f"ours@{threads}"], np.mean
        )
        # The stand-in NMS is pure torch (the real torchvision runs it in C++): the most
        # conservative ratio counts it as free.
        best_ours = timing[f"ours@{speed['best_threads_ours']}"]["mean_ms_per_item"]
        best_fnp = min(
            timing[f"facenet@{t}"]["mean_ms_per_item"]
            - timing[f"facenet@{t}"]["standin_nms"]["mean_ms_per_item"]
            for t in variants
        )
        speed["facenet_standin_nms_ms_per_image"] = {
            str(t): timing[f"facenet@{t}"]["standin_nms"]["mean_ms_per_item"] for t in variants
        }
        speed["speedup_each_best_facenet_nms_free"] = best_fnp / best_ours
        with_torchvision = _with_torchvision_nms(
            seconds, timing, {t: calls[t].nms_seconds[warm:] for t in variants}, images, fnp, standin,
            threads, variants, tv_python,
        )  # fmt: skip
        if with_torchvision is not None:
            speed["with_torchvision_nms"] = with_torchvision
        ours_found = [found_from_ours(o) for o in outputs[f"ours@{threads}"]]
        fnp_found = [found_from_facenet(o) for o in outputs[f"facenet@{threads}"]]
        # Do the thread settings change what is found? (They should not.)
        same_counts = {
            name: int(
                sum(len(o) == len(r) for o, r in zip(outputs[name], outputs[f"ours@{threads}"], strict=True))
            )
            for name in contenders
            if name.startswith("ours@")
        }
        agreement = compare_detections(ours_found, fnp_found, spec["names"], spec.get("reference"))
        shapes = np.array([img.shape[:2] for img in images])
        results["sets"][set_name] = {
            "images": len(images),
            "height_range": [int(shapes[:, 0].min()), int(shapes[:, 0].max())],
            "width_range": [int(shapes[:, 1].min()), int(shapes[:, 1].max())],
            "megapixels_mean": float((shapes[:, 0] * shapes[:, 1]).mean() / 1e6),
            "timing": timing,
            "speed": speed,
            "images_where_ours_at_other_threads_finds_as_many_faces": same_counts,
            "agreement": agreement,
        }
    for set_name, spec in sets.items():
        log(f"(a) profiling on {set_name}")
        entry = results["sets"][set_name]
        entry["profile_ours"] = profile_ours(spec["images"], entry["speed"]["best_threads_ours"])
        entry["profile_facenet"] = profile_facenet(
            fnp, spec["images"][:8], entry["speed"]["best_threads_theirs"]
        )
    return results


# --------------------------------------------------------------------------------------------
# (b) embedder


def ensure_model(model_dir: Path, checkpoint: Path) -> bool:
    """Import the checkpoint into ``model_dir`` when it is not a model folder yet; True if imported."""
    if (model_dir / MANIFEST_NAME).is_file() and (model_dir / MODEL_NAME).is_file():
        return False
    from models.importers import import_mobilefacenet

    log(f"{model_dir} is not a model folder: importing {checkpoint} into it")
    import_mobilefacenet(checkpoint, model_dir)
    return True


def load_torch_net(checkpoint: Path):
    from models.nets.mobilefacenet import load_mobilefacenet

    data = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = data["net_state_dict"] if "net_state_dict" in data else data
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return load_mobilefacenet(state).eval()


def torch_baseline_name(model_dir: Path) -> str:
    """What :func:`load_torch_baseline` runs for this model folder, in words (for reports)."""
    from models.manifest import load_manifest
    from models.nets.dlib_resnet import DLIB_ARCHITECTURE

    if load_manifest(model_dir).architecture == DLIB_ARCHITECTURE:
        return "dlib's ResNet (rebuilt in PyTorch from dlib's own file)"
    return "MobileFaceNet (the reference checkpoint)"


def load_torch_baseline(model_dir: Path, checkpoint: Path):
    """The PyTorch network behind a model folder, for the eager baseline: dlib's ResNet rebuilt
    from dlib's own file (``make install`` caches it) for the dlib model, else MobileFaceNet
    from ``checkpoint``."""
    from models.manifest import load_manifest
    from models.nets.dlib_resnet import DLIB_ARCHITECTURE

    if load_manifest(model_dir).architecture == DLIB_ARCHITECTURE:
        from models.dlib_format import DLIB_RESNET_FILE, parse_dlib_face_resnet
        from models.importers import cached_dlib_file
        from models.nets.dlib_resnet import DlibFaceResNet

        path = cached_dlib_file(DLIB_RESNET_FILE)
        net = DlibFaceResNet.from_dlib(parse_dlib_face_resnet(path.read_bytes(), path.name)).eval()
    else:
        net = load_torch_net(checkpoint)
    require_same_network(net, model_dir, f"MobileFaceNet from {checkpoint}")
    return net


class BaselineMismatchError(ValueError):
    """The PyTorch eager baseline does not compute what the model folder computes."""


def require_same_network(net, model_dir: Path, what: str, min_cosine: float = 0.999) -> None:
    """Refuse a baseline whose raw embedding of random crops differs from the ONNX model's (an
    ensemble, or any model not exported from the checkpoint, would be timed against another
    network)."""
    embedder = Embedder(model_dir, "cpu", intra_op_threads=1)
    manifest = embedder.manifest
    crops = np.random.default_rng(0).integers(
        0, 256, size=(2, manifest.input_height, manifest.input_width, 3), dtype=np.uint8
    )
    ours = embedder.raw(crops)
    with torch.inference_mode():
        eager = net(torch.from_numpy(preprocess(crops, manifest))).numpy()
    if eager.shape != ours.shape:
        raise BaselineMismatchError(
            f"{model_dir} embeds into {ours.shape[1:]} but the eager baseline ({what}) into "
            f"{eager.shape[1:]}: it is not the model's network; benchmark dlib_resnet_v1 or the model "
            "exported from --checkpoint"
        )
    cosine = np.sum(eager * ours, axis=1) / (np.linalg.norm(eager, axis=1) * np.linalg.norm(ours, axis=1))
    if float(cosine.min()) < min_cosine:
        raise BaselineMismatchError(
            f"the eager baseline ({what}) and {model_dir} disagree on random crops (cosine "
            f"{float(cosine.min()):.4f} < {min_cosine}): it is not the model's network; benchmark "
            "dlib_resnet_v1 or the model exported from --checkpoint"
        )


def bench_embedder(
    model_dir: Path,
    checkpoint: Path,
    crops: np.ndarray,
    threads: int,
    variants: list[int],
    repeats: int,
    budget_s: float,
) -> dict[str, Any]:
    ours = {t: Embedder(model_dir, "cpu", intra_op_threads=t) for t in variants}
    manifest = ours[threads].manifest
    net = load_torch_net(checkpoint)

    def torch_raw(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return net(torch.from_numpy(preprocess(batch, manifest))).numpy()

    ref = torch_raw(crops[:32])
    got = ours[threads].raw(crops[:32])
    cos = np.sum(ref * got, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    out: dict[str, Any] = {
        "model_dir": str(model_dir),
        "model_id": manifest.model_id,
        "checkpoint": str(checkpoint),
        "crops": len(crops),
        "input": f"{manifest.input_height}x{manifest.input_width} uint8 RGB, same numpy preprocess for both",
        "parity_max_abs_diff": float(np.abs(ref - got).max()),
        "parity_min_cosine": float(cos.min()),
        "batches": {},
    }
    if out["parity_max_abs_diff"] > 1e-3:
        log(
            f"WARNING: {model_dir} disagrees with {checkpoint} "
            f"(max abs diff {out['parity_max_abs_diff']:.3g})"
        )
    contenders = {f"ours@{t}": Contender(ours[t].raw) for t in variants}
    contenders.update({f"torch@{t}": Contender(torch_raw, torch_threads=t) for t in variants})
    for bs in EMBED_BATCHES:
        # Batch 1 runs on the first EMBED_BATCH1_CROPS crops only: the cost does not depend on
        # the content, and this keeps a pass short.
        use = crops[:EMBED_BATCH1_CROPS] if bs == 1 else crops
        batches = [use[i : i + bs] for i in range(0, len(use) - bs + 1, bs)]
        log(
            f"(b) embedder at batch {bs}: {len(batches)} batches x {len(contenders)} contenders, "
            f"{repeats} passes"
        )
        seconds, _ = run_interleaved(contenders, batches, repeats, EMBED_WARMUP, f"embed/b{bs}", budget_s)
        timing = {name: per_call_summary(s, bs) for name, s in seconds.items()}
        speed = compare_speed(timing, "median_ms_per_batch", "ours", "torch", threads, variants)
        speed["same_threads_per_pass"] = pass_ratio_spread(
            seconds[f"torch@{threads}"], seconds[f"ours@{threads}"], np.median
        )
        out["batches"][str(bs)] = {"timing": timing, "speed": speed}
    return out


# --------------------------------------------------------------------------------------------
# Report


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def worst_speedup(speed: dict[str, Any]) -> float:
    """The ratio a goal reads: with facenet-pytorch's NMS timed in the real torchvision when that
    was measured, the lower of equal threads and best against best; otherwise the most
    conservative of those and the NMS-free bound."""
    tv = speed.get("with_torchvision_nms")
    if tv is not None:
        return min(tv["speedup_same_threads"], tv["speedup_each_best"])
    keys = ("speedup_same_threads", "speedup_each_best", "speedup_each_best_facenet_nms_free")
    return min(speed[k] for k in keys if k in speed)


def _spread(speed: dict[str, Any]) -> str:
    """``median (min-max)`` of the per-pass ratios at equal threads."""
    p = speed.get("same_threads_per_pass")
    return "-" if p is None else f"{p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f})"


def _goal(speed: dict[str, Any], goal: float) -> str:
    """A speed goal is met when every ratio (equal threads, best against best) reaches it."""
    return "met" if worst_speedup(speed) >= goal else "NOT met"


def _short(function: str) -> str:
    """``<method 'resize' of 'ImagingCore' objects>`` -> ``ImagingCore.resize`` and the like."""
    if "onnxruntime" in function and ".run" in function:
        return "ORT session.run"
    if function.startswith("<method '"):
        name, _, owner = function[len("<method '") :].partition("' of '")
        return f"{owner.split(chr(39))[0]}.{name}"
    if function.startswith("<built-in method "):
        return function[len("<built-in method ") :].rstrip(">").rsplit(".", 1)[-1]
    return function


def _speed_line(s: dict[str, Any]) -> str:
    return f"best threads: ours {s['best_threads_ours']}, theirs {s['best_threads_theirs']}; " + ", ".join(
        f"ratio @{t}: {v:.2f}x" for t, v in s["per_threads"].items()
    )


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    env = report["env"]
    t = cfg["threads"]
    variants = cfg["thread_variants"]
    nan = float("nan")
    out = [
        "Face-path benchmark (CPU)",
        f"threads: equal for both sides, {t} (torch.set_num_threads / ORT intra_op_num_threads); "
        f"each side also tried at {', '.join(str(v) for v in variants)} thread(s)",
        f"machine: {env['cpu_count']} logical CPUs, load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env['loadavg_end'][0]:.2f} at end; torch {env['torch']}, onnxruntime {env['onnxruntime']}, "
        f"facenet-pytorch {FNP_VERSION} with a pure-torch torchvision stand-in",
        f"repeats: up to {cfg['repeats']} interleaved passes, {cfg['time_budget_s']:.0f} s budget per "
        "measurement (detector: per-image median over passes, "
        "then the mean over images; embedder: median over all calls); wall time "
        f"{env['wall_s']:.0f} s",
        "",
    ]
    det = report["detector"]
    w = det["weights_max_abs_diff"]
    out.append(
        "(a) MTCNN: ours (ONNX Runtime) vs facenet-pytorch (PyTorch eager), same weights "
        f"(max |diff| of the nets P/R/O: {w['pnet']:.1e}/{w['rnet']:.1e}/{w['onet']:.1e})"
    )
    rows = []
    for name, s in det["sets"].items():
        tm, sp = s["timing"], s["speed"]
        rows.append(
            [name, str(s["images"]), "{}-{} x {}-{}".format(*s["height_range"], *s["width_range"])]
            + [f"{tm[f'ours@{v}']['mean_ms_per_item']:.1f}" for v in variants]
            + [f"{tm[f'facenet@{v}']['mean_ms_per_item']:.1f}" for v in variants]
            + [
                f"{sp['speedup_same_threads']:.2f}x",
                _spread(sp),
                f"{sp['speedup_each_best']:.2f}x",
                f"{sp['speedup_each_best_facenet_nms_free']:.2f}x",
                _goal(sp, GOAL_DETECT_SPEEDUP),
            ]
        )
    out.append(
        table(
            ["set", "imgs", "size HxW"]
            + [f"ours@{v} ms" for v in variants]
            + [f"fnp@{v} ms" for v in variants]
            + [f"ratio@{t}", "per pass", "best/best", "b/b NMS free", f"goal >={GOAL_DETECT_SPEEDUP:g}x"],
            rows,
        )
    )
    out.append(
        "  (mean ms per image; ratio = facenet-pytorch / ours; best/best = each side at its best thread "
        "count; NMS free = best/best with facenet-pytorch's time in the pure-torch stand-in batched_nms "
        "taken out; the goal needs every ratio)"
    )
    for name, s in det["sets"].items():
        nms = ", ".join(f"@{k} {v:.1f}" for k, v in s["speed"]["facenet_standin_nms_ms_per_image"].items())
        passes = s["timing"][f"ours@{t}"]["passes"]
        out.append(f"  {name}: {passes} passes; {_speed_line(s['speed'])}; fnp stand-in NMS ms/image {nms}")
        tv = s["speed"].get("with_torchvision_nms")
        if tv is not None:
            real = ", ".join(
                f"@{v} {s['timing'][f'facenet@{v}']['torchvision_nms']['mean_ms_per_item']:.2f}"
                for v in variants
            )
            info = tv["torchvision"]
            out.append(
                f"  {name}, fnp with torchvision {info['torchvision']}'s C++ batched_nms (the same "
                f"{info['calls']} calls timed in its own environment; same boxes kept as the stand-in in "
                f"{info['same_kept_as_standin']}): NMS ms/image {real}; ratio@{t} "
                f"{tv['speedup_same_threads']:.2f}x, per pass {_spread(tv)}, best/best "
                f"{tv['speedup_each_best']:.2f}x (what the goal reads)"
            )
    out.append("")
    rows = []
    for name, s in det["sets"].items():
        a = s["agreement"]
        lm = a.get("landmarks", {})
        bx = a.get("boxes", {})
        rows.append(
            [
                name,
                str(a["faces_ours"]),
                str(a["faces_facenet"]),
                str(a["matched"]),
                str(a["only_ours"]),
                str(a["only_facenet"]),
                f"{lm.get('mean_px', nan):.2f}",
                f"{lm.get('median_px', nan):.2f}",
                f"{lm.get('p90_px', nan):.2f}",
                f"{lm.get('max_px', nan):.1f}",
                f"{100 * lm.get('share_faces_within_1px', nan):.0f}%",
                f"{bx.get('mean_iou', nan):.3f}",
                "met" if lm.get("mean_px", np.inf) <= GOAL_LANDMARK_PX else "NOT met",
            ]
        )
    out.append(
        table(
            [
                "set",
                "faces ours",
                "faces fnp",
                "matched",
                "only ours",
                "only fnp",
                "lm mean px",
                "median",
                "p90",
                "max",
                "<=1px",
                "box IoU",
                f"goal <={GOAL_LANDMARK_PX:g}px",
            ],
            rows,
        )
    )
    out.append(
        f"  (faces matched by box IoU > {MATCH_IOU}; landmark px = mean over the 5 points of the Euclidean "
        "distance, per matched face, then mean/median/p90/max over faces)"
    )
    for name, s in det["sets"].items():
        lm = s["agreement"].get("landmarks")
        if lm:
            pts = " ".join(f"{v:.2f}" for v in lm["per_point_mean_px"])
            off = lm["mean_offset_facenet_minus_ours_xy"]
            box = " ".join(
                f"{v:+.2f}" for v in s["agreement"]["boxes"]["mean_corner_offset_facenet_minus_ours"]
            )
            out.append(
                f"  {name}: per point (eyes, nose, mouth corners) {pts} px; mean offset fnp-ours "
                f"x {off[0]:+.2f} y {off[1]:+.2f} px; box x1 y1 x2 y2 fnp-ours {box} px"
            )
        ref = s["agreement"].get("vs_reference_landmarks")
        if ref and ref["ours"]["mean_px"] is not None and ref["facenet"]["mean_px"] is not None:
            out.append(
                f"  {name}: distance to lfw/landmarks.txt (MATLAB MTCNN on the 250x250 originals, "
                "integer px): "
                f"ours {ref['ours']['mean_px']:.2f} px, facenet-pytorch {ref['facenet']['mean_px']:.2f} px"
            )
    out.append("")
    out.append("  where the time goes (one pass, each side at its best thread count, ms per image):")
    for name, s in det["sets"].items():
        p = s["profile_ours"]
        ort_ms = p["ort_run_ms_per_image"]
        top = ", ".join(
            f"{_short(f['function'])} {f['self_ms_per_image']:.1f}" for f in p["top_functions"][:6]
        )
        nets = f"P-Net {ort_ms['pnet']:.1f}, R-Net {ort_ms['rnet']:.1f}, O-Net {ort_ms['onet']:.1f}"
        if p.get("outside_ort_ms_per_image") is None:
            out.append(
                f"  {name} ours@{p['ort_intra_op_threads']}: {p['ms_per_image_unprofiled']:.1f} wall; "
                f"inside ORT, added up over the detector's threads: {nets}"
            )
        else:
            out.append(
                f"  {name} ours@{p['ort_intra_op_threads']}: {p['ms_per_image_unprofiled']:.1f} = ORT "
                f"{nets.replace(', ', ' + ')} + outside ORT {p['outside_ort_ms_per_image']:.1f}"
            )
        out.append(f"    self time under cProfile (calling thread): {top}")
        f = s["profile_facenet"]
        ftop = ", ".join(
            f"{_short(x['function'])} {x['self_ms_per_image']:.1f}" for x in f["top_functions"][:4]
        )
        out.append(f"    facenet@{f['torch_threads']} (first {f['images']} images) self time: {ftop}")
    out.append("")
    emb = report["embedder"]
    out.append(
        f"(b) Embedder {emb['model_id']}: ours (ONNX Runtime) vs PyTorch eager (same checkpoint, eval, "
        f"inference_mode), {emb['crops']} aligned LFW crops; "
        f"parity max |diff| {emb['parity_max_abs_diff']:.1e}, "
        f"min cosine {emb['parity_min_cosine']:.6f}"
    )
    rows = []
    for bs, b in emb["batches"].items():
        tm, sp = b["timing"], b["speed"]
        rows.append(
            [bs]
            + [f"{tm[f'ours@{v}']['median_ms_per_batch']:.2f}" for v in variants]
            + [f"{tm[f'torch@{v}']['median_ms_per_batch']:.2f}" for v in variants]
            + [
                f"{tm[f'ours@{t}']['images_per_s']:.0f}",
                f"{tm[f'torch@{t}']['images_per_s']:.0f}",
                f"{sp['speedup_same_threads']:.2f}x",
                _spread(sp),
                f"{sp['speedup_each_best']:.2f}x",
                _goal(sp, GOAL_EMBED_SPEEDUP),
            ]
        )
    out.append(
        table(
            ["batch"]
            + [f"ours@{v} ms" for v in variants]
            + [f"torch@{v} ms" for v in variants]
            + [
                f"ours@{t} img/s",
                f"torch@{t} img/s",
                f"ratio@{t}",
                "per pass",
                "best/best",
                f"goal >={GOAL_EMBED_SPEEDUP:g}x",
            ],
            rows,
        )
    )
    out.append("  (median ms per batch; ratio = torch / ours)")
    for bs, b in emb["batches"].items():
        calls = b["timing"][f"ours@{t}"]["calls"]
        out.append(f"  batch {bs}: {calls} timed calls each; {_speed_line(b['speed'])}")
    return "\n".join(out)


def _json_default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


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
        "--data", type=Path, default=DEFAULT_DATA, help=f"shared data folder (default: {DEFAULT_DATA})"
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for needed in (
        args.data / "lfw" / "landmarks.txt",
        args.data / "lfw" / "images",
        args.data / "photos",
        args.checkpoint,
    ):
        if not needed.exists():
            raise SystemExit(f"missing: {needed} (see ../shared/data/README.md)")
    threads = args.threads
    variants = sorted({1, 2, threads})
    torch.set_num_threads(threads)
    loadavg_start = os.getloadavg()
    started = time.time()

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
    imported = ensure_model(args.model, args.checkpoint)

    log("loading images")
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
    detector = bench_detector(
        sets, threads, variants, args.repeats, fnp, standin, args.time_budget, args.torchvision_python
    )

    crops = np.concatenate(
        [align_faces(img, ref[None]) for img, (_, ref) in zip(lfw_images, lfw, strict=True)]
    )
    if len(crops) < max(EMBED_BATCHES):
        crops = np.concatenate([crops] * (max(EMBED_BATCHES) // len(crops) + 1))
    embedder = bench_embedder(
        args.model, args.checkpoint, crops, threads, variants, args.repeats, args.time_budget
    )

    report = {
        "config": {
            "threads": threads,
            "thread_variants": variants,
            "repeats": args.repeats,
            "time_budget_s": args.time_budget,
            "lfw_images": len(lfw_images),
            "photos": len(photos),
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
        },
        "env": {
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
        },
        "detector": detector,
        "embedder": embedder,
    }
    sets_out = detector["sets"]
    goals = {}
    for k, v in sets_out.items():
        sp = v["speed"]
        goals[f"detector_speedup_{k}"] = worst_speedup(sp) >= GOAL_DETECT_SPEEDUP
        goals[f"landmarks_{k}"] = (
            v["agreement"].get("landmarks", {}).get("mean_px", np.inf) <= GOAL_LANDMARK_PX
        )
    for k, v in embedder["batches"].items():
        sp = v["speed"]
        goals[f"embedder_speedup_b{k}"] = worst_speedup(sp) >= GOAL_EMBED_SPEEDUP
    report["goals_met"] = goals
    print(render(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
