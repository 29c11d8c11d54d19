"""Face verification metrics: the SphereFace LFW 10-fold protocol, ROC curves and the true-accept
rate at a false-accept rate (pure numpy).

The protocol is the one of the SphereFace test code (``test/code/evaluation.m``; SphereFace
thesis §2.3.6, "Testing"):

* ``pairs.txt`` (View 2): 6,000 pairs in 10 folds of 300 same-person + 300 different-person pairs.
* For each test fold: ``mu`` = mean of all left and right features of the 9 *other* folds; subtract
  ``mu`` from every feature, L2-normalise, score = dot product.
* Threshold = mean of every threshold of the grid ``(-10000:10000)/10000`` that reaches the
  maximal accuracy on the 9 training folds, where accuracy = (#same with score > t + #different
  with score < t) / N (a score equal to the threshold is an error for both classes).
* Accuracy of that threshold on the held-out fold; the result is the mean over the 10 folds.

ROC data (and the thresholds at fixed false-accept rates) are computed on the cosine the service
returns: L2-normalised fused features, no mean subtraction.

The same fold loop also runs insightface's verification rule for its ``.bin`` sets
(:func:`insightface_10fold_accuracy`): pairs in 10 contiguous folds in file order, the squared L2
distance of L2-normalised flip-summed features, and as each fold's threshold the first of
``0, 0.01, ..., 3.99`` with the maximal training accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: The official threshold grid: -1, -0.9999, ..., 1 (20001 values), as ``(-10000:10000)/10000``.
THRESHOLD_GRID = np.arange(-10000, 10001, dtype=np.float64) / 10000.0

#: False-accept rates at which the ROC's true-accept rate is reported (when measurable).
REPORTED_FARS = (1e-1, 1e-2, 1e-3)

#: insightface's distance thresholds ``np.arange(0, 4, 0.01)`` (squared L2 distance of unit
#: vectors, 0 to 4), as scores: the negated distances, so that a higher score is a closer pair.
INSIGHTFACE_GRID = -np.arange(0, 4, 0.01)

#: How a fold's threshold is chosen among the grid values with the maximal training accuracy:
#: ``mean``: their mean (SphereFace's ``evaluation.m``); ``first``: the first in grid order
#: (insightface's ``argmax``).
THRESHOLD_RULES = ("mean", "first")


# --------------------------------------------------------------------------------------------
# The protocol
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
    scores: np.ndarray, is_same: np.ndarray, grid: np.ndarray = THRESHOLD_GRID, rule: str = "mean"
) -> tuple[float, float]:
    """The threshold with the maximal accuracy: by default the official rule, the mean of ALL grid
    thresholds that reach it; ``rule="first"``: the first of them in grid order.

    Returns:
        ``(threshold, accuracy at the maximum)``.
    """
    if len(scores) == 0:
        raise ValueError("no scores to choose a threshold from")
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"rule must be one of {THRESHOLD_RULES}, got {rule!r}")
    correct = grid_accuracies(scores, is_same, grid)
    best = correct.max()
    at_best = grid[correct == best]
    threshold = at_best.mean() if rule == "mean" else at_best[0]
    return float(threshold), float(best / len(scores))


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row of ``(N, D)`` ``x`` divided by its L2 norm (a zero row stays zero)."""
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
    fold_ids = _fold_ids(folds)
    # Per-fold sums, so each fold's training mean is (total - own) / count.
    fold_sums = np.stack([left[folds == k].sum(axis=0) + right[folds == k].sum(axis=0) for k in fold_ids])
    fold_counts = np.array([2 * np.count_nonzero(folds == k) for k in fold_ids])
    total_sum, total_count = fold_sums.sum(axis=0), fold_counts.sum()

    def scored_folds() -> Iterable[tuple[np.ndarray, np.ndarray]]:
        for i, k in enumerate(fold_ids):
            mu = (total_sum - fold_sums[i]) / (total_count - fold_counts[i]) if subtract_mean else 0.0
            yield folds == k, np.einsum("ij,ij->i", unit_rows(left - mu), unit_rows(right - mu))

    return _cross_validate(scored_folds(), is_same, grid, "mean")


