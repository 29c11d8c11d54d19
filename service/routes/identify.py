"""Identification: who in the gallery is each face of a photo?"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool

from models.mtcnn import DetectedFace
from models.quality import FaceQuality
from service.auth import require_read
from service.errors import ServiceError
from service.events.stream import IDENTIFICATION, EventStream
from service.gallery.aggregate import rerank, shortlist_size
from service.gallery.index import SubjectHit
from service.gallery.store import check_embedding
from service.routes.common import (
    FaceWork,
    StrictRoute,
    face_schema,
    form_files,
    get_face_work,
    openapi_body,
    read_body,
)
from service.routes.unknowns import keep_unknown_faces
from service.schemas import Candidate, ErrorResponse, FaceEmbeddings, IdentifiedFace, IdentifyResponse

Aggregation = Literal["max", "mean", "quality-mean", "quality-max"]
ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 413, 415, 422, 503)}
router = APIRouter(
    tags=["identify"], responses=ERRORS, dependencies=[Depends(require_read)], route_class=StrictRoute
)


class NoThresholdError(ServiceError):
    code = "no_threshold"


@router.post(
    "/identify",
    operation_id="identify",
    response_model=IdentifyResponse,
    summary="Who is this? Top-k gallery subjects for every face of a photo",
    openapi_extra=openapi_body({"photo": "a photo"}, FaceEmbeddings),
)
async def identify(
    request: Request,
    work: Annotated[FaceWork, Depends(get_face_work)],
    k: Annotated[
        int | None, Query(ge=1, le=100, description="subjects per face (default: server setting)")
    ] = None,
    faces: Annotated[
        Literal["all", "largest", "central", "reject"],
        Query(
            description="which faces of the photo to identify (reject: a photo of several faces is an error)"
        ),
    ] = "all",
    threshold: Annotated[
        float | None,
        Query(ge=-1, le=1, description="cosine threshold instead of the model's identification threshold"),
    ] = None,
    aggregation: Annotated[
        Aggregation | None,
        Query(
            description="a subject's score from its faces: max (its best face), mean, quality-mean "
            "(weighted by each face's quality) or quality-max (default: SPHEREFACE_IDENTIFY_AGGREGATION)"
        ),
    ] = None,
    source: Annotated[
        str | None,
        Query(
            max_length=128,
            description="where the photo comes from (a camera, an app), kept with unknown faces",
        ),
    ] = None,
) -> IdentifyResponse:
    """Send a photo (multipart field `photo`) or embeddings of this model (JSON
    `{"embeddings": [[...], ...]}`). For every face: the top-k subjects by the cosine of their
    best-matching face (or by all their faces: `aggregation`), and `status` `known` (the best
    subject reaches the threshold) or `unknown`. The threshold is the model's `identification`
    threshold (calibrated for a false-accept rate of 1e-4 per comparison), else its
    `verification` one. With `SPHEREFACE_KEEP_UNKNOWN=true` each `unknown` face of a photo is
    kept and clustered: it gets `unknown_face_id` and `cluster_id` (see `/v1/unknowns/clusters`)."""
    body = await read_body(request, FaceEmbeddings, max_files=1)
    chosen = chosen_threshold(work, threshold)
    k = k or work.settings.identify_top_k
    manifest = work.pipeline.manifest
    state = request.app.state
    photo = None
    if isinstance(body, FaceEmbeddings):
        vectors = await run_in_threadpool(_checked, body.embeddings, manifest.output_size)
        detected = [None] * len(vectors)
    else:
        upload = form_files(body, "photo")[0]
        regions = state.unknowns is not None and work.settings.store_face_images
        photo, vectors = await work.in_turn(_detect_and_embed, work, upload, faces, regions)
        detected = list(zip(photo.faces, photo.qualities, strict=True))
    how = aggregation or work.settings.identify_aggregation
    results, names, searched = await work.off_turn(_search, state, work, vectors, k, how)
    answer = IdentifyResponse(
        model_id=manifest.model_id,
        threshold=chosen[0],
        threshold_far=chosen[1],
        threshold_source=chosen[2],
        k=k,
        gallery_faces=searched,
        faces=[
            _identified(face, hits, names, chosen[0]) for face, hits in zip(detected, results, strict=True)
        ],
    )
    if state.unknowns is not None and photo is not None:
        await work.off_turn(keep_unknown_faces, state.unknowns, answer, photo, vectors, source or "identify")
    events: EventStream = state.events
    if events.identification:
        await work.off_turn(events.emit, IDENTIFICATION, identification_data(answer))
    return answer


def identification_data(answer: IdentifyResponse) -> dict:
    """The ``identification`` event's data: per face its status, subject and candidates' ids and
    scores (no embeddings, no images, no boxes)."""
    return {
        "model": answer.model_id,
        "threshold": answer.threshold,
        "faces": [
            {
                "status": face.status,
                "subject_id": face.subject_id,
                "score": face.score,
                "candidates": [{"subject_id": c.subject_id, "score": c.score} for c in face.candidates],
            }
            for face in answer.faces
        ],
    }


def chosen_threshold(work: FaceWork, threshold: float | None) -> tuple[float, float | None, str | None]:
    """The cosine threshold (value, false-accept rate, source): the request's, else the model's
    identification threshold, else its verification one (422 ``no_threshold`` without any)."""
    if threshold is not None:
        return threshold, None, "request"
    manifest = work.pipeline.manifest
    known = manifest.thresholds.get("identification") or manifest.thresholds.get("verification")
    if known is None:
        raise NoThresholdError(
            f"model {manifest.model_id} has no calibrated threshold: pass ?threshold=<cosine>"
        )
    return known.value, known.far, known.source


def _checked(embeddings: list[list[float]], dim: int) -> np.ndarray:
    """Client embeddings as unit vectors of the model's size (422 ``invalid_embedding``)."""
    return np.stack([check_embedding(v, dim) for v in embeddings])


