"""Embedding and verification of photos (or of embeddings the client already has)."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, File, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool

from models.errors import SphereFaceError
from service.errors import TooManyPhotosError
from service.gallery.store import check_embedding
from service.routes.common import (
    FaceWork,
    PhotoFaces,
    StrictRoute,
    face_schema,
    form_files,
    get_face_work,
    openapi_body,
    read_body,
)
from service.schemas import (
    EmbeddedFace,
    EmbedResponse,
    ErrorResponse,
    VerifyEmbeddings,
    VerifyResponse,
)
from service.schemas import PhotoFaces as PhotoFacesOut

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 413, 415, 422)}
router = APIRouter(tags=["faces"], responses=ERRORS, route_class=StrictRoute)


@router.post(
    "/embed",
    operation_id="embed",
    response_model=EmbedResponse,
    summary="Every face of one or more photos, with its embedding",
)
async def embed(
    work: Annotated[FaceWork, Depends(get_face_work)],
    photos: Annotated[list[UploadFile], File(description="one or more photos (JPEG, PNG, WebP, ...)")],
    aligned: Annotated[
        bool, Query(description="the photos are crops already aligned to the model's template")
    ] = False,
    faces: Annotated[
        Literal["all", "largest", "central"], Query(description="which faces of each photo to return")
    ] = "all",
) -> EmbedResponse:
    """Each photo gets a status: `ok` with its faces, or an error code (`no_face`,
    `unreadable_image`, `image_too_large`, `wrong_crop_size`) and a message."""
    settings = work.settings
    if len(photos) > settings.max_photos_per_request:
        raise TooManyPhotosError(
            f"{len(photos)} photos sent; at most {settings.max_photos_per_request} photos per request "
            "(SPHEREFACE_MAX_PHOTOS_PER_REQUEST)"
        )
    return await work.in_turn(_embed, work, photos, aligned, faces)


def _embed(work: FaceWork, photos: list[UploadFile], aligned: bool, policy: str) -> EmbedResponse:
    """The faces and embeddings of each photo (a face-path turn's work)."""
    manifest = work.pipeline.manifest
    items: list[PhotoFacesOut] = []
    found: list[PhotoFaces | None] = []
    for index, upload in enumerate(photos):
        item = PhotoFacesOut(index=index, filename=upload.filename, status="ok")
        photo = None
        try:
            if aligned:
                image, sha = work.read_aligned(upload)
                expected = (manifest.input_height, manifest.input_width, 3)
                if image.shape != expected:
                    item.status, item.message = (
                        "wrong_crop_size",
                        f"aligned crops must be {expected[1]}x{expected[0]} pixels, got "
                        f"{image.shape[1]}x{image.shape[0]}",
                    )
                else:
                    photo = PhotoFaces(sha, [], image[None])
            else:
                photo = work.detect(upload, policy)
        except SphereFaceError as exc:  # the photo's own failure, overloaded included
            error = work.error(exc)
            item.status, item.message = error["status"], error["message"]
        items.append(item)
        found.append(photo)
    vectors = iter(work.embed_photos([p for p in found if p is not None]))
    h, w = manifest.input_height, manifest.input_width
    for item, photo in zip(items, found, strict=True):
        if photo is None:
            continue
        if not photo.faces:  # an aligned crop: the whole image is the face
            item.faces = [
                EmbeddedFace(
                    box=[0, 0, w - 1, h - 1],
                    landmarks=work.pipeline.template.as_array().tolist(),
                    detection_score=1.0,
                    quality=round(photo.qualities[0].score, 4),
                    embedding=next(vectors).tolist(),
                )
            ]
        else:
            item.faces = [
                EmbeddedFace(**face_schema(f, q).model_dump(), embedding=next(vectors).tolist())
                for f, q in zip(photo.faces, photo.qualities, strict=True)
            ]
    return EmbedResponse(model_id=manifest.model_id, embedding_size=manifest.output_size, photos=items)


@router.post(
    "/verify",
    operation_id="verify",
    response_model=VerifyResponse,
    summary="Are the faces in two photos (or two embeddings) the same person?",
    openapi_extra=openapi_body({"photo1": "first photo", "photo2": "second photo"}, VerifyEmbeddings),
)
async def verify(
    request: Request,
    work: Annotated[FaceWork, Depends(get_face_work)],
    multiple_faces: Annotated[
        Literal["reject", "largest", "central"],
        Query(description="a photo with several faces: reject it (422), or use its largest/central face"),
    ] = "largest",
) -> VerifyResponse:
    """The cosine score of the two faces and the decision at the model's calibrated threshold.

    Send two photos as multipart fields `photo1`, `photo2`, or two embeddings of this model as
    JSON `{"embedding1": [...], "embedding2": [...]}`.

    Errors: `no_face`, `multiple_faces` (policy reject), `unreadable_image`, `invalid_embedding`
    (422), `image_too_large` (413)."""
    body = await read_body(request, VerifyEmbeddings, max_files=2)
    if isinstance(body, VerifyEmbeddings):
        return await run_in_threadpool(_verify, work, body, multiple_faces)
    return await work.in_turn(_verify, work, body, multiple_faces)


def _verify(work: FaceWork, body, policy: str) -> VerifyResponse:
    manifest = work.pipeline.manifest
    faces = None
    if isinstance(body, VerifyEmbeddings):
        vectors = [check_embedding(v, manifest.output_size) for v in (body.embedding1, body.embedding2)]
    else:
        photos = work.detect_each([form_files(body, name)[0] for name in ("photo1", "photo2")], policy)
        vectors = list(work.embed_photos(photos, first_only=True))
        faces = [face_schema(p.faces[0], p.qualities[0]) for p in photos]
    score = float(np.clip(vectors[0] @ vectors[1], -1.0, 1.0))
    threshold = manifest.thresholds.get("verification")
    return VerifyResponse(
        model_id=manifest.model_id,
        score=score,
        same_person=None if threshold is None else score >= threshold.value,
        threshold=None if threshold is None else threshold.value,
        threshold_far=None if threshold is None else threshold.far,
        threshold_source=None if threshold is None else threshold.source,
        faces=faces,
    )
