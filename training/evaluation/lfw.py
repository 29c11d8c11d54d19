"""LFW face verification: the official SphereFace 10-fold protocol, ROC curves and the evaluation job.

The protocol is the one of the SphereFace test code (``test/code/evaluation.m``, SPEC.md §1.10,
ANCHORS.md d8):

* ``pairs.txt`` (View 2): 6,000 pairs in 10 folds of 300 same-person + 300 different-person pairs.
* For each test fold: ``mu`` = mean of all left and right features of the 9 *other* folds; subtract
  ``mu`` from every feature, L2-normalise, score = dot product.
* Threshold = mean of every threshold of the grid ``(-10000:10000)/10000`` that reaches the
  maximal accuracy on the 9 training folds, where accuracy = (#same with score > t + #different
  with score < t) / N (a score equal to the threshold is an error for both classes).
* Accuracy of that threshold on the held-out fold; the result is the mean over the 10 folds.

Features come from :class:`models.embedder.Embedder`, the very path the service uses: the network's
outputs for the crop and its mirror, concatenated and *not* normalised, exactly as ``evaluation.m``
feeds them to the protocol. ROC data (and the thresholds at fixed false-accept rates) are computed
separately on the cosine the service returns: L2-normalised fused features, no mean subtraction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import SphereFaceError
from training import locks

log = logging.getLogger(__name__)

PAIRS_FILE = "pairs.txt"
LANDMARKS_FILE = "landmarks.txt"
IMAGES_DIR = "images"

#: The official threshold grid: -1, -0.9999, ..., 1 (20001 values), as ``(-10000:10000)/10000``.
THRESHOLD_GRID = np.arange(-10000, 10001, dtype=np.float64) / 10000.0

LANDMARK_NAMES = ("left_eye", "right_eye", "nose", "left_mouth", "right_mouth")

#: False-accept rates at which the ROC's true-accept rate is reported (when measurable).
REPORTED_FARS = (1e-1, 1e-2, 1e-3)

NO_FACE_POLICY = (
    "the detected face nearest the image centre is used (select_faces 'central'); when MTCNN finds "
    "no face, O-Net alone places the landmarks in the central square box of side 0.5*min(H, W) "
    "(landmarks_in_box) and the image is listed in no_face_list"
)

LANDMARK_MODES = ("file", "detect")


class LFWDataError(SphereFaceError):
    """An LFW file is missing or malformed; the message names the file and the line."""

    code = "invalid_lfw_data"


# --------------------------------------------------------------------------------------------
# pairs.txt and landmarks.txt
# --------------------------------------------------------------------------------------------


def image_name(name: str, number: int) -> str:
    """``("Abel_Pacheco", 1)`` -> ``"Abel_Pacheco/Abel_Pacheco_0001.jpg"`` (relative to images/)."""
    return f"{name}/{name}_{number:04d}.jpg"


@dataclass(frozen=True)
class LFWPairs:
    """The pairs of a protocol file.

    ``left[i]`` and ``right[i]`` are image names relative to ``images/`` (``Name/Name_NNNN.jpg``),
    ``is_same[i]`` says whether they show the same person and ``fold[i]`` is the 0-based fold.
    """

    left: tuple[str, ...]
    right: tuple[str, ...]
    is_same: np.ndarray
    fold: np.ndarray

    def __len__(self) -> int:
        return len(self.left)

    @property
    def n_folds(self) -> int:
        return int(len(np.unique(self.fold)))

    def images(self) -> list[str]:
        """Every image named by a pair, once, sorted."""
        return sorted(set(self.left) | set(self.right))

    def subset(self, pairs_per_fold: int) -> LFWPairs:
        """The first ``pairs_per_fold / 2`` same and different pairs of every fold (file order)."""
        if pairs_per_fold < 2 or pairs_per_fold % 2:
            raise ValueError(f"pairs_per_fold must be an even number >= 2, got {pairs_per_fold}")
        keep: list[int] = []
        for k in np.unique(self.fold):
            for same in (True, False):
                idx = np.flatnonzero((self.fold == k) & (self.is_same == same))
                keep.extend(idx[: pairs_per_fold // 2].tolist())
        keep.sort()
        return LFWPairs(
            left=tuple(self.left[i] for i in keep),
            right=tuple(self.right[i] for i in keep),
            is_same=self.is_same[keep],
            fold=self.fold[keep],
        )


def _read_lines(path: Path, what: str) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LFWDataError(f"{what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LFWDataError(f"cannot read {what} file {path}: {exc}") from exc
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _positive_int(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) > 0 else None


def read_pairs(path: str | Path) -> LFWPairs:
    """Parse an LFW View-2 ``pairs.txt``.

    Format: a header ``<folds>\\t<n>``, then per fold ``n`` same-person lines ``name i j`` followed
    by ``n`` different-person lines ``name1 i name2 j``.

    Raises:
        LFWDataError: the file is missing or a line is malformed (the message gives path:line).
    """
    path = Path(path)
    lines = _read_lines(path, "pairs")
    if not lines:
        raise LFWDataError(f"pairs file {path} is empty")
    header = lines[0].split()
    counts = [_positive_int(h) for h in header]
    if len(header) != 2 or None in counts:
        raise LFWDataError(
            f"{path}:1: expected the header '<folds> <pairs per class>' (e.g. '10\\t300'), got {lines[0]!r}"
        )
    n_folds, per_class = counts  # type: ignore[misc]
    body = lines[1:]
    expected = n_folds * 2 * per_class
    if len(body) != expected:
        raise LFWDataError(
            f"{path}: the header promises {n_folds} folds x {2 * per_class} pairs = {expected} pair "
            f"lines, the file has {len(body)}"
        )
    left: list[str] = []
    right: list[str] = []
    is_same = np.zeros(expected, dtype=bool)
    fold = np.zeros(expected, dtype=np.int64)
    for k, line in enumerate(body):
        lineno = k + 2
        fold[k], position = divmod(k, 2 * per_class)
        same = position < per_class
        fields = line.split()
        if same:
            ok = len(fields) == 3 and _positive_int(fields[1]) and _positive_int(fields[2])
            if not ok:
                raise LFWDataError(
                    f"{path}:{lineno}: expected a same-person line 'name i j' (fold {fold[k] + 1}, "
                    f"pair {position + 1}), got {line!r}"
                )
            left.append(image_name(fields[0], int(fields[1])))
            right.append(image_name(fields[0], int(fields[2])))
        else:
            ok = len(fields) == 4 and _positive_int(fields[1]) and _positive_int(fields[3])
            if not ok:
                raise LFWDataError(
                    f"{path}:{lineno}: expected a different-person line 'name1 i name2 j' "
                    f"(fold {fold[k] + 1}, pair {position + 1}), got {line!r}"
                )
            left.append(image_name(fields[0], int(fields[1])))
            right.append(image_name(fields[2], int(fields[3])))
        is_same[k] = same
    return LFWPairs(left=tuple(left), right=tuple(right), is_same=is_same, fold=fold)


def read_landmarks(path: str | Path) -> dict[str, np.ndarray]:
    """Parse ``landmarks.txt``: ``Name/Name_NNNN.jpg x1 y1 ... x5 y5`` per line (tab-separated).

    Returns:
        image name (relative to ``images/``) -> ``(5, 2)`` float64 landmarks (x, y), in the order
        left eye, right eye, nose, left mouth corner, right mouth corner.

    Raises:
        LFWDataError: the file is missing, a line is malformed or an image is listed twice.
    """
    path = Path(path)
    lines = _read_lines(path, "landmarks")
    out: dict[str, np.ndarray] = {}
    for k, line in enumerate(lines):
        lineno = k + 1
        fields = line.split()
        if len(fields) != 11:
            raise LFWDataError(
                f"{path}:{lineno}: expected 'Name/Name_NNNN.jpg' and 10 coordinates (11 fields), "
                f"got {len(fields)} fields: {line!r}"
            )
        try:
            values = np.array([float(v) for v in fields[1:]], dtype=np.float64)
        except ValueError:
            raise LFWDataError(f"{path}:{lineno}: coordinates must be numbers, got {line!r}") from None
        if not np.all(np.isfinite(values)):
            raise LFWDataError(f"{path}:{lineno}: coordinates must be finite, got {line!r}")
        if fields[0] in out:
            raise LFWDataError(f"{path}:{lineno}: {fields[0]} is listed twice")
        out[fields[0]] = values.reshape(5, 2)
    if not out:
        raise LFWDataError(f"landmarks file {path} is empty")
    return out


# --------------------------------------------------------------------------------------------
# The protocol (pure numpy)
# --------------------------------------------------------------------------------------------


def verification_accuracy(scores: np.ndarray, is_same: np.ndarray, threshold: float) -> float:
    """(#same with score > threshold + #different with score < threshold) / N."""
    scores = np.asarray(scores, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    correct = np.count_nonzero(scores[is_same] > threshold) + np.count_nonzero(scores[~is_same] < threshold)
    return correct / len(scores)


def grid_accuracies(scores: np.ndarray, is_same: np.ndarray, grid: np.ndarray = THRESHOLD_GRID) -> np.ndarray:
    """Number of correctly classified pairs at every threshold of ``grid`` (vectorised).

    Uses the sorted scores of each class and binary search: ``O((N + G) log N)``, no ``G x N`` matrix.
    """
    scores = np.asarray(scores, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    same = np.sort(scores[is_same])
    different = np.sort(scores[~is_same])
    # same pairs with score > t: all minus those <= t; different pairs with score < t.
    true_accepts = len(same) - np.searchsorted(same, grid, side="right")
    true_rejects = np.searchsorted(different, grid, side="left")
    return true_accepts + true_rejects


def best_threshold(
    scores: np.ndarray, is_same: np.ndarray, grid: np.ndarray = THRESHOLD_GRID
) -> tuple[float, float]:
    """The official threshold rule: mean of ALL grid thresholds with the maximal accuracy.

    Returns:
        ``(threshold, accuracy at the maximum)``.
    """
    if len(scores) == 0:
        raise ValueError("no scores to choose a threshold from")
    correct = grid_accuracies(scores, is_same, grid)
    best = correct.max()
    return float(grid[correct == best].mean()), float(best / len(scores))


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


@dataclass
class TenFoldResult:
    """Per-fold and mean results of the official protocol (``std`` is the sample std, ddof=1)."""

    accuracy: float
    std: float
    fold_accuracies: list[float]
    fold_thresholds: list[float]
    threshold: float
    fold_train_accuracies: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "std": self.std,
            "fold_accuracies": self.fold_accuracies,
            "threshold": self.threshold,
            "fold_thresholds": self.fold_thresholds,
            "fold_train_accuracies": self.fold_train_accuracies,
        }


def lfw_10fold_accuracy(
    features_left: np.ndarray,
    features_right: np.ndarray,
    is_same: np.ndarray,
    folds: np.ndarray,
    grid: np.ndarray = THRESHOLD_GRID,
    *,
    subtract_mean: bool = True,
) -> TenFoldResult:
    """The official SphereFace LFW protocol (``evaluation.m``) on paired features.

    Args:
        features_left, features_right: ``(P, D)`` features of the two images of each pair.
        is_same: ``(P,)`` bool, True for same-person pairs.
        folds: ``(P,)`` fold label of every pair (any hashable ints; 10 folds on LFW).
        grid: the thresholds to sweep (default: the official ``(-10000:10000)/10000``).

    For each fold: mean of the left+right features of the other folds subtracted, L2-normalised,
    dot product; threshold = mean of every grid value with the maximal training accuracy.
    ``subtract_mean=False`` scores pairs as the service does (the cosine of the features, no mean
    subtracted), with the same folds and threshold rule.
    """
    left = np.asarray(features_left, dtype=np.float64)
    right = np.asarray(features_right, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    folds = np.asarray(folds)
    if left.ndim != 2 or left.shape != right.shape:
        raise ValueError(f"features must be two (P, D) arrays of one shape, got {left.shape}, {right.shape}")
    if is_same.shape != (len(left),) or folds.shape != (len(left),):
        raise ValueError(f"is_same and folds must have shape ({len(left)},)")
    fold_ids = np.unique(folds)
    if len(fold_ids) < 2:
        raise ValueError("the protocol needs at least 2 folds")
    # Per-fold sums, so each fold's training mean is (total - own) / count.
    fold_sums = np.stack([left[folds == k].sum(axis=0) + right[folds == k].sum(axis=0) for k in fold_ids])
    fold_counts = np.array([2 * np.count_nonzero(folds == k) for k in fold_ids])
    total_sum, total_count = fold_sums.sum(axis=0), fold_counts.sum()
    accuracies, thresholds, train_accuracies = [], [], []
    for i, k in enumerate(fold_ids):
        test = folds == k
        train = ~test
        mu = (total_sum - fold_sums[i]) / (total_count - fold_counts[i]) if subtract_mean else 0.0
        scores = np.einsum("ij,ij->i", _unit_rows(left - mu), _unit_rows(right - mu))
        threshold, train_accuracy = best_threshold(scores[train], is_same[train], grid)
        accuracies.append(verification_accuracy(scores[test], is_same[test], threshold))
        thresholds.append(threshold)
        train_accuracies.append(train_accuracy)
    return TenFoldResult(
        accuracy=float(np.mean(accuracies)),
        std=float(np.std(accuracies, ddof=1)),
        fold_accuracies=[float(a) for a in accuracies],
        fold_thresholds=thresholds,
        threshold=float(np.mean(thresholds)),
        fold_train_accuracies=train_accuracies,
    )


# --------------------------------------------------------------------------------------------
# ROC on raw cosine scores
# --------------------------------------------------------------------------------------------


def far_label(far: float) -> str:
    """``1e-3`` -> ``"1e-03"`` (stable JSON keys)."""
    return f"{far:.0e}"


@dataclass
class RocCurve:
    """True-accept rate against false-accept rate over every distinct score threshold.

    A pair is accepted when ``score >= thresholds[i]``; ``far[0] = tar[0] = 0``.
    """

    far: np.ndarray
    tar: np.ndarray
    thresholds: np.ndarray
    auc: float
    n_same: int
    n_different: int
    tar_at_far: dict[str, float | None] = field(default_factory=dict)
    threshold_at_far: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "auc": self.auc,
            "n_same": self.n_same,
            "n_different": self.n_different,
            "tar_at_far": self.tar_at_far,
            "threshold_at_far": self.threshold_at_far,
            "scores": "raw cosine of the flip-fused embeddings, all pairs, no mean subtraction",
        }


def false_accepts_allowed(far: float, n_impostor: int) -> int | None:
    """``k = floor(far * n_impostor)``: how many impostor pairs may score above the threshold at
    ``far``; None when that is below 1 or covers every pair (the FAR cannot be measured)."""
    allowed = math.floor(far * n_impostor + 1e-9)
    return allowed if 1 <= allowed < n_impostor else None


def tar_at_far(scores: np.ndarray, is_same: np.ndarray, far: float) -> tuple[float, float] | None:
    """True-accept rate at a false-accept rate of at most ``far``, and its threshold.

    The threshold is the ``(k+1)``-th highest different-pair score with ``k = floor(far * n_diff)``;
    pairs scoring strictly above it are accepted, so at most ``k`` different pairs are. Returns
    None when ``far * n_diff < 1`` (not measurable with this many different pairs).
    """
    scores = np.asarray(scores, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    different = np.sort(scores[~is_same])[::-1]
    allowed = false_accepts_allowed(far, len(different))
    if allowed is None:
        return None
    threshold = float(different[allowed])
    return float(np.mean(scores[is_same] > threshold)), threshold


def roc_curve(scores: np.ndarray, is_same: np.ndarray, fars: Sequence[float] = REPORTED_FARS) -> RocCurve:
    """ROC of ``scores`` (higher = more likely the same person), AUC and TAR at ``fars``."""
    scores = np.asarray(scores, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    n_same, n_different = int(is_same.sum()), int((~is_same).sum())
    if n_same == 0 or n_different == 0:
        raise ValueError("an ROC needs both same and different pairs")
    order = np.argsort(-scores, kind="stable")
    ordered, labels = scores[order], is_same[order]
    true_accepts = np.cumsum(labels)
    false_accepts = np.cumsum(~labels)
    last_of_score = np.r_[np.flatnonzero(np.diff(ordered)), len(ordered) - 1]
    tar = np.r_[0.0, true_accepts[last_of_score] / n_same]
    far = np.r_[0.0, false_accepts[last_of_score] / n_different]
    thresholds = np.r_[np.inf, ordered[last_of_score]]
    auc = float(np.sum(np.diff(far) * (tar[1:] + tar[:-1]) / 2))
    curve = RocCurve(far=far, tar=tar, thresholds=thresholds, auc=auc, n_same=n_same, n_different=n_different)
    for rate in fars:
        measured = tar_at_far(scores, is_same, rate)
        curve.tar_at_far[far_label(rate)] = None if measured is None else measured[0]
        curve.threshold_at_far[far_label(rate)] = None if measured is None else measured[1]
    return curve


def plot_roc(curve: RocCurve, path: str | Path, title: str) -> Path:
    """Write the ROC curve as a PNG (Agg backend, log-scale FAR axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.4, 5.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    visible = curve.far > 0
    ax.plot(curve.far[visible], curve.tar[visible], lw=1.8, label=f"ROC (AUC {curve.auc:.4f})")
    for label, value in curve.tar_at_far.items():
        if value is not None:
            ax.plot([float(label)], [value], "o", ms=5, label=f"TAR {100 * value:.2f}% @ FAR {label}")
    ax.set_xscale("log")
    ax.set_xlim(0.5 / curve.n_different, 1.0)
    low = curve.tar[np.searchsorted(curve.far, 1.0 / curve.n_different)] if len(curve.far) else 0.0
    ax.set_ylim(max(0.0, min(0.9, float(low) - 0.02)), 1.001)
    ax.set_xlabel(f"false accept rate (log scale, {curve.n_different} different pairs)")
    ax.set_ylabel(f"true accept rate ({curve.n_same} same pairs)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------------------------
# Detector landmarks
# --------------------------------------------------------------------------------------------


def central_box(shape: Sequence[int]) -> np.ndarray:
    """The fallback box: a square of side ``0.5 * min(H, W)`` centred in the image (x1, y1, x2, y2)."""
    height, width = int(shape[0]), int(shape[1])
    side = 0.5 * min(height, width)
    x1, y1 = (width - side) / 2.0, (height - side) / 2.0
    return np.array([x1, y1, x1 + side, y1 + side], dtype=np.float64)


def detect_central_landmarks(detector: Any, image: np.ndarray) -> tuple[np.ndarray, bool]:
    """Landmarks of the face nearest the image centre, with the no-face fallback.

    Returns:
        ``((5, 2) landmarks, found)``; ``found`` is False when MTCNN found no face and O-Net was run
        alone on :func:`central_box`.
    """
    from models.mtcnn import select_faces

    faces = select_faces(detector.detect(image), "central", image.shape)
    if faces:
        return np.asarray(faces[0].landmarks, dtype=np.float64).reshape(5, 2), True
    face = detector.landmarks_in_box(image, central_box(image.shape))
    return np.asarray(face.landmarks, dtype=np.float64).reshape(5, 2), False


def landmark_error_stats(predicted: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    """Euclidean errors in pixels of ``(N, 5, 2)`` landmarks against references.

    Returns mean and median over all N*5 points, the mean per point, the 95th percentile, the
    mean normalised by the reference inter-ocular distance (NME) and the mean signed offset
    ``(dx, dy)`` of predicted minus reference points (a systematic shift, e.g. a pixel convention).
    """
    predicted = np.asarray(predicted, dtype=np.float64).reshape(-1, 5, 2)
    reference = np.asarray(reference, dtype=np.float64).reshape(-1, 5, 2)
    if len(predicted) == 0:
        return {
            "images": 0,
            "mean": None,
            "median": None,
            "p95": None,
            "per_point": {},
            "nme": None,
            "mean_offset_xy": None,
            "images_over_5px": 0,
        }
    errors = np.linalg.norm(predicted - reference, axis=2)  # (N, 5)
    interocular = np.linalg.norm(reference[:, 1] - reference[:, 0], axis=1)
    per_image = errors.mean(axis=1)
    return {
        "images": int(len(errors)),
        "mean": float(errors.mean()),
        "median": float(np.median(errors)),
        "p95": float(np.percentile(errors, 95)),
        "per_point": {name: float(v) for name, v in zip(LANDMARK_NAMES, errors.mean(axis=0), strict=True)},
        "nme": float(np.mean(per_image / np.maximum(interocular, 1e-6))),
        "images_over_5px": int(np.count_nonzero(per_image > 5.0)),
        "mean_offset_xy": [float(v) for v in (predicted - reference).reshape(-1, 2).mean(axis=0)],
    }


_END = object()


def _ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int, window: int) -> Iterator[Any]:
    """``map(fn, items)`` on ``workers`` threads, results in order, at most ``window`` in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lfw")
    try:
        source = iter(items)
        pending = deque(pool.submit(fn, item) for _, item in zip(range(window), source, strict=False))
        while pending:
            result = pending.popleft().result()
            following = next(source, _END)
            if following is not _END:
                pending.append(pool.submit(fn, following))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _progress(iterable: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="img", dynamic_ncols=True)


def _make_detector(providers: str | Sequence[str], workers: int) -> Any:
    from models.mtcnn import MTCNNDetector

    # One thread per ONNX Runtime call: MTCNN's many small runs are several times faster than
    # with a thread pool per call, and parallelism comes from the worker threads instead.
    return MTCNNDetector(providers=providers, intra_op_threads=1)


def detector_landmark_report(
    data_dir: str | Path,
    detector: Any = None,
    *,
    limit: int | None = None,
    workers: int = 2,
    providers: str | Sequence[str] = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """How well the detector finds LFW faces and places their landmarks, over all LFW images.

    Runs ``detector`` (default: a new :class:`models.mtcnn.MTCNNDetector`) on every image listed in
    ``landmarks.txt`` (13,233; the first ``limit`` in file order if given), keeps the face nearest
    the centre and compares its 5 landmarks with the file's.

    Returns:
        a JSON-ready dict: ``images``, ``faces_found``, ``faces_found_share``, ``no_face_list``,
        ``landmark_error_px`` (see :func:`landmark_error_stats`, over images with a found face),
        ``seconds`` and ``images_per_s``.
    """
    from models.image import read_image

    data_dir = Path(data_dir)
    reference = read_landmarks(data_dir / LANDMARKS_FILE)
    names = list(reference)[:limit] if limit is not None else list(reference)
    if detector is None:
        detector = _make_detector(providers, workers)

    def work(name: str) -> tuple[np.ndarray, bool]:
        return detect_central_landmarks(detector, read_image(data_dir / IMAGES_DIR / name))

    started = time.perf_counter()
    predicted, found = [], []
    stream = _ordered_map(work, names, workers, window=4 * max(workers, 1))
    for points, ok in _progress(stream, len(names), "detect", progress):
        predicted.append(points)
        found.append(ok)
    seconds = time.perf_counter() - started
    found_mask = np.array(found, dtype=bool)
    refs = np.stack([reference[n] for n in names]) if names else np.zeros((0, 5, 2))
    preds = np.stack(predicted) if predicted else np.zeros((0, 5, 2))
    return {
        "images": len(names),
        "faces_found": int(found_mask.sum()),
        "faces_found_share": float(found_mask.mean()) if names else None,
        "no_face_images": int((~found_mask).sum()),
        "no_face_list": [n for n, ok in zip(names, found, strict=True) if not ok],
        "landmark_error_px": landmark_error_stats(preds[found_mask], refs[found_mask]),
        "landmark_error_px_fallback": landmark_error_stats(preds[~found_mask], refs[~found_mask]),
        "seconds": seconds,
        "images_per_s": len(names) / seconds if seconds > 0 else None,
        "workers": workers,
    }


# --------------------------------------------------------------------------------------------
# The evaluation job
# --------------------------------------------------------------------------------------------


@dataclass
class LFWEvaluation:
    """Everything one LFW run measured; ``to_dict`` is what goes into the JSON file."""

    model_id: str
    provider: str
    landmarks: str
    n_pairs: int
    n_images: int
    protocol: TenFoldResult
    #: the same folds and threshold rule on the score the service computes (cosine, no mean subtracted)
    cosine: TenFoldResult
    roc: RocCurve
    timing: dict[str, float]
    no_face_list: list[str] = field(default_factory=list)
    detection: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``(n_images, D)`` fused, unnormalised features of ``names`` (kept for threshold calibration;
    #: not written to the JSON).
    features: np.ndarray | None = field(default=None, repr=False)
    names: list[str] = field(default_factory=list, repr=False)
    pairs: LFWPairs | None = field(default=None, repr=False)

    @property
    def accuracy(self) -> float:
        return self.protocol.accuracy

    @property
    def std(self) -> float:
        return self.protocol.std

    @property
    def threshold(self) -> float:
        return self.protocol.threshold

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "benchmark": "LFW View 2",
            "protocol": "official SphereFace evaluation.m: 10 folds, training-fold mean subtracted, "
            "L2-normalised, dot product, threshold = mean of all grid thresholds "
            "(-10000:10000)/10000 with maximal training accuracy",
            "model_id": self.model_id,
            "provider": self.provider,
            "landmarks": self.landmarks,
            "n_pairs": self.n_pairs,
            "n_images": self.n_images,
            **self.protocol.to_dict(),
            "std_ddof": 1,
            "cosine_protocol": {
                "what": "the same 10 folds and threshold rule on the cosine the service computes "
                "(L2-normalised fused features, no training-fold mean subtracted)",
                **self.cosine.to_dict(),
            },
            "no_face_images": len(self.no_face_list),
            "roc": self.roc.to_dict(),
            "timing_s": self.timing,
        }
        if self.detection is not None:
            out["no_face_list"] = self.no_face_list
            out.update(self.detection)
        out.update(self.extra)
        return out

    def manifest_entry(self) -> dict[str, Any]:
        """What a model's manifest records of this run (``manifest.lfw``)."""
        return {
            "accuracy": self.accuracy,
            "std": self.std,
            "accuracy_cosine": self.cosine.accuracy,
            "std_cosine": self.cosine.std,
            "landmarks": self.landmarks,
            "protocol": "official SphereFace 10-fold (sphereface evaluate lfw); accuracy_cosine: the same "
            "folds on the service's cosine score",
        }

    def summary(self) -> str:
        p = self.protocol
        lines = [
            f"LFW ({self.n_pairs} pairs in {len(p.fold_accuracies)} folds, {self.n_images} images, "
            f"landmarks={self.landmarks}) model {self.model_id} on {self.provider}",
            f"accuracy {100 * p.accuracy:.2f}% ± {100 * p.std:.2f}% (official SphereFace protocol: "
            f"training folds' mean subtracted; threshold {p.threshold:.4f})",
            f"accuracy {100 * self.cosine.accuracy:.2f}% ± {100 * self.cosine.std:.2f}% (the same folds on "
            f"the service's score: the cosine, no mean subtracted; threshold {self.cosine.threshold:.4f})",
            "folds (official): " + " ".join(f"{100 * a:.2f}" for a in p.fold_accuracies),
        ]
        tars = [f"{100 * v:.2f}% @ FAR {k}" for k, v in self.roc.tar_at_far.items() if v is not None]
        lines.append(f"ROC (raw cosine): AUC {self.roc.auc:.5f}; TAR " + ", ".join(tars))
        if self.detection is not None:
            d = self.detection
            err = d["landmark_error_px"]
            lines.append(
                f"MTCNN: face found in {100 * d['faces_found_share']:.2f}% of images, "
                f"{len(self.no_face_list)} without a face (central-box fallback)"
            )
            if err and err.get("mean") is not None:
                per_point = " ".join(f"{k} {v:.2f}" for k, v in err["per_point"].items())
                lines.append(
                    f"landmark error vs landmarks.txt: mean {err['mean']:.2f} px, median "
                    f"{err['median']:.2f} px over {err['images']} images ({per_point})"
                )
        lines.append(f"took {self.timing['total']:.1f} s ({self.timing['images_per_s']:.1f} images/s)")
        return "\n".join(lines)


def run_lfw_evaluation(
    model_dir: str | Path,
    data_dir: str | Path,
    landmarks: str = "file",
    json_out: str | Path | None = None,
    plot_out: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    batch_size: int = 64,
    *,
    pairs_per_fold: int | None = None,
    workers: int = 2,
    detector: Any = None,
    embed_threads: int | None = None,
    progress: bool = True,
) -> LFWEvaluation:
    """Evaluate a model folder on LFW with the official protocol; optionally write JSON and ROC PNG.

    Args:
        model_dir: model folder (``model.onnx`` + ``manifest.json``).
        data_dir: LFW folder with ``images/``, ``pairs.txt`` and (for ``landmarks="file"``, and for
            the landmark error in detect mode) ``landmarks.txt``.
        landmarks: ``"file"`` (landmarks.txt) or ``"detect"`` (our MTCNN, face nearest the centre).
        pairs_per_fold: evaluate only the first ``n/2`` same and ``n/2`` different pairs per fold.
        workers: threads decoding, detecting and aligning images while the main thread embeds.
        detector: a detector object for detect mode (default: a new ``MTCNNDetector``).
        embed_threads: ONNX Runtime intra-op threads of the embedder (0: one per core). Default:
            1 in detect mode with several workers (the detector threads keep the cores busy; measured
            faster on 2 cores than a 2-thread embedder competing with them), else 0.
    """
    from models.align import align_face, get_template
    from models.embedder import Embedder
    from models.image import read_image

    if landmarks not in LANDMARK_MODES:
        raise ValueError(f"landmarks must be one of {LANDMARK_MODES}, got {landmarks!r}")
    started = time.perf_counter()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    data_dir = Path(data_dir)
    if not (data_dir / IMAGES_DIR).is_dir():
        raise LFWDataError(f"{data_dir} is not an LFW folder: {data_dir / IMAGES_DIR} is missing")
    pairs = read_pairs(data_dir / PAIRS_FILE)
    if pairs_per_fold is not None:
        pairs = pairs.subset(pairs_per_fold)
    names = pairs.images()

    landmarks_path = data_dir / LANDMARKS_FILE
    reference: dict[str, np.ndarray] | None = None
    if landmarks == "file" or landmarks_path.is_file():
        reference = read_landmarks(landmarks_path)
    if landmarks == "file":
        assert reference is not None
        missing = [n for n in names if n not in reference]
        if missing:
            raise LFWDataError(
                f"{landmarks_path} has no landmarks for {len(missing)} images of the pairs, e.g. "
                + ", ".join(missing[:5])
            )

    if embed_threads is None:
        embed_threads = 1 if landmarks == "detect" and workers > 1 else 0
    embedder = Embedder(model_dir, providers, batch_size=batch_size, intra_op_threads=embed_threads)
    manifest = embedder.manifest
    template = get_template(manifest.template)
    if landmarks == "detect" and detector is None:
        detector = _make_detector(providers, workers)
    loaded = time.perf_counter()

    def work(name: str) -> tuple[np.ndarray, np.ndarray, bool]:
        image = read_image(data_dir / IMAGES_DIR / name)
        if landmarks == "file":
            points, found = reference[name], True  # type: ignore[index]
        else:
            points, found = detect_central_landmarks(detector, image)
        return align_face(image, points, template), points, found

    features = np.empty((len(names), manifest.output_size), dtype=np.float32)
    points_all = np.empty((len(names), 5, 2), dtype=np.float64)
    found_all = np.empty(len(names), dtype=bool)
    batch: list[np.ndarray] = []
    embed_seconds = 0.0
    done = 0

    def flush() -> None:
        nonlocal embed_seconds, done
        t0 = time.perf_counter()
        features[done : done + len(batch)] = embedder.embed(np.stack(batch), normalize=False)
        embed_seconds += time.perf_counter() - t0
        done += len(batch)
        batch.clear()

    stream = _ordered_map(work, names, workers, window=2 * batch_size)
    for i, (crop, points, found) in enumerate(_progress(stream, len(names), "LFW images", progress)):
        batch.append(crop)
        points_all[i] = points
        found_all[i] = found
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    embedded = time.perf_counter()

    left, right = pair_features(features, names, pairs)
    result = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold)
    cosine_result = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold, subtract_mean=False)
    # ROC and its thresholds on the cosine the service computes (no mean subtraction).
    raw_scores = np.einsum(
        "ij,ij->i", _unit_rows(left.astype(np.float64)), _unit_rows(right.astype(np.float64))
    )
    curve = roc_curve(raw_scores, pairs.is_same)
    finished = time.perf_counter()

    no_face_list = [n for n, ok in zip(names, found_all, strict=True) if not ok]
    detection: dict[str, Any] | None = None
    if landmarks == "detect":
        detection = {
            "no_face_policy": NO_FACE_POLICY,
            "faces_found_share": float(found_all.mean()),
            "detector_provider": str(getattr(detector, "provider", providers)),
            "landmark_error_px": None,
        }
        if reference is not None:
            with_ref = np.array([ok and n in reference for n, ok in zip(names, found_all, strict=True)])
            refs = np.array([reference[n] for n, ok in zip(names, with_ref, strict=True) if ok])
            detection["landmark_error_px"] = landmark_error_stats(points_all[with_ref], refs)

    timing = {
        "total": finished - started,
        "load": loaded - started,
        "images_and_embedding": embedded - loaded,
        "embedding": embed_seconds,
        "protocol_and_roc": finished - embedded,
        "images_per_s": len(names) / max(embedded - loaded, 1e-9),
    }
    evaluation = LFWEvaluation(
        model_id=manifest.model_id,
        provider=embedder.provider,
        landmarks=landmarks,
        n_pairs=len(pairs),
        n_images=len(names),
        protocol=result,
        cosine=cosine_result,
        roc=curve,
        timing=timing,
        no_face_list=no_face_list,
        detection=detection,
        features=features,
        names=names,
        pairs=pairs,
        extra={
            "started_at": started_at,
            "data_dir": str(data_dir),
            "model_dir": str(model_dir),
            "pairs_per_fold": pairs_per_fold,
            "batch_size": batch_size,
            "workers": workers,
            "embed_threads": embed_threads,
            "template": manifest.template,
            "flip_fusion": manifest.flip_fusion,
        },
    )
    if json_out is not None:
        json_path = Path(json_out)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(evaluation.to_dict(), indent=2) + "\n")
    if plot_out is not None:
        title = (
            f"LFW ROC: {manifest.model_id} (landmarks: {landmarks})\n"
            f"10-fold accuracy {100 * result.accuracy:.2f}% ± {100 * result.std:.2f}%"
        )
        plot_roc(curve, plot_out, title)
    log.info("LFW accuracy %.4f ± %.4f", result.accuracy, result.std)
    return evaluation


# --------------------------------------------------------------------------------------------
# Ensembles: several models' features side by side
# --------------------------------------------------------------------------------------------


@dataclass
class EnsembleEvaluation:
    """LFW of several models at once: their fused features side by side (equal weights)."""

    model_ids: list[str]
    protocol: TenFoldResult
    cosine: TenFoldResult
    roc: RocCurve

    @property
    def accuracy(self) -> float:
        return self.protocol.accuracy

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": self.model_ids,
            "features": "each model's flip-fused features L2-normalised, side by side (equal weights)",
            **self.protocol.to_dict(),
            "cosine_protocol": self.cosine.to_dict(),
            "roc": self.roc.to_dict(),
        }

    def summary(self) -> str:
        return (
            f"ensemble of {' + '.join(self.model_ids)}: accuracy {100 * self.protocol.accuracy:.2f}% ± "
            f"{100 * self.protocol.std:.2f}% (official protocol), {100 * self.cosine.accuracy:.2f}% ± "
            f"{100 * self.cosine.std:.2f}% on the cosine; AUC {self.roc.auc:.5f}"
        )


def lfw_ensemble(evaluations: Sequence[LFWEvaluation]) -> EnsembleEvaluation:
    """The official protocol, the service's cosine and the ROC on the models' features side by side.

    Raises:
        ValueError: fewer than two evaluations, or evaluations of different images or pairs.
    """
    if len(evaluations) < 2:
        raise ValueError("an ensemble needs at least two models")
    first, pairs = evaluations[0], evaluations[0].pairs
    if first.features is None or pairs is None:
        raise ValueError(f"{first.model_id} has no features to combine")
    for other in evaluations[1:]:
        if other.features is None or other.names != first.names or other.pairs is None:
            raise ValueError(f"{other.model_id} was not evaluated on the same LFW images as {first.model_id}")
        if not np.array_equal(other.pairs.is_same, pairs.is_same):
            raise ValueError(f"{other.model_id} was not evaluated on the same pairs as {first.model_id}")
    from models.ensemble import concatenated_unit_features

    features = concatenated_unit_features([e.features for e in evaluations])  # type: ignore[misc]
    left, right = pair_features(features, first.names, pairs)
    return EnsembleEvaluation(
        model_ids=[e.model_id for e in evaluations],
        protocol=lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold),
        cosine=lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold, subtract_mean=False),
        roc=roc_curve(np.einsum("ij,ij->i", left, right), pairs.is_same),
    )


