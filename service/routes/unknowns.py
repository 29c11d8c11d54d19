"""Unknown faces: the faces identify answered ``unknown`` for, kept and clustered
(``SPHEREFACE_KEEP_UNKNOWN=true``). Reads need a read key, changes an admin key."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Path, Query, Request, Response

from service.auth import require_admin, require_read
from service.errors import NoFaceImageError, ServiceError, SubjectExistsError
from service.events.stream import FACE_ENROLLED, SUBJECT_CREATED, Event, EventStream
from service.gallery.store import FaceRecord, GalleryStore, NewFace, check_subject_id, embedding_sha256
from service.routes.common import FACE_IMAGE_RESPONSES, PhotoFaces, StrictRoute, face_image_response
from service.schemas import ErrorResponse, IdentifyResponse
from service.unknowns.pool import KeptFace, UnknownFace, UnknownPool
from service.unknowns.schemas import (
    ClusterEnroll,
    ClusterEnrolled,
    MergeRule,
    UnknownClusterDetail,
    UnknownClusterOut,
    UnknownClusterPage,
    UnknownFaceOut,
    UnknownsDeleted,
)

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 422, 503)}
router = APIRouter(prefix="/unknowns", tags=["unknowns"], responses=ERRORS, route_class=StrictRoute)
ClusterId = Annotated[str, Path(description="the cluster's id", max_length=64)]
FaceId = Annotated[str, Path(description="the unknown face's id", max_length=64)]
#: Faces shown for each cluster of a page.
REPRESENTATIVES = 3


class UnknownsOffError(ServiceError):
    code = "unknowns_off"


async def get_pool(request: Request) -> UnknownPool:
    """The served model's pool (404 ``unknowns_off`` unless ``SPHEREFACE_KEEP_UNKNOWN=true``)."""
    pool = request.app.state.unknowns
    if pool is None:
        raise UnknownsOffError(
            "unknown faces are not kept: start the service with SPHEREFACE_KEEP_UNKNOWN=true"
        )
    return pool


Pool = Annotated[UnknownPool, Depends(get_pool)]


def keep_unknown_faces(
    pool: UnknownPool, answer: IdentifyResponse, photo: PhotoFaces, vectors: np.ndarray, source: str
) -> None:
    """Keep every ``unknown`` face of an identify answer in the pool, and name its id and cluster
    in the answer."""
    for i, face in enumerate(answer.faces):
        if face.status != "unknown":
            continue
        detected = photo.faces[i]
        kept = KeptFace(
            embedding=vectors[i],
            source=source,
            photo_sha256=photo.sha256,
            box=detected.box.tolist(),
            landmarks=detected.landmarks.tolist(),
            detection_score=float(detected.score),
            region=photo.regions[i] if photo.regions else None,
        )
        face.unknown_face_id, face.cluster_id = pool.add(kept)


def _rule(pool: UnknownPool) -> MergeRule:
    rule = pool.rule
    return MergeRule(
        threshold=rule.threshold,
        threshold_far=rule.far,
        threshold_name=rule.name,
        false_merge_rate=rule.false_merge_rate,
        mixed_cluster_rate=rule.mixed_cluster_rate,
    )


def _face(face: UnknownFace) -> UnknownFaceOut:
    return UnknownFaceOut(
        id=face.id,
        cluster_id=face.cluster_id,
        created_at=face.created_at,
        source=face.source,
        photo_sha256=face.photo_sha256,
        box=face.box,
        detection_score=face.detection_score,
        has_image=face.has_image,
    )


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _cluster(pool: UnknownPool, cluster_id: str, size: int) -> UnknownClusterOut:
    times = pool.cluster_times(cluster_id)
    shown = pool.faces(pool.representatives(cluster_id, REPRESENTATIVES))
    return UnknownClusterOut(
        id=cluster_id,
        faces=size,
        first_seen=_iso(min(times)),
        last_seen=_iso(max(times)),
        representatives=[_face(f) for f in shown],
    )


@router.get(
    "/clusters",
    operation_id="list_unknown_clusters",
    response_model=UnknownClusterPage,
    dependencies=[Depends(require_read)],
    summary="Clusters of unknown faces, largest first",
)
def list_clusters(
    pool: Pool,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    min_faces: Annotated[int, Query(ge=1, le=1_000_000, description="only clusters of this many faces")] = 1,
) -> UnknownClusterPage:
    """The served model's clusters of kept unknown faces, largest first (then the most recently
    seen), each with up to 3 representative faces. `rule` states the merge threshold and the
    false-merge rate measured for it on LFW. Faces past the retention limits are dropped first."""
    pool.evict()
    sizes = [(c, n) for c, n in pool.clusters() if n >= min_faces]
    page = sizes[offset : offset + limit]
    following = offset + limit
    return UnknownClusterPage(
        model_id=pool.model_id,
        rule=_rule(pool),
        clusters=[_cluster(pool, c, n) for c, n in page],
        total=len(sizes),
        pooled_faces=len(pool.view),
        offset=offset,
        limit=limit,
        next_offset=following if following < len(sizes) else None,
    )


