"""Geometry metrics of features and classifier neurons (numpy only, no torch).

* :func:`angular_fisher_score` -- Angular Fisher Score of Eq. A.1 (lower = more discriminative).
* :func:`hyperspherical_energy` -- normalised hyperspherical energy ``E_s / (N (N-1))`` (Eq. 5.1,
  per-layer normalisation of Eq. 5.4), the same quantity as ``training.losses.mhe_energy``.
* :func:`neuron_angles` -- minimum / mean pairwise angle between neurons, in degrees.

The energy and the angles are computed in float64 and in row chunks, so a 10k-class classifier
needs only a few tens of MB of scratch memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

MHE_EPS = 1e-6
"""Added to the squared distance inside the energy kernel; equal to ``training.losses.MHE_EPS``."""

_CHUNK_ELEMENTS = 1 << 22  # entries of one (rows x N) block of dot products (32 MB in float64)


def _unit_rows(array: np.ndarray) -> np.ndarray:
    x = np.asarray(array, dtype=np.float64)
    x = x.reshape(x.shape[0], -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def _row_blocks(n: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, n, step):
        yield start, min(n, start + step)


def angular_fisher_score(features: np.ndarray, labels: np.ndarray) -> float:
    """Angular Fisher Score ``AFS = S_w / S_b`` of Eq. A.1 (lower = more discriminative, >= 0).

    ``features``: (N, D), ``labels``: (N,) class ids (any hashable numeric values), at least two
    classes. ``S_w = sum_i sum_{x in X_i} (1 - cos<x, m_i>)`` and
    ``S_b = sum_i n_i (1 - cos<m_i, m>)``, with ``m_i`` the mean of class i and ``m`` the global mean.

    The papers do not say whether features are normalised before the means are taken; here every
    feature is L2-normalised first, so ``m_i`` and ``m`` are means of unit vectors (each sample has
    the same weight whatever its norm, consistent with a score that only looks at angles). The
    cosines themselves do not depend on that choice, only the means do.
    """
    x = _unit_rows(features)
    y = np.asarray(labels).reshape(-1)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"features and labels disagree: {x.shape[0]} vs {y.shape[0]} samples")
    classes, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    if classes.shape[0] < 2:
        raise ValueError("the angular Fisher score needs at least two classes")
    sums = np.zeros((classes.shape[0], x.shape[1]))
    np.add.at(sums, inverse, x)
    class_means = sums / counts[:, None]  # m_i
    global_mean = x.mean(axis=0)  # m
    unit_class_means = _unit_rows(class_means)
    # Eq. A.1 within-class scatter: 1 - cos<x, m_i>
    s_w = float(np.sum(1.0 - np.einsum("nd,nd->n", x, unit_class_means[inverse])))
    unit_global = global_mean / max(float(np.linalg.norm(global_mean)), 1e-12)
    # Eq. A.1 between-class scatter: n_i (1 - cos<m_i, m>)
    s_b = float(np.sum(counts * (1.0 - unit_class_means @ unit_global)))
    return s_w / s_b


def hyperspherical_energy(
    weights: np.ndarray, power: int = 2, distance: str = "euclidean", half_space: bool = False
) -> float:
    """Normalised hyperspherical energy ``E_s / (N (N-1))`` of the rows of ``weights`` (N, D).

    Rows are L2-normalised; ``power`` is s >= 0 with ``f_s(d) = d^-s`` (s > 0) or ``log(1/d)``
    (s = 0) (Eq. 5.1); the Euclidean distance is ``sqrt(||w_i - w_j||^2 + 1e-6)`` and the angular
    one ``arccos`` of the dot product clamped to ``[-1 + 1e-6, 1 - 1e-6]`` (Eq. 5.5), exactly as
    ``training.losses.mhe_energy``. ``half_space`` adds the rows ``-w_i`` (2N points). Each neuron
    may be a flattened kernel of any shape ``(N, ...)``. Returns 0.0 when N < 2.
    """
    if power < 0:
        raise ValueError(f"power must be >= 0, got {power}")
    if distance not in ("euclidean", "angular"):
        raise ValueError(f"distance must be 'euclidean' or 'angular', got {distance!r}")
    w = _unit_rows(weights)
    if half_space:
        w = np.concatenate([w, -w], axis=0)
    n = w.shape[0]
    if n < 2:
        return 0.0
    total = 0.0
    for start, stop in _row_blocks(n):
        cos = w[start:stop] @ w.T
        if distance == "euclidean":
            sq = np.maximum(2.0 - 2.0 * cos, 0.0) + MHE_EPS
            kernel = -0.5 * np.log(sq) if power == 0 else sq ** (-0.5 * power)
        else:
            theta = np.arccos(np.clip(cos, -1.0 + MHE_EPS, 1.0 - MHE_EPS))
            kernel = -np.log(theta) if power == 0 else theta ** (-float(power))
        rows = np.arange(stop - start)
        kernel[rows, start + rows] = 0.0  # i != j
        total += float(kernel.sum())
    return total / (n * (n - 1))  # Eq. 5.1 normalised as in Eq. 5.4


def neuron_angles(weights: np.ndarray) -> dict[str, float]:
    """Pairwise angles between the rows of ``weights`` (N >= 2, D), in degrees in [0, 180].

    Returns ``{"min_deg": smallest angle over pairs i != j, "mean_deg": mean angle over pairs,
    "nearest_mean_deg": mean over neurons of the angle to their nearest other neuron}``.
    """
    w = _unit_rows(weights)
    n = w.shape[0]
    if n < 2:
        raise ValueError("neuron_angles needs at least two neurons")
    angle_sum = 0.0
    nearest = np.empty(n)
    for start, stop in _row_blocks(n):
        angles = np.degrees(np.arccos(np.clip(w[start:stop] @ w.T, -1.0, 1.0)))
        rows = np.arange(stop - start)
        angles[rows, start + rows] = 0.0
        angle_sum += float(angles.sum())
        angles[rows, start + rows] = np.inf
        nearest[start:stop] = angles.min(axis=1)
    return {
        "min_deg": float(nearest.min()),
        "mean_deg": angle_sum / (n * (n - 1)),
        "nearest_mean_deg": float(nearest.mean()),
    }
