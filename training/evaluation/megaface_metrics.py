"""MegaFace Challenge 1 numbers from a search: identification (rank-1, rank-10, CMC) and
verification (TAR at FAR, ROC points) per distractor count and variant."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from training.evaluation.megaface_search import VERIFICATION_FARS, SearchResult
from training.evaluation.verification import false_accepts_allowed, far_label


def identity_groups(identities: Sequence[str]) -> list[np.ndarray]:
    """Row indices of each identity with at least two images (in first-seen order)."""
    groups: dict[str, list[int]] = {}
    for i, ident in enumerate(identities):
        groups.setdefault(ident, []).append(i)
    return [np.array(g) for g in groups.values() if len(g) >= 2]


def genuine_scores(features: np.ndarray, groups: Sequence[np.ndarray]) -> np.ndarray:
    """Cosine of every unordered pair of images of one identity."""
    out = []
    for g in groups:
        block = features[g] @ features[g].T
        out.append(block[np.triu_indices(len(g), k=1)])
    return np.concatenate(out) if out else np.empty(0, np.float32)


def search_ranks(features: np.ndarray, groups: Sequence[np.ndarray], top: np.ndarray) -> np.ndarray:
    """Distractors that beat the genuine match, for every search ``(probe p, gallery g)`` of the
    MegaFace rule (``p != g``, same identity); ``top`` holds each row's ``k`` best distractor
    scores (descending), so the count saturates at ``k`` (rank > k)."""
    out = []
    for g in groups:
        genuine = features[g] @ features[g].T  # [p, gallery]
        beaten = (top[g][:, None, :] > genuine[:, :, None]).sum(axis=2)
        out.append(beaten[~np.eye(len(g), dtype=bool)])
    return np.concatenate(out) if out else np.empty(0, np.int64)


def threshold_at_far(impostor_desc: np.ndarray, n_impostor: int, far: float) -> float | None:
    """The ``(k+1)``-th highest impostor score, ``k = floor(far * n_impostor)``, from the highest
    impostor scores in descending order; None when ``far * n_impostor < 1``."""
    allowed = false_accepts_allowed(far, n_impostor)
    if allowed is None or allowed >= len(impostor_desc):
        return None
    return float(impostor_desc[allowed])


def verification_at(
    genuine: np.ndarray, impostor_desc: np.ndarray, n_impostor: int, fars: Sequence[float] = VERIFICATION_FARS
) -> dict[str, Any]:
    tar, thresholds = {}, {}
    for far in fars:
        t = threshold_at_far(impostor_desc, n_impostor, far)
        tar[far_label(far)] = None if t is None else float(np.mean(genuine > t))
        thresholds[far_label(far)] = t
    return {
        "n_genuine": int(len(genuine)),
        "n_impostor": int(n_impostor),
        "tar_at_far": tar,
        "threshold_at_far": thresholds,
    }


def roc_points(
    genuine: np.ndarray, impostor_desc: np.ndarray, n_impostor: int, points: int = 200
) -> dict[str, list]:
    """(FAR, TAR) at thresholds taken from the kept impostor scores, log-spaced in FAR."""
    if len(impostor_desc) < 2 or len(genuine) == 0:
        return {"far": [], "tar": []}
    ks = np.unique(np.geomspace(1, len(impostor_desc) - 1, points).astype(np.int64))
    thresholds = impostor_desc[ks]
    ordered = np.sort(genuine)
    tar = 1.0 - np.searchsorted(ordered, thresholds, side="right") / len(ordered)
    return {"far": (ks / n_impostor).tolist(), "tar": tar.tolist()}


def summarise(
    features: np.ndarray,
    identities: Sequence[str],
    result: SearchResult,
    fars: Sequence[float] = VERIFICATION_FARS,
) -> dict[str, Any]:
    """Identification (rank-1, rank-10, CMC) and verification per size, for every variant."""
    out: dict[str, Any] = {}
    for name, snapshots in result.variants.items():
        rows = result.rows[name]
        sub = features[rows]
        groups = identity_groups([identities[i] for i in rows])
        genuine = genuine_scores(sub, groups)
        ident, verif, cmc, roc = {}, {}, {}, {}
        for size in result.sizes:
            top, impostor = snapshots[size]
            beaten = search_ranks(sub, groups, top)
            k = top.shape[1]
            ranks = np.bincount(np.minimum(beaten, k), minlength=k + 1)[:k]
            curve = np.cumsum(ranks) / max(len(beaten), 1)
            ident[str(size)] = {
                "rank1": float(curve[0]),
                "rank10": float(curve[min(9, k - 1)]),
                "searches": int(len(beaten)),
            }
            cmc[str(size)] = curve.tolist()
            n_imp = len(rows) * size
            verif[str(size)] = verification_at(genuine, impostor, n_imp, fars)
            roc[str(size)] = roc_points(genuine, impostor, n_imp)
        out[name] = {
            "probe_images": int(len(rows)),
            "identities": len(groups),
            "identification": ident,
            "verification": verif,
            "cmc": cmc,
            "roc": roc,
        }
    return out