@router.get(
    "/clusters/{cluster_id}",
    operation_id="get_unknown_cluster",
    response_model=UnknownClusterDetail,
    dependencies=[Depends(require_read)],
    summary="One cluster of unknown faces, with every face",
)
def get_cluster(pool: Pool, cluster_id: ClusterId) -> UnknownClusterDetail:
    """Errors: `unknown_cluster_not_found` (404)."""
    faces = pool.faces(pool.cluster_face_ids(cluster_id))
    return UnknownClusterDetail(
        id=cluster_id, model_id=pool.model_id, rule=_rule(pool), faces=[_face(f) for f in faces]
    )


@router.post(
    "/clusters/{cluster_id}/enroll",
    operation_id="enroll_unknown_cluster",
    response_model=ClusterEnrolled,
    dependencies=[Depends(require_admin)],
    summary="Name a cluster: enroll its faces for a subject",
)
def enroll_cluster(
    request: Request, pool: Pool, cluster_id: ClusterId, body: ClusterEnroll
) -> ClusterEnrolled:
    """Enrolls every face of the cluster for `subject_id` (created first with `create_subject`),
    then removes them from the pool, with every other kept face the new faces now identify.
    Errors: `unknown_cluster_not_found` (404), `subject_not_found` (404), `invalid_request` (422)."""
    state = request.app.state
    store: GalleryStore = state.store
    events: EventStream = state.events
    subject_id = check_subject_id(body.subject_id)
    faces = pool.faces(pool.cluster_face_ids(cluster_id), with_embedding=True, with_region=True)
    created = _ensure_subject(store, events, subject_id, body)
    items = [(subject_id, _new_face(f)) for f in faces]
    outcomes = store.add_faces_bulk(items, pool.model_id)
    stored = [(f, o) for f, o in zip(faces, outcomes, strict=True) if isinstance(o, FaceRecord)]
    events.publish(
        [
            Event(
                FACE_ENROLLED,
                {"subject_id": subject_id, "face_id": o.id, "model": o.model_id, "source": o.source},
            )
            for _, o in stored
        ]
    )
    left = pool.remove([f.id for f, _ in stored])
    if stored:
        left += len(pool.remove_matching(np.stack([f.embedding for f, _ in stored])))
    return ClusterEnrolled(
        cluster_id=cluster_id,
        subject_id=subject_id,
        subject_created=created,
        enrolled=[o.id for _, o in stored],
        failed=len(faces) - len(stored),
        left_pool=left,
    )


def _ensure_subject(store: GalleryStore, events: EventStream, subject_id: str, body: ClusterEnroll) -> bool:
    """Whether the subject was created now (``create_subject``); a missing one is a 404 otherwise."""
    if not body.create_subject:
        store.get_subject(subject_id)
        return False
    try:
        store.create_subject(subject_id, body.name)
    except SubjectExistsError:
        return False
    events.emit(SUBJECT_CREATED, {"subject_id": subject_id})
    return True


def _new_face(face: UnknownFace) -> NewFace:
    """A kept face as a gallery face (its duplicate key is its embedding's: a photo of two
    strangers gives a face to each of two subjects)."""
    return NewFace(
        face.embedding,
        embedding_sha256(face.embedding),
        face.box,
        face.landmarks,
        face.detection_score,
        source="photo",
        region=face.region,
    )


@router.delete(
    "/clusters/{cluster_id}",
    operation_id="delete_unknown_cluster",
    response_model=UnknownsDeleted,
    dependencies=[Depends(require_admin)],
    summary="Delete a cluster and its faces",
)
def delete_cluster(pool: Pool, cluster_id: ClusterId) -> UnknownsDeleted:
    """Errors: `unknown_cluster_not_found` (404)."""
    return UnknownsDeleted(removed=pool.remove(pool.cluster_face_ids(cluster_id)))


@router.delete(
    "/faces/{face_id}",
    operation_id="delete_unknown_face",
    response_model=UnknownsDeleted,
    dependencies=[Depends(require_admin)],
    summary="Delete one unknown face",
)
def delete_face(pool: Pool, face_id: FaceId) -> UnknownsDeleted:
    """Errors: `unknown_face_not_found` (404)."""
    removed = pool.remove([face_id])
    if not removed:
        raise pool.not_found(face_id)
    return UnknownsDeleted(removed=removed)


@router.get(
    "/faces/{face_id}/image",
    operation_id="get_unknown_face_image",
    response_class=Response,
    responses=FACE_IMAGE_RESPONSES,
    dependencies=[Depends(require_read)],
    summary="The stored region around an unknown face (JPEG)",
)
def face_image(pool: Pool, face_id: FaceId) -> Response:
    """Errors: `unknown_face_not_found` (404), `no_face_image` (404: kept with
    `SPHEREFACE_STORE_FACE_IMAGES=false`)."""
    face = pool.face(face_id, with_region=True)
    if face.region is None:
        raise NoFaceImageError(f"unknown face {face_id!r} has no stored image")
    return face_image_response(face.region)