# --------------------------------------------------------------------------------------------
# Helpers for training and export: aligned crops
# --------------------------------------------------------------------------------------------


def identity_of(name: str) -> str:
    """``"Abel_Pacheco/Abel_Pacheco_0001.jpg"`` -> ``"Abel_Pacheco"``."""
    return name.split("/", 1)[0]


#: Bump when the meaning of a cached landmark file changes in a way no other key part captures.
LANDMARK_CACHE_VERSION = 1


def default_landmark_cache_dir() -> Path:
    """``$SPHEREFACE_CACHE/lfw_landmarks`` (default ``.cache/lfw_landmarks``)."""
    return Path(os.environ.get("SPHEREFACE_CACHE", ".cache")) / "lfw_landmarks"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _detector_key(providers: str | Sequence[str]) -> dict[str, Any]:
    """Everything that decides the landmarks :func:`_make_detector` + :func:`detect_central_landmarks`
    place: the detector's settings (its constructor's defaults, which ``_make_detector`` keeps),
    the execution provider, the MTCNN weights' and code's content, the face policy's code and the
    ONNX Runtime version."""
    import inspect

    import onnxruntime

    from models import mtcnn
    from models.mtcnn_convert import DEFAULT_MTCNN_DIR
    from models.runtime import resolve_providers

    settings = {
        name: list(p.default) if isinstance(p.default, tuple) else p.default
        for name, p in inspect.signature(mtcnn.MTCNNDetector.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in ("providers", "intra_op_threads")
    }
    policy = inspect.getsource(detect_central_landmarks) + inspect.getsource(central_box)
    return {
        "settings": settings,
        "provider": resolve_providers(providers)[0],
        "weights_sha256": {
            n: _sha256_bytes((DEFAULT_MTCNN_DIR / f"{n}.onnx").read_bytes()) for n in ("pnet", "rnet", "onet")
        },
        "mtcnn_code_sha256": _sha256_bytes(Path(mtcnn.__file__).read_bytes()),
        "policy_code_sha256": _sha256_bytes(policy.encode()),
        "onnxruntime": onnxruntime.__version__,
    }


def detected_landmarks_key(
    data_dir: str | Path, names: Sequence[str], providers: str | Sequence[str] = "cpu"
) -> dict[str, Any]:
    """The cache key of :func:`detected_lfw_landmarks`: the LFW folder's resolved path, the image
    names with each file's size and modification time, and :func:`_detector_key`."""
    images = Path(data_dir).resolve() / IMAGES_DIR
    listing = hashlib.sha256()
    for name in names:
        stat = (images / name).stat()
        listing.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {
        "version": LANDMARK_CACHE_VERSION,
        "lfw_dir": str(Path(data_dir).resolve()),
        "n_images": len(names),
        "images_sha256": listing.hexdigest(),
        "detector": _detector_key(providers),
    }


def _load_landmark_cache(
    path: Path, key_json: str, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != key_json or data["names"].tolist() != list(names):
                log.warning("LFW landmark cache %s has another key; detecting again", path)
                return None
            points, found = data["landmarks"], data["found"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("LFW landmark cache %s is unreadable (%s); detecting again", path, exc)
        return None
    if points.shape != (len(names), 5, 2) or found.shape != (len(names),):
        return None
    return points.astype(np.float64), found.astype(bool)


def _save_landmark_cache(
    path: Path, key_json: str, names: Sequence[str], points: np.ndarray, found: np.ndarray
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        np.savez(f, key=np.array(key_json), names=np.array(list(names)), landmarks=points, found=found)
    os.replace(temporary, path)


def detected_lfw_landmarks(
    data_dir: str | Path,
    names: Sequence[str],
    *,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    workers: int = 2,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, Path]:
    """Our MTCNN's landmarks of LFW images, as :func:`run_lfw_evaluation`'s detect mode places them.

    :func:`detect_central_landmarks` (face nearest the centre; O-Net in :func:`central_box` when
    no face is found) with the detector of :func:`_make_detector`, on the images ``names``
    (relative to ``images/``). The result is cached in ``cache_dir`` (default
    :func:`default_landmark_cache_dir`) as ``<key digest>.npz``; the key
    (:func:`detected_landmarks_key`) covers the folder, the images and the detector, and is
    checked in full on load, so a changed input is detected again rather than served stale.

    Returns:
        ``(n, 5, 2)`` float64 landmarks, ``(n,)`` found flags (False: the central-box fallback)
        and the cache file's path.
    """
    data_dir = Path(data_dir)
    key_json = json.dumps(detected_landmarks_key(data_dir, names, providers), sort_keys=True)
    folder = Path(cache_dir) if cache_dir is not None else default_landmark_cache_dir()
    path = folder / f"{_sha256_bytes(key_json.encode())[:24]}.npz"
    folder.mkdir(parents=True, exist_ok=True)
    # Two jobs started together (make loss-table trains two at a time) take turns: the second
    # finds the first one's file instead of detecting the same landmarks again.
    with locks.exclusive(path.with_suffix(".lock"), f"detecting the LFW landmarks of {path.name}"):
        return _cached_or_detected(path, key_json, data_dir, names, providers, workers, progress)


def _cached_or_detected(
    path: Path,
    key_json: str,
    data_dir: Path,
    names: Sequence[str],
    providers: str | Sequence[str],
    workers: int,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray, Path]:
    """The landmarks from ``path`` when it holds them, else detected and written there."""
    from models.image import read_image

    started = time.perf_counter()
    cached = _load_landmark_cache(path, key_json, names)
    if cached is not None:
        log.info(
            "LFW landmarks of %d images loaded from %s in %.2f s",
            len(names),
            path,
            time.perf_counter() - started,
        )
        return cached[0], cached[1], path

    detector = _make_detector(providers, workers)

    def work(name: str) -> tuple[np.ndarray, bool]:
        return detect_central_landmarks(detector, read_image(data_dir / IMAGES_DIR / name))

    points = np.empty((len(names), 5, 2), dtype=np.float64)
    found = np.empty(len(names), dtype=bool)
    stream = _ordered_map(work, names, workers, window=4 * max(workers, 1))
    for i, (p, ok) in enumerate(_progress(stream, len(names), "detect LFW", progress)):
        points[i], found[i] = p, ok
    _save_landmark_cache(path, key_json, names, points, found)
    log.info(
        "LFW landmarks of %d images detected in %.1f s (%d without a face), cached in %s",
        len(names), time.perf_counter() - started, int((~found).sum()), path,
    )  # fmt: skip
    return points, found, path


def aligned_lfw_crops(
    data_dir: str | Path,
    pairs_per_fold: int | None = None,
    *,
    landmarks: str = "file",
    workers: int = 2,
    progress: bool = False,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
) -> tuple[np.ndarray, list[str], LFWPairs]:
    """Every image of the LFW pairs, aligned onto the SphereFace template, without a model.

    The crops of :func:`run_lfw_evaluation` for the trainer's periodic LFW check, which embeds
    them with the network being trained.

    Args:
        landmarks: ``"file"``: ``landmarks.txt``; ``"detect"``: our MTCNN, exactly as the
            evaluation's detect mode and ``sphereface prepare`` (which aligns the training data)
            place them, through :func:`detected_lfw_landmarks` and its cache in ``cache_dir``.
            The two sources differ by about 1 px (docs/face_path.md): compare a model on crops
            from the source it was trained on.
        providers: execution providers of the detector (detect mode; part of the cache key).

    Returns:
        ``crops`` ``(n_images, 112, 96, 3)`` uint8 RGB, ``names`` (sorted, relative to images/) and
        the pairs (subset to ``pairs_per_fold`` when given).

    Raises:
        ValueError: ``landmarks`` is not one of :data:`LANDMARK_MODES`.
    """
    from models.align import SPHEREFACE_TEMPLATE_112x96, align_face
    from models.image import read_image

    if landmarks not in LANDMARK_MODES:
        raise ValueError(f"landmarks must be one of {LANDMARK_MODES}, got {landmarks!r}")
    data_dir = Path(data_dir)
    if not (data_dir / IMAGES_DIR).is_dir():
        raise LFWDataError(f"{data_dir} is not an LFW folder: {data_dir / IMAGES_DIR} is missing")
    pairs = read_pairs(data_dir / PAIRS_FILE)
    if pairs_per_fold is not None:
        pairs = pairs.subset(pairs_per_fold)
    names = pairs.images()
    if landmarks == "file":
        reference = read_landmarks(data_dir / LANDMARKS_FILE)
        missing = [n for n in names if n not in reference]
        if missing:
            raise LFWDataError(
                f"{data_dir / LANDMARKS_FILE} has no landmarks for {len(missing)} images, e.g. {missing[0]}"
            )
    else:
        points, _, _ = detected_lfw_landmarks(
            data_dir, names, cache_dir=cache_dir, providers=providers, workers=workers, progress=progress
        )
        reference = dict(zip(names, points, strict=True))
    template = SPHEREFACE_TEMPLATE_112x96

    def work(name: str) -> np.ndarray:
        return align_face(read_image(data_dir / IMAGES_DIR / name), reference[name], template)

    crops = np.empty((len(names), template.height, template.width, 3), dtype=np.uint8)
    stream = _ordered_map(work, names, workers, window=256)
    for i, crop in enumerate(_progress(stream, len(names), "LFW crops", progress)):
        crops[i] = crop
    return crops, names, pairs


def pair_features(
    features: np.ndarray, names: Sequence[str], pairs: LFWPairs
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``features`` (one per name) for the left and right image of every pair."""
    index = {name: i for i, name in enumerate(names)}
    return features[[index[n] for n in pairs.left]], features[[index[n] for n in pairs.right]]
