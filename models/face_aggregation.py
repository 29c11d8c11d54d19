"""A subject's score from the cosines of all its faces, optionally weighted by their quality.

Shared by the service's identification and by the LFW study that chose among them
(``python -m training.evaluation.quality_results``, docs/results/quality.md).
"""

from __future__ import annotations

import numpy as np

#: ``max``: the best face's cosine; ``mean``: the mean cosine; ``quality-mean``: the mean
#: weighted by each face's quality; ``quality-max``: the best cosine after each is pulled
#: towards the subject's mean as its face's quality falls (``q * cos + (1 - q) * mean``).
SUBJECT_AGGREGATIONS = ("max", "mean", "quality-mean", "quality-max")


def subject_score(cosines: np.ndarray, qualities: np.ndarray | None, how: str) -> np.ndarray:
    """The subject's score for each query from ``cosines`` ``(queries, faces)`` (cosines in
    [-1, 1] of the queries with the subject's faces) and ``qualities`` ``(faces,)`` in [0, 1]
    (None, or NaN for a face without one: counted as 1). Returns ``(queries,)`` in [-1, 1]."""
    cosines = np.atleast_2d(np.asarray(cosines, dtype=np.float64))
    if how == "max":
        return cosines.max(axis=1)
    mean = cosines.mean(axis=1)
    if how == "mean":
        return mean
    q = np.ones(cosines.shape[1]) if qualities is None else np.asarray(qualities, dtype=np.float64)
    q = np.clip(np.where(np.isnan(q), 1.0, q), 1e-6, 1.0)
    if how == "quality-mean":
        return cosines @ q / q.sum()
    if how == "quality-max":
        return (q * cosines + (1 - q) * mean[:, None]).max(axis=1)
    raise ValueError(f"unknown aggregation {how!r}; choose one of {SUBJECT_AGGREGATIONS}")