def _fold_ids(folds: np.ndarray) -> np.ndarray:
    fold_ids = np.unique(folds)
    if len(fold_ids) < 2:
        raise ValueError("the protocol needs at least 2 folds")
    return fold_ids


def _cross_validate(
    scored_folds: Iterable[tuple[np.ndarray, np.ndarray]], is_same: np.ndarray, grid: np.ndarray, rule: str
) -> TenFoldResult:
    """For each ``(test mask, scores)``: the threshold chosen on the other pairs (``rule``), and its
    accuracy on the test pairs; the mean over the folds (std with ddof=1)."""
    accuracies, thresholds, train_accuracies = [], [], []
    for test, scores in scored_folds:
        train = ~test
        threshold, train_accuracy = best_threshold(scores[train], is_same[train], grid, rule)
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


def contiguous_folds(n_pairs: int, n_folds: int = 10) -> np.ndarray:
    """Fold label of each of ``n_pairs`` pairs split in file order into ``n_folds`` contiguous
    folds, the first ``n_pairs % n_folds`` one pair longer (scikit-learn's unshuffled ``KFold``,
    which insightface's verification uses)."""
    if not 2 <= n_folds <= n_pairs:
        raise ValueError(f"need 2 <= n_folds <= n_pairs, got {n_folds} folds of {n_pairs} pairs")
    sizes = np.full(n_folds, n_pairs // n_folds)
    sizes[: n_pairs % n_folds] += 1
    return np.repeat(np.arange(n_folds), sizes)


def cross_validated_accuracy(
    scores: np.ndarray, is_same: np.ndarray, folds: np.ndarray, grid: np.ndarray, rule: str
) -> TenFoldResult:
    """10-fold accuracy of scores that do not depend on the fold (higher = more likely the same
    person): each fold's threshold chosen on the other folds from ``grid`` by ``rule``."""
    scores = np.asarray(scores, dtype=np.float64)
    is_same = np.asarray(is_same, dtype=bool)
    folds = np.asarray(folds)
    if scores.ndim != 1 or is_same.shape != scores.shape or folds.shape != scores.shape:
        raise ValueError("scores, is_same and folds must be three (P,) arrays")
    fold_ids = _fold_ids(folds)
    return _cross_validate(((folds == k, scores) for k in fold_ids), is_same, np.asarray(grid), rule)


def insightface_10fold_accuracy(
    features_left: np.ndarray, features_right: np.ndarray, is_same: np.ndarray, folds: np.ndarray
) -> TenFoldResult:
    """insightface's verification accuracy (its ``eval/verification.py``, ``evaluate``).

    Args:
        features_left, features_right: ``(P, D)`` features of the two faces of each pair, each the
            sum of the network's outputs for the face and its mirror (not yet normalised).
        folds: ``(P,)`` fold labels (insightface: :func:`contiguous_folds`).

    The features are L2-normalised; a pair's score is minus the squared L2 distance (0 to 4), so
    thresholds, reported in :class:`TenFoldResult` as scores, are minus insightface's distances.
    insightface accepts a pair when its distance is below the threshold and rejects it otherwise;
    here a pair exactly at the threshold is an error either way, which can differ only on an exact
    tie with one of the 400 grid values.
    """
    left = unit_rows(np.asarray(features_left, dtype=np.float64))
    right = unit_rows(np.asarray(features_right, dtype=np.float64))
    if left.ndim != 2 or left.shape != right.shape:
        raise ValueError(f"features must be two (P, D) arrays of one shape, got {left.shape}, {right.shape}")
    scores = -np.sum(np.square(left - right), axis=1)
    return cross_validated_accuracy(scores, is_same, folds, INSIGHTFACE_GRID, "first")


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
