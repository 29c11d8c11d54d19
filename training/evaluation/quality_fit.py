"""Fit the face quality score on LFW and measure it: error-versus-reject curves at a fixed false
match rate, for the combined score and for each ingredient alone, and the enrollment floor.

The score is a logistic model of "this genuine pair matches at the threshold for a false match
rate of 1e-3" whose log-odds is a sum over the pair's two faces (:mod:`models.quality`): fitted on
the genuine pairs of LFW's photos and of degraded copies (:mod:`training.evaluation.quality_lfw`),
cross-validated over two folds of people for every number reported, then fitted on all of them
for the weights shipped. Every pair is weighted ``1 / (photos of the person - 1)``, so each photo
counts alike (a person with 530 photos would otherwise hold most pairs).

    python -m training.evaluation.quality_results --model default --lfw ../shared/data/lfw
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from models.quality import FEATURE_RANGES, FEATURES, QualityModel, quality_features

#: The ingredients compared alone, each with the features it uses.
INGREDIENTS: dict[str, tuple[str, ...]] = {
    "detection score": ("detection",),
    "face size": ("size",),
    "sharpness": ("sharpness",),
    "pose": ("yaw", "pitch", "roll"),
    "embedding norm": ("norm",),
    "combined": FEATURES,
}
#: Fractions of pairs rejected where the curves are read.
REJECT_GRID = np.round(np.arange(0.0, 0.301, 0.01), 2)


def feature_matrix(records: dict[str, np.ndarray]) -> np.ndarray:
    """``(n, len(FEATURES))`` raw ingredients of every record (:func:`models.quality.quality_features`)."""
    norms = np.linalg.norm(records["raw"].astype(np.float64), axis=1)
    rows = [
        quality_features(score, box, points, grey, norm)
        for score, box, points, grey, norm in zip(
            records["score"], records["box"], records["landmarks"], records["gray"], norms, strict=True
        )
    ]
    return np.array([[row[name] for name in FEATURES] for row in rows])


def clip_features(x: np.ndarray) -> np.ndarray:
    low = np.array([FEATURE_RANGES[n][0] for n in FEATURES])
    high = np.array([FEATURE_RANGES[n][1] for n in FEATURES])
    return np.clip(x, low, high)


@dataclass
class Pairs:
    """Genuine pairs: record indices ``a``, ``b``, cosine ``score``, weight ``weight``, and
    ``degraded``: True when one face is a degraded copy."""

    a: np.ndarray
    b: np.ndarray
    score: np.ndarray
    weight: np.ndarray
    degraded: np.ndarray

    def take(self, keep: np.ndarray) -> Pairs:
        return Pairs(self.a[keep], self.b[keep], self.score[keep], self.weight[keep], self.degraded[keep])


def genuine_pairs(records: dict[str, np.ndarray]) -> Pairs:
    """Every pair of two original photos of one person, and every degraded copy with each original
    of its person's other photos."""
    unit = records["raw"] / np.linalg.norm(records["raw"], axis=1, keepdims=True)
    variant, identity, image = records["variant"], records["identity"], records["image"]
    originals: dict[int, list[int]] = {}
    for i in np.flatnonzero(variant == 0):
        originals.setdefault(int(identity[i]), []).append(int(i))
    a_list, b_list = [], []
    for members in originals.values():
        if len(members) > 1:
            m = np.array(members)
            ia, ib = np.triu_indices(len(m), 1)
            a_list.append(m[ia])
            b_list.append(m[ib])
    for d in np.flatnonzero(variant > 0):
        others = [j for j in originals[int(identity[d])] if image[j] != image[d]]
        a_list.append(np.full(len(others), d))
        b_list.append(np.array(others, dtype=np.int64))
    a, b = np.concatenate(a_list), np.concatenate(b_list)
    counts = {k: len(v) for k, v in originals.items()}
    n = np.array([counts[int(k)] for k in identity[a]])
    score = np.einsum("ij,ij->i", unit[a], unit[b])
    return Pairs(a, b, score, 1.0 / np.maximum(n - 1, 1), variant[a] > 0)


def fit_logistic(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float = 1e-2, iters: int = 50
) -> np.ndarray:
    """Weighted logistic regression by Newton's method: ``[intercept, *weights]`` for ``x`` (n, d)."""
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-9
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
    beta = np.zeros(z.shape[1])
    penalty = l2 * np.eye(z.shape[1]) * w.sum() / len(w)
    penalty[0, 0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ beta, -30, 30)))
        grad = z.T @ (w * (y - p)) - penalty @ beta
        hess = z.T @ (z * (w * p * (1 - p))[:, None]) + penalty
        step = np.linalg.solve(hess, grad)
        beta += step
        if np.abs(step).max() < 1e-8:
            break
    weights = beta[1:] / std
    return np.concatenate([[beta[0] - weights @ mean], weights])


def fit_pair_model(x: np.ndarray, pairs: Pairs, threshold: float, columns: Sequence[int]) -> np.ndarray:
    """``[b, *w]``: P(pair matches) = sigmoid(b + w . (x_a + x_b)) over the chosen feature columns."""
    cols = list(columns)
    design = x[pairs.a][:, cols] + x[pairs.b][:, cols]
    return fit_logistic(design, (pairs.score >= threshold).astype(np.float64), pairs.weight)


