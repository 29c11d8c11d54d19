"""The gallery: subjects, their faces, bulk enrollment. Reads need a read key, changes an admin key."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, Path, Query, Request, Response, status

from models.errors import SphereFaceError
from models.quality import FaceQuality, reason_text
from service.auth import require_admin, require_read
from service.errors import (
    InvalidEmbeddingError,
    InvalidRequestError,
    LowQualityError,
    NoFaceImageError,
    ServiceError,
    TooManyPhotosError,
)
from service.events.stream import (
    FACE_DELETED,
    FACE_ENROLLED,
    SUBJECT_CREATED,
    SUBJECT_DELETED,
    Event,
    EventStream,
)
from service.gallery.store import (
    FaceRecord,
    GalleryStore,
    NewFace,
    Subject,
    check_embedding,
    check_subject_id,
    embedding_sha256,
)
from service.routes.common import (
    FACE_IMAGE_RESPONSES,
    FaceWork,
    StrictRoute,
    face_image_response,
    form_files,
    get_face_work,
    openapi_body,
    read_body,
)
from service.schemas import (
    BulkEmbeddings,
    EnrollItem,
    EnrollResponse,
    ErrorResponse,
    FaceDeleted,
    FaceEmbeddings,
    FaceOut,
    FacePage,
    SubjectCreate,
    SubjectDeleted,
    SubjectOut,
    SubjectPage,
    SubjectUpdate,
)
from service.unknowns.pool import UnknownPool

#: Paging offsets above this are refused (422): Redis ranges are 64-bit, Python ints are not.
MAX_OFFSET = 1_000_000_000
ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 409, 413, 415, 422, 503)}
router = APIRouter(tags=["gallery"], responses=ERRORS, route_class=StrictRoute)
SubjectId = Annotated[str, Path(description="the subject's id", max_length=128)]
EnrollPolicy = Annotated[
    Literal["reject", "largest", "central"],
    Query(
        description="a photo with several faces: reject it (multiple_faces), "
        "or enroll its largest/central face"
    ),
]


async def get_store(request: Request) -> GalleryStore:
    return request.app.state.store


async def get_model_id(request: Request) -> str:
    """The served model's id: subject answers count the faces of this model."""
    return request.app.state.pipeline.manifest.model_id


async def get_events(request: Request) -> EventStream:
    """The event stream that acknowledged gallery changes are appended to."""
    return request.app.state.events


Store = Annotated[GalleryStore, Depends(get_store)]
Events = Annotated[EventStream, Depends(get_events)]
ModelId = Annotated[str, Depends(get_model_id)]


def _subject(subject: Subject) -> SubjectOut:
    return SubjectOut(**subject.__dict__)


def _face(face: FaceRecord) -> FaceOut:
    hidden = ("embedding", "has_region", "subject_created")
    fields = {k: v for k, v in face.__dict__.items() if k not in hidden}
    embedding = None if face.embedding is None else face.embedding.tolist()
    return FaceOut(**fields, has_image=face.has_region, embedding=embedding)


# -- subjects -----------------------------------------------------------------------------------
@router.post(
    "/subjects",
    operation_id="create_subject",
    status_code=status.HTTP_201_CREATED,
    response_model=SubjectOut,
    dependencies=[Depends(require_admin)],
    summary="Create a subject (a person of the gallery)",
)
def create_subject(store: Store, events: Events, body: SubjectCreate) -> SubjectOut:
    """Errors: `subject_exists` (409), `invalid_request` (422: bad id)."""
    subject = store.create_subject(body.id, body.name, body.metadata)
    events.emit(SUBJECT_CREATED, {"subject_id": subject.id})
    return _subject(subject)


@router.get(
    "/subjects",
    operation_id="list_subjects",
    response_model=SubjectPage,
    dependencies=[Depends(require_read)],
    summary="List subjects, a page at a time, in creation order",
)
def list_subjects(
    store: Store,
    model_id: ModelId,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    q: Annotated[
        str | None,
        Query(max_length=128, description="only subjects whose id or name contains this (any case)"),
    ] = None,
) -> SubjectPage:
    """`total` counts the subjects that match `q` (all subjects without it)."""
    subjects, total = store.list_subjects(offset, limit, model_id, query=q)
    following = offset + limit
    return SubjectPage(
        subjects=[_subject(s) for s in subjects],
        total=total,
        offset=offset,
        limit=limit,
        next_offset=following if following < total else None,
    )


