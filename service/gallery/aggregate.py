"""Identification that scores a subject by all its faces: the nearest subjects of a search (by
their best face) re-ranked by the mean, or the quality-weighted mean or max, of the cosines of
every face they have for the served model (:mod:`models.face_aggregation`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from models.face_aggregation import subject_score
from service.gallery.index import SubjectHit
from service.gallery.store import FaceRecord

#: Subjects re-ranked per subject asked for (the nearest by their best face).
SHORTLIST_FACTOR = 4


def shortlist_size(k: int) -> int:
    return max(k * SHORTLIST_FACTOR, 20)


def rerank(
    queries: np.ndarray,
    shortlists: Sequence[list[SubjectHit]],
    faces_of: Callable[[list[str]], dict[str, list[FaceRecord]]],
    how: str,
    k: int,
) -> list[list[SubjectHit]]:
    """The top ``k`` subjects of each query by ``how``, among its shortlist; each hit names the
    subject's best-matching face. ``faces_of(subject_ids)``: each subject's faces of the served
    model with their embeddings (one call for every subject of every shortlist)."""
    wanted = sorted({hit.subject_id for hits in shortlists for hit in hits})
    known = {subject_id: _arrays(faces) for subject_id, faces in faces_of(wanted).items()}
    answers = []
    for query, hits in zip(queries, shortlists, strict=True):
        scored = []
        for hit in hits:
            ids, vectors, qualities = known.get(hit.subject_id) or _arrays([])
            if not ids:
                continue  # deleted since the search
            cosines = vectors @ np.asarray(query, dtype=np.float32)
            score = float(np.clip(subject_score(cosines[None], qualities, how)[0], -1.0, 1.0))
            scored.append(SubjectHit(hit.subject_id, score, ids[int(cosines.argmax())]))
        answers.append(sorted(scored, key=lambda h: -h.score)[:k])
    return answers


def _arrays(faces: list[FaceRecord]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The ids, unit embeddings and qualities (NaN where unknown) of a subject's faces."""
    faces = [f for f in faces if f.embedding is not None]
    if not faces:
        return [], np.zeros((0, 1), np.float32), np.zeros(0)
    return (
        [f.id for f in faces],
        np.stack([f.embedding for f in faces]).astype(np.float32),
        np.array([np.nan if f.quality is None else f.quality for f in faces]),
    )