def person_folds(records: dict[str, np.ndarray], seed: int = 0) -> np.ndarray:
    """Fold 0 or 1 of every record, by person (seeded)."""
    people = int(records["identity"].max()) + 1
    fold_of_person = np.random.default_rng(seed).permutation(people) % 2
    return fold_of_person[records["identity"]]


def heldout_logits(
    x: np.ndarray,
    pairs: Pairs,
    folds: np.ndarray,
    threshold: float,
    columns: Sequence[int],
    reference: np.ndarray,
    scored: np.ndarray | None = None,
) -> np.ndarray:
    """Every record's single-face log-odds (its score's logit: the pair's with a typical original
    photo, the medians of LFW's originals, as the other face) under the model fitted on the other
    fold's people; ``scored``: other ingredients to score with the same models (default ``x``)."""
    cols = list(columns)
    scored = x if scored is None else scored
    out = np.zeros(len(x))
    pair_fold = folds[pairs.a]
    for fold in (0, 1):
        beta = fit_pair_model(x, pairs.take(pair_fold != fold), threshold, cols)
        rows = folds == fold
        out[rows] = beta[0] + beta[1:] @ reference[cols] + scored[rows][:, cols] @ beta[1:]
    return out


def edc_curve(pair_quality: np.ndarray, pairs: Pairs, threshold: float, grid=REJECT_GRID) -> np.ndarray:
    """False non-match rate (weighted) at ``threshold`` after rejecting the ``grid`` fractions of
    pair weight with the lowest ``pair_quality`` (error versus reject)."""
    order = np.argsort(pair_quality, kind="stable")
    w = pairs.weight[order]
    miss = (pairs.score[order] < threshold) * w
    rejected = np.concatenate([[0.0], np.cumsum(w)]) / w.sum()
    miss_left = miss.sum() - np.concatenate([[0.0], np.cumsum(miss)])
    weight_left = w.sum() - np.concatenate([[0.0], np.cumsum(w)])
    cut = np.searchsorted(rejected, grid, side="left")
    return miss_left[cut] / np.maximum(weight_left[cut], 1e-12)


def heldout_scores(
    x: np.ndarray, pairs: Pairs, folds: np.ndarray, threshold: float, reference: np.ndarray
) -> dict[str, np.ndarray]:
    """Held-out log-odds of every record for every ingredient alone and combined
    (:data:`INGREDIENTS`), and ``combined without the norm`` (the norm held at its reference:
    what a model other than the fitted one gets)."""
    out = {
        label: heldout_logits(x, pairs, folds, threshold, [FEATURES.index(n) for n in names], reference)
        for label, names in INGREDIENTS.items()
    }
    k = FEATURES.index("norm")
    held = x.copy()
    held[:, k] = reference[k]
    out["combined, norm left out"] = heldout_logits(
        x, pairs, folds, threshold, range(len(FEATURES)), reference, scored=held
    )
    return out


def curves_of(
    scores: dict[str, np.ndarray], pairs: Pairs, threshold: float
) -> dict[str, dict[str, list[float]]]:
    """Error-versus-reject curves (pair quality: the worse face's) of every score, on the pairs of
    original photos and on all pairs (degraded copies included)."""
    curves: dict[str, dict[str, list[float]]] = {"original photos": {}, "with degraded copies": {}}
    clean = pairs.take(~pairs.degraded)
    for label, logits in scores.items():
        for part, subset in (("original photos", clean), ("with degraded copies", pairs)):
            quality = np.minimum(logits[subset.a], logits[subset.b])
            curves[part][label] = edc_curve(quality, subset, threshold).round(5).tolist()
    return curves


def prepared_features(records: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
    """The ingredients as the score weighs them: the norm's log centred on the median of LFW's
    original photos (returned as ``norm_scale``), every column clipped (``FEATURE_RANGES``)."""
    x = feature_matrix(records)
    k = FEATURES.index("norm")
    centre = float(np.median(x[records["variant"] == 0, k]))
    x[:, k] -= centre
    return clip_features(x), float(np.exp(centre))


def final_model(
    x: np.ndarray, pairs: Pairs, threshold: float, variant: np.ndarray, model_id: str, norm_scale: float
) -> QualityModel:
    """The shipped weights: fitted on every pair (``x`` from :func:`prepared_features`); the
    intercept makes a face's score its match probability against a typical original photo (the
    medians of LFW's originals)."""
    beta = fit_pair_model(x, pairs, threshold, range(len(FEATURES)))
    reference = np.median(x[variant == 0], axis=0)
    weights = beta[1:]
    return QualityModel(
        intercept=round(float(beta[0] + weights @ reference), 5),
        weights={n: round(float(v), 5) for n, v in zip(FEATURES, weights, strict=True)},
        reference={n: round(float(v), 4) for n, v in zip(FEATURES, reference, strict=True)},
        norm_model=model_id,
        norm_scale=round(norm_scale, 5),
        fitted_on="LFW (13,233 photos and 4,594 degraded copies), genuine pairs at FMR 1e-3",
    )