def _detect_and_embed(work: FaceWork, upload, policy: str, regions: bool):
    """The faces of one photo (with the region around each when ``regions``) and their embeddings
    (a face-path turn's work: no Redis)."""
    photo = work.detect(upload, policy, regions=regions)
    return photo, work.embed_photos([photo])


def _search(state, work: FaceWork, vectors: np.ndarray, k: int, how: str):
    """The top-k subjects of each face, the names of every subject found, and the number of
    faces searched (Redis work: the search refreshes from Redis, or runs in it). Other than by
    the best face (``max``), the nearest subjects are re-ranked by all their faces."""
    with work.metrics.stage("search"):
        if how == "max":
            results = state.search.search(vectors, k)
        else:
            model_id = work.pipeline.manifest.model_id

            def faces_of(subject_ids: list[str]):
                found = state.store.faces_of_subjects(subject_ids, with_embedding=True)
                return {s: [f for f in faces if f.model_id == model_id] for s, faces in found.items()}

            shortlists = state.search.search(vectors, shortlist_size(k))
            results = rerank(vectors, shortlists, faces_of, how, k)
    with work.metrics.stage("redis"):
        names = state.store.subject_names(sorted({hit.subject_id for hits in results for hit in hits}))
    return results, names, len(state.search)


def _identified(
    face: tuple[DetectedFace, FaceQuality] | None,
    hits: list[SubjectHit],
    names: dict[str, str | None],
    threshold: float,
) -> IdentifiedFace:
    """One face's answer: its candidates, best first, and whether the best reaches the threshold."""
    candidates = [
        Candidate(subject_id=h.subject_id, name=names.get(h.subject_id), score=h.score, face_id=h.face_id)
        for h in hits
    ]
    best = candidates[0] if candidates else None
    is_known = best is not None and best.score >= threshold
    return IdentifiedFace(
        **(face_schema(*face).model_dump() if face is not None else {}),
        status="known" if is_known else "unknown",
        subject_id=best.subject_id if is_known else None,
        name=best.name if is_known else None,
        score=best.score if best else None,
        candidates=candidates,
    )