@router.get(
    "/subjects/{subject_id}",
    operation_id="get_subject",
    response_model=SubjectOut,
    dependencies=[Depends(require_read)],
    summary="One subject",
)
def get_subject(store: Store, model_id: ModelId, subject_id: SubjectId) -> SubjectOut:
    return _subject(store.get_subject(subject_id, model_id))


@router.patch(
    "/subjects/{subject_id}",
    operation_id="update_subject",
    response_model=SubjectOut,
    dependencies=[Depends(require_admin)],
    summary="Change a subject's name or metadata",
)
def update_subject(store: Store, model_id: ModelId, subject_id: SubjectId, body: SubjectUpdate) -> SubjectOut:
    return _subject(store.update_subject(subject_id, body.name, body.metadata, model_id))


@router.delete(
    "/subjects/{subject_id}",
    operation_id="delete_subject",
    response_model=SubjectDeleted,
    dependencies=[Depends(require_admin)],
    summary="Delete a subject and all its faces",
)
def delete_subject(store: Store, events: Events, subject_id: SubjectId) -> SubjectDeleted:
    removed = store.delete_subject(subject_id)
    events.emit(SUBJECT_DELETED, {"subject_id": subject_id, "faces_removed": removed})
    return SubjectDeleted(id=subject_id, faces_removed=removed)


# -- faces --------------------------------------------------------------------------------------
@router.post(
    "/subjects/{subject_id}/faces",
    operation_id="add_faces",
    response_model=EnrollResponse,
    dependencies=[Depends(require_admin)],
    summary="Enroll faces of a subject from photos (or embeddings)",
    openapi_extra=openapi_body(
        {"photos": "one or more photos of the subject"}, FaceEmbeddings, many="photos"
    ),
)
async def add_faces(
    request: Request,
    store: Store,
    events: Events,
    work: Annotated[FaceWork, Depends(get_face_work)],
    subject_id: SubjectId,
    multiple_faces: EnrollPolicy = "reject",
) -> EnrollResponse:
    """One face per photo; each item gets a status: `ok` with the stored face, or an error code
    (`no_face`, `multiple_faces`, `unreadable_image`, `image_too_large`, `duplicate_photo`,
    `invalid_embedding`, `low_quality`: the face's quality is under `SPHEREFACE_MIN_QUALITY`, with
    its `reason`: `too_small`, `blurred`, `turned_away` or `unclear_face`). JSON bodies
    `{"embeddings": [[...], ...]}` enroll embeddings of this model. The subject must exist
    (`subject_not_found`, 404)."""
    await work.off_turn(store.get_subject, subject_id)
    body = await read_body(request, FaceEmbeddings, max_files=work.settings.max_bulk_items)
    if isinstance(body, FaceEmbeddings):
        check_embedding_sizes(body.embeddings, work.pipeline.manifest.output_size)
        ready, failed = _embeddings_ready(work, [(subject_id, v) for v in body.embeddings])
        filenames: dict[int, str | None] = {}
    else:
        uploads = [(subject_id, u) for u in form_files(body, "photos")]
        filenames = {index: upload.filename for index, (_, upload) in enumerate(uploads)}
        ready, failed = await work.in_turn(_photos_ready, work, uploads, multiple_faces)
    pool = request.app.state.unknowns
    return await work.off_turn(_store, store, events, work, ready, failed, filenames, False, pool)


