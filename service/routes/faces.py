"""Embedding and verification of photos."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Depends, File, Query, Request, UploadFile

from models.errors import FacePathError, ImageTooLargeError
from models.image import decode_image
from models.pipeline import EmbeddedFace as PipelineFace
from models.pipeline import FacePipeline
from service.schemas import EmbeddedFace, EmbedResponse, ErrorResponse, Face, PhotoFaces, VerifyResponse
from service.settings import Settings

router = APIRouter(tags=["faces"])
ERRORS = {code: {"model": ErrorResponse} for code in (413, 422)}


def get_pipeline(request: Request) -> FacePipeline:
    return request.app.state.pipeline


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def read_upload(upload: UploadFile, settings: Settings) -> np.ndarray:
    """Read an uploaded photo within the size limits and decode it (typed errors)."""
    data = upload.file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise ImageTooLargeError(
            f"{upload.filename or 'the photo'} is larger than {settings.max_upload_bytes} bytes"
        )
    try:
        return decode_image(data, max_bytes=settings.max_upload_bytes, max_pixels=settings.max_image_pixels)
    except FacePathError as exc:
        exc.message = f"{upload.filename or 'photo'}: {exc.message}"
        raise


def _face(face: PipelineFace) -> Face:
    f = face.face
    return Face(box=f.box.tolist(), landmarks=f.landmarks.tolist(), detection_score=f.score)


def _embedded(face: PipelineFace) -> EmbeddedFace:
    return EmbeddedFace(**_face(face).model_dump(), embedding=face.embedding.tolist())


@router.post(
    "/embed",
    response_model=EmbedResponse,
    responses=ERRORS,
    summary="Every face of one or more photos, with its embedding",
)
def embed(
    pipeline: Annotated[FacePipeline, Depends(get_pipeline)],
    settings: Annotated[Settings, Depends(get_settings)],
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
    if len(photos) > settings.max_photos_per_request:
        raise ImageTooLargeError(f"at most {settings.max_photos_per_request} photos per request")
    manifest = pipeline.manifest
    results = []
    for index, upload in enumerate(photos):
        item = PhotoFaces(index=index, filename=upload.filename, status="ok")
        try:
            image = read_upload(upload, settings)
            if aligned:
                expected = (manifest.input_height, manifest.input_width, 3)
                if image.shape != expected:
                    item.status, item.message = (
                        "wrong_crop_size",
                        f"aligned crops must be {expected[1]}x{expected[0]} pixels, got "
                        f"{image.shape[1]}x{image.shape[0]}",
                    )
                else:
                    vector = pipeline.embed_aligned(image[None])[0]
                    h, w = expected[:2]
                    item.faces = [
                        EmbeddedFace(
                            box=[0, 0, w - 1, h - 1],
                            landmarks=pipeline.template.as_array().tolist(),
                            detection_score=1.0,
                            embedding=vector.tolist(),
                        )
                    ]
            else:
                item.faces = [_embedded(f) for f in pipeline.faces(image, faces)]
        except FacePathError as exc:
            item.status, item.message = exc.code, exc.message
        results.append(item)
    return EmbedResponse(model_id=manifest.model_id, embedding_size=manifest.output_size, photos=results)


@router.post(
    "/verify",
    response_model=VerifyResponse,
    responses=ERRORS,
    summary="Are the faces in two photos the same person?",
)
def verify(
    pipeline: Annotated[FacePipeline, Depends(get_pipeline)],
    settings: Annotated[Settings, Depends(get_settings)],
    photo1: Annotated[UploadFile, File(description="first photo")],
    photo2: Annotated[UploadFile, File(description="second photo")],
    multiple_faces: Annotated[
        Literal["reject", "largest", "central"],
        Query(description="a photo with several faces: reject it (422), or use its largest/central face"),
    ] = "largest",
) -> VerifyResponse:
    """The cosine score of the two faces and the decision at the model's threshold.

    Errors: `no_face`, `multiple_faces` (policy reject), `unreadable_image` (422),
    `image_too_large` (413)."""
    chosen = []
    for upload in (photo1, photo2):
        image = read_upload(upload, settings)
        try:
            chosen.append(pipeline.faces(image, multiple_faces)[0])
        except FacePathError as exc:
            exc.message = f"{upload.filename or 'photo'}: {exc.message}"
            raise
    score = float(np.clip(chosen[0].embedding @ chosen[1].embedding, -1.0, 1.0))
    threshold = pipeline.manifest.thresholds.get("verification")
    return VerifyResponse(
        model_id=pipeline.manifest.model_id,
        score=score,
        same_person=None if threshold is None else score >= threshold.value,
        threshold=None if threshold is None else threshold.value,
        threshold_far=None if threshold is None else threshold.far,
        threshold_source=None if threshold is None else threshold.source,
        faces=[_face(f) for f in chosen],
    )
