"""Several photos per person: which subject score identifies best, measured on LFW.

Gallery: every person of LFW with at least 4 photos, enrolled with 3 of them (chosen per seed);
mated probes: their other photos; non-mated probes: every photo of the people with fewer than 4
(not enrolled). A subject's score for a probe is one of :data:`AGGREGATIONS` over the cosines of
its enrolled faces. Reported: rank-1 of the mated probes, and the false non-identification rate
at a false positive identification rate of 1e-2 and 1e-3 (each aggregation gets its own
threshold from the non-mated probes' best scores, so the scales of max and mean do not matter).
Two galleries: the original photos, and the same with each photo that has a degraded copy
enrolled as that copy (some enrolled faces are poor, as in real galleries).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models.face_aggregation import SUBJECT_AGGREGATIONS as AGGREGATIONS
from models.face_aggregation import subject_score

GALLERY_PHOTOS = 3
FPIRS = (1e-2, 1e-3)


def subject_scores(
    cosines: np.ndarray, owner: np.ndarray, quality: np.ndarray, how: str, n: int
) -> np.ndarray:
    """``(probes, n)`` subject scores (:func:`models.face_aggregation.subject_score`) from
    ``(probes, faces)`` cosines; ``owner``: each face's subject (0..n-1); ``quality``: each
    face's quality in [0, 1]."""
    out = np.empty((len(cosines), n))
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(n + 1))
    for subject in range(n):
        faces = order[bounds[subject] : bounds[subject + 1]]
        out[:, subject] = subject_score(cosines[:, faces], quality[faces], how)
    return out


def split(records: dict[str, np.ndarray], seed: int, degraded_gallery: bool):
    """Record indices of the gallery faces (and their subject 0..n-1), the mated probes (and
    their subject) and the non-mated probes, for one seed."""
    rng = np.random.default_rng(seed)
    variant, identity, image = records["variant"], records["identity"], records["image"]
    original = np.flatnonzero(variant == 0)
    copy_of = {int(image[i]): int(i) for i in np.flatnonzero(variant > 0)}
    by_person: dict[int, list[int]] = {}
    for i in original:
        by_person.setdefault(int(identity[i]), []).append(int(i))
    gallery, owner, mated, mated_owner, non_mated = [], [], [], [], []
    for _, members in sorted(by_person.items()):
        if len(members) < GALLERY_PHOTOS + 1:
            non_mated += members
            continue
        subject = len(set(owner))
        chosen = rng.permutation(members)
        for i in chosen[:GALLERY_PHOTOS]:
            gallery.append(copy_of.get(int(image[i]), int(i)) if degraded_gallery else int(i))
            owner.append(subject)
        mated += [int(i) for i in chosen[GALLERY_PHOTOS:]]
        mated_owner += [subject] * (len(chosen) - GALLERY_PHOTOS)
    return (np.array(gallery), np.array(owner), np.array(mated), np.array(mated_owner), np.array(non_mated))


def identification_metrics(
    records: dict[str, np.ndarray], quality: np.ndarray, seed: int, degraded_gallery: bool
) -> dict[str, dict[str, float]]:
    """Rank-1 and FNIR at :data:`FPIRS` of every aggregation for one seed's split."""
    unit = records["raw"] / np.linalg.norm(records["raw"], axis=1, keepdims=True)
    gallery, owner, mated, mated_owner, non_mated = split(records, seed, degraded_gallery)
    n = int(owner.max()) + 1
    results = {}
    for how in AGGREGATIONS:
        mated_scores = subject_scores(unit[mated] @ unit[gallery].T, owner, quality[gallery], how, n)
        others = subject_scores(unit[non_mated] @ unit[gallery].T, owner, quality[gallery], how, n)
        other_best = others.max(axis=1)
        own = mated_scores[np.arange(len(mated)), mated_owner]
        rank1 = float(np.mean(mated_scores.argmax(axis=1) == mated_owner))
        row = {"rank1": rank1, "subjects": n, "mated_probes": len(mated), "non_mated_probes": len(non_mated)}
        for fpir in FPIRS:
            threshold = float(np.quantile(other_best, 1 - fpir))
            # A mated probe is identified when its own subject is best and reaches the threshold.
            found = (mated_scores.argmax(axis=1) == mated_owner) & (own > threshold)
            row[f"fnir_at_fpir_{fpir:.0e}"] = float(1 - found.mean())
        results[how] = row
    return results


def aggregation_study(
    records: dict[str, np.ndarray], quality: np.ndarray, seeds: Sequence[int] = (0, 1, 2, 3, 4)
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """:func:`identification_metrics` over ``seeds`` for both galleries: per gallery, aggregation
    and metric, ``[min, median, max]`` over the seeds, and each seed's value (``<metric>_per_seed``,
    in the order of ``seeds``: the splits are the same for every aggregation, so they pair)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for label, degraded in (("original photos", False), ("with degraded copies", True)):
        runs = [identification_metrics(records, quality, seed, degraded) for seed in seeds]
        out[label] = {}
        for how in AGGREGATIONS:
            out[label][how] = {}
            for metric in runs[0][how]:
                values = np.array([r[how][metric] for r in runs])
                out[label][how][metric] = [round(float(f(values)), 5) for f in (np.min, np.median, np.max)]
                out[label][how][f"{metric}_per_seed"] = values.round(5).tolist()
    return out