@router.get(
    "/subjects/{subject_id}/faces",
    operation_id="list_faces",
    response_model=FacePage,
    dependencies=[Depends(require_read)],
    summary="The faces of a subject, a page at a time, oldest first",
)
def list_faces(
    store: Store,
    subject_id: SubjectId,
    embeddings: Annotated[bool, Query(description="include the embeddings")] = False,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> FacePage:
    """A subject holds at most `SPHEREFACE_MAX_FACES_PER_SUBJECT` faces (1,000 by default)."""
    faces = store.subject_faces(subject_id, with_embedding=embeddings)
    following = offset + limit
    return FacePage(
        faces=[_face(f) for f in faces[offset:following]],
        total=len(faces),
        offset=offset,
        limit=limit,
        next_offset=following if following < len(faces) else None,
    )


@router.delete(
    "/faces/{face_id}",
    operation_id="delete_face",
    response_model=FaceDeleted,
    dependencies=[Depends(require_admin)],
    summary="Delete one face",
)
def delete_face(store: Store, events: Events, face_id: Annotated[str, Path(max_length=64)]) -> FaceDeleted:
    store.delete_face(face_id)
    events.emit(FACE_DELETED, {"face_id": face_id})
    return FaceDeleted(id=face_id)


@router.get(
    "/faces/{face_id}/image",
    operation_id="get_face_image",
    response_class=Response,
    responses=FACE_IMAGE_RESPONSES,
    dependencies=[Depends(require_read)],
    summary="The stored region around a face (JPEG)",
)
def face_image(store: Store, face_id: Annotated[str, Path(max_length=64)]) -> Response:
    """The JPEG kept at enrollment (a square about 2.2 face widths wide, at most 320 pixels).
    Errors: `face_not_found` (404), `no_face_image` (404: enrolled from an embedding, or with
    `SPHEREFACE_STORE_FACE_IMAGES=false`)."""
    region = store.face_region(face_id)
    if region is None:
        raise NoFaceImageError(f"face {face_id!r} has no stored image")
    return face_image_response(region)


# -- bulk enrollment ----------------------------------------------------------------------------
@router.post(
    "/enroll",
    operation_id="enroll",
    response_model=EnrollResponse,
    dependencies=[Depends(require_admin)],
    summary="Bulk enrollment: many photos (or embeddings) for many subjects",
    openapi_extra=openapi_body(
        {"photos": "the photos"},
        BulkEmbeddings,
        many="photos",
        text_lists={"subjects": "the subject id of each photo, in the same order (repeat the field)"},
    ),
)
async def enroll(
    request: Request,
    store: Store,
    events: Events,
    work: Annotated[FaceWork, Depends(get_face_work)],
    multiple_faces: EnrollPolicy = "reject",
    create_subjects: Annotated[bool, Query(description="create subjects that do not exist yet")] = False,
) -> EnrollResponse:
    """Multipart: files `photos` and, for each, a text field `subjects` (same order). JSON:
    `{"subjects": [...], "embeddings": [[...], ...], "create_subjects": false}`. Each item is
    enrolled on its own and gets its own status (see `POST /v1/subjects/{id}/faces`); photos are
    embedded in batches. At most `SPHEREFACE_MAX_BULK_ITEMS` items per request. With
    `create_subjects`, a subject is created only with its first face that is stored: a subject
    whose items all fail is not created."""
    limit = work.settings.max_bulk_items
    body = await read_body(request, BulkEmbeddings, max_files=limit)
    if isinstance(body, BulkEmbeddings):
        subjects, payload = body.subjects, body.embeddings
        create_subjects = create_subjects or body.create_subjects
    else:
        payload = form_files(body, "photos")
        subjects = [s for s in body.getlist("subjects") if isinstance(s, str)]
    if len(subjects) != len(payload):
        raise InvalidRequestError(f"got {len(payload)} photos or embeddings but {len(subjects)} subject ids")
    if len(payload) > limit:
        raise TooManyPhotosError(
            f"{len(payload)} items sent; at most {limit} per bulk enrollment request "
            "(SPHEREFACE_MAX_BULK_ITEMS)"
        )
    for sid in subjects:
        check_subject_id(sid)
    items = list(zip(subjects, payload, strict=True))
    filenames: dict[int, str | None] = {}
    if isinstance(body, BulkEmbeddings):  # before anything is stored
        check_embedding_sizes(payload, work.pipeline.manifest.output_size)
        ready, failed = _embeddings_ready(work, items)
    else:
        filenames = {index: upload.filename for index, upload in enumerate(payload)}
        ready, failed = await work.in_turn(_photos_ready, work, items, multiple_faces)
    pool = request.app.state.unknowns
    return await work.off_turn(_store, store, events, work, ready, failed, filenames, create_subjects, pool)


def _enrolled_events(outcomes: list[FaceRecord | ServiceError]) -> list[Event]:
    """``subject.created`` for each subject made with its first face, then ``face.enrolled`` for
    every face stored, in the order of the request."""
    events = []
    for outcome in outcomes:
        if isinstance(outcome, FaceRecord):
            if outcome.subject_created:
                events.append(Event(SUBJECT_CREATED, {"subject_id": outcome.subject_id}))
            data = {"subject_id": outcome.subject_id, "face_id": outcome.id, "model": outcome.model_id}
            events.append(Event(FACE_ENROLLED, {**data, "source": outcome.source}))
    return events


def check_embedding_sizes(vectors: list[list[float]], size: int) -> None:
    """Every embedding of a request has the served model's size (the OpenAPI document says so);
    otherwise the whole request is refused with 422 ``invalid_embedding``, before anything is stored."""
    wrong = [i for i, v in enumerate(vectors) if len(v) != size]
    if wrong:
        raise InvalidEmbeddingError(
            f"embeddings must have {size} values for this model; item {wrong[0]} has {len(vectors[wrong[0]])}"
            + (f" (and {len(wrong) - 1} more items are wrong)" if len(wrong) > 1 else "")
        )


Ready = list[tuple[int, str, NewFace]]


def _embeddings_ready(work: FaceWork, items) -> tuple[Ready, list[EnrollItem]]:
    """Client embeddings as faces to store (unit vectors), and the items refused
    (`invalid_embedding`)."""
    dim = work.pipeline.manifest.output_size
    failed: list[EnrollItem] = []
    ready: Ready = []
    for index, (subject_id, values) in enumerate(items):
        try:
            vector = check_embedding(values, dim)
        except ServiceError as exc:
            failed.append(
                EnrollItem(index=index, subject_id=subject_id, status=exc.code, message=exc.message)
            )
            continue
        ready.append((index, subject_id, NewFace(vector, embedding_sha256(vector), source="embedding")))
    return ready, failed


def _photos_ready(work: FaceWork, items, policy: str) -> tuple[Ready, list[EnrollItem]]:
    """Detect one face per photo and embed them in one batch (a face-path turn's work: no Redis);
    returns the faces to store and the photos that failed, each with its error code."""
    failed: list[EnrollItem] = []
    detected = []
    keep_region = work.settings.store_face_images
    for index, (subject_id, upload) in enumerate(items):
        try:
            detected.append((index, subject_id, work.detect(upload, policy, region=keep_region)))
        except SphereFaceError as exc:  # the photo's own failure, overloaded included
            error = work.error(exc)
            failed.append(EnrollItem(index=index, filename=upload.filename, subject_id=subject_id, **error))
    vectors = work.embed_photos([photo for _, _, photo in detected], first_only=True)
    ready: Ready = []
    for (index, subject_id, photo), vector in zip(detected, vectors, strict=True):
        face, quality = photo.faces[0], photo.qualities[0]
        if quality.score < work.settings.min_quality:
            refused = low_quality_error(quality, work.settings.min_quality)
            work.metrics.count_photo_error(refused.code)
            failed.append(
                EnrollItem(
                    index=index,
                    filename=items[index][1].filename,
                    subject_id=subject_id,
                    status=refused.code,
                    message=refused.message,
                    reason=refused.reason,
                    quality=refused.quality,
                )
            )
            continue
        new = NewFace(
            vector,
            photo.sha256,
            face.box.tolist(),
            face.landmarks.tolist(),
            float(face.score),
            region=photo.region,
            quality=round(quality.score, 4),
        )
        ready.append((index, subject_id, new))
    return ready, failed


def low_quality_error(quality: FaceQuality, floor: float) -> LowQualityError:
    """The refusal of a face under the enrollment floor, with its reason in words and as a code."""
    return LowQualityError(
        f"{reason_text(quality)} (quality {quality.score:.2f}, under the floor {floor:.2f} "
        "of SPHEREFACE_MIN_QUALITY)",
        quality.reason,
        round(quality.score, 4),
    )


def _store(
    store: GalleryStore,
    events: EventStream,
    work: FaceWork,
    ready: Ready,
    results: list[EnrollItem],
    filenames: dict[int, str | None],
    create_subjects: bool,
    pool: UnknownPool | None = None,
) -> EnrollResponse:
    """Write the enrollable faces in one round trip (``create_subjects``: a missing subject is
    created with its first face stored) and merge their outcomes with the failures; what was
    stored then goes on the event stream, and the kept unknown faces it now identifies leave
    ``pool``."""
    with work.metrics.stage("redis"):
        outcomes = store.add_faces_bulk(
            [(s, f) for _, s, f in ready], work.pipeline.manifest.model_id, create_subjects=create_subjects
        )
    created: list[str] = []
    for (index, subject_id, _), outcome in zip(ready, outcomes, strict=True):
        item = EnrollItem(index=index, filename=filenames.get(index), subject_id=subject_id, status="ok")
        if isinstance(outcome, ServiceError):
            item.status, item.message = outcome.code, outcome.message
        else:
            item.face = _face(outcome)
            if outcome.subject_created:
                created.append(subject_id)
        results.append(item)
    results.sort(key=lambda item: item.index)
    events.publish(_enrolled_events(outcomes))
    stored = [
        face.embedding for (_, _, face), o in zip(ready, outcomes, strict=True) if isinstance(o, FaceRecord)
    ]
    if pool is not None and stored:
        pool.remove_matching(np.stack(stored))
    enrolled = sum(item.status == "ok" for item in results)
    return EnrollResponse(
        model_id=work.pipeline.manifest.model_id,
        enrolled=enrolled,
        failed=len(results) - enrolled,
        subjects_created=created,
        items=results,
    )
