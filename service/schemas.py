"""Request and response models of the REST API (shown with examples at /docs)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator


class ErrorResponse(BaseModel):
    code: str = Field(examples=["no_face"], description="machine-readable error code")
    message: str = Field(examples=["no face was found in the photo"], description="for people")


class Face(BaseModel):
    box: list[float] = Field(
        description="x1, y1, x2, y2 in pixels of the upright photo", examples=[[120.0, 80.0, 260.0, 250.0]]
    )
    landmarks: list[list[float]] = Field(
        description="5 (x, y) points: left eye, right eye, nose, left and right mouth corners"
    )
    detection_score: float = Field(ge=0, le=1, description="MTCNN O-Net face probability")


class EmbeddedFace(Face):
    embedding: list[float] = Field(description="L2-normalised; the dot product of two is their cosine")


class PhotoFaces(BaseModel):
    index: int
    filename: str | None = None
    status: str = Field(description="ok, or an error code such as no_face, unreadable_image")
    message: str | None = None
    faces: list[EmbeddedFace] = []


class EmbedResponse(BaseModel):
    model_id: str
    embedding_size: int
    photos: list[PhotoFaces]


class VerifyResponse(BaseModel):
    model_id: str
    score: float = Field(ge=-1, le=1, description="cosine similarity of the two faces, in [-1, 1]")
    same_person: bool | None = Field(description="score >= threshold; null when the model has no threshold")
    threshold: float | None = Field(description="cosine threshold of the model (from its manifest)")
    threshold_far: float | None = Field(description="false-accept rate the threshold was calibrated for")
    threshold_source: str | None = None
    faces: list[Face] | None = Field(
        description="the face used from each photo, in request order (null for embeddings)"
    )


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str = Field(description="ready, loading or redis_unavailable")
    model_id: str | None = None
    provider: str | None = None
    gallery_faces: int | None = Field(None, description="faces of this model in the search")
    gallery_revision: int | None = None
    message: str | None = None


# -- bodies that carry embeddings instead of photos (application/json) ------------------------
Vector = Annotated[list[float], Field(min_length=1, max_length=4096)]


class VerifyEmbeddings(BaseModel):
    embedding1: Vector
    embedding2: Vector


class FaceEmbeddings(BaseModel):
    embeddings: list[Vector] = Field(min_length=1, description="one embedding per face, model's size")


class BulkEmbeddings(BaseModel):
    subjects: list[str] = Field(min_length=1, description="subject id of each embedding, same order")
    embeddings: list[Vector] = Field(min_length=1)
    create_subjects: bool = Field(False, description="create subjects that do not exist yet")


# -- gallery --------------------------------------------------------------------------------
MAX_METADATA_BYTES = 8192


def _small_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None and len(json.dumps(value)) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON")
    return value


class SubjectCreate(BaseModel):
    id: str | None = Field(
        None,
        description="1-128 letters, digits or _ . - @ : (generated when left out)",
        examples=["alice.smith"],
    )
    name: str | None = Field(None, max_length=256, examples=["Alice Smith"])
    metadata: dict[str, Any] | None = Field(None, examples=[{"employee": 1042}])

    _check_metadata = field_validator("metadata")(_small_metadata)


class SubjectUpdate(BaseModel):
    name: str | None = Field(None, max_length=256)
    metadata: dict[str, Any] | None = Field(None, description="replaces the stored metadata")

    _check_metadata = field_validator("metadata")(_small_metadata)


class SubjectOut(BaseModel):
    id: str
    name: str | None
    metadata: dict[str, Any]
    created_at: str
    updated_at: str
    face_count: int = Field(
        description="faces enrolled for the model being served (the faces identification searches)"
    )
    face_count_all_models: int = Field(
        description="faces enrolled with any model; more than face_count when the gallery was enrolled "
        "with another model too (re-enroll for the served model: see `sphereface gallery reembed`)"
    )


class SubjectPage(BaseModel):
    subjects: list[SubjectOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None = Field(description="offset of the next page; null on the last page")


class SubjectDeleted(BaseModel):
    id: str
    faces_removed: int


class FaceOut(BaseModel):
    id: str
    subject_id: str
    model_id: str = Field(description="the model that made the embedding; only it compares with it")
    photo_sha256: str = Field(description="SHA-256 of the photo's bytes (of the embedding for JSON)")
    created_at: str
    source: Literal["photo", "embedding"]
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    has_image: bool = Field(
        False,
        description="the region around the face is stored: GET /v1/faces/{id}/image shows it, and "
        "`sphereface gallery reembed` can re-embed it for another model",
    )
    embedding: list[float] | None = None


class FaceDeleted(BaseModel):
    id: str


class EnrollItem(BaseModel):
    index: int
    filename: str | None = None
    subject_id: str
    status: str = Field(
        description="ok, or an error code: no_face, multiple_faces, unreadable_image, image_too_large, "
        "duplicate_photo, subject_not_found, invalid_embedding, invalid_request"
    )
    message: str | None = None
    face: FaceOut | None = None


class EnrollResponse(BaseModel):
    model_id: str
    enrolled: int
    failed: int
    subjects_created: list[str] = []
    items: list[EnrollItem]


# -- identification -------------------------------------------------------------------------
class Candidate(BaseModel):
    subject_id: str
    name: str | None
    score: float = Field(description="cosine of the subject's best-matching face")
    face_id: str = Field(description="that face")


class IdentifiedFace(BaseModel):
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    status: Literal["known", "unknown"] = Field(
        description="known: the best subject reaches the threshold; unknown: no subject does"
    )
    subject_id: str | None = Field(description="the best subject when known")
    name: str | None = None
    score: float | None = Field(description="the best subject's score (null with an empty gallery)")
    candidates: list[Candidate] = Field(description="top-k subjects, best first")


class IdentifyResponse(BaseModel):
    model_id: str
    threshold: float
    threshold_far: float | None
    threshold_source: str | None
    k: int
    gallery_faces: int = Field(description="faces of this model searched")
    faces: list[IdentifiedFace]
