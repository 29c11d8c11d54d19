"""Request and response models of the REST API (shown with examples at /docs)."""

from __future__ import annotations

import json
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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


class RequestBody(BaseModel):
    """A JSON request body: a field the API does not know is an error that names it (a typo such
    as ``nmae`` must not pass unnoticed)."""

    model_config = ConfigDict(extra="forbid")


class VerifyEmbeddings(RequestBody):
    embedding1: Vector
    embedding2: Vector


class FaceEmbeddings(RequestBody):
    embeddings: list[Vector] = Field(min_length=1, description="one embedding per face, model's size")


class BulkEmbeddings(RequestBody):
    subjects: list[str] = Field(min_length=1, description="subject id of each embedding, same order")
    embeddings: list[Vector] = Field(min_length=1)
    create_subjects: bool = Field(False, description="create subjects that do not exist yet")


# -- gallery --------------------------------------------------------------------------------
MAX_METADATA_BYTES = 8192
#: Characters that reorder or hide text (bidirectional controls, e.g. U+202E) are refused in names.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


#: What the OpenAPI document says of names (the validator below enforces it and trims spaces).
NAME_PATTERN = "^[^\\x00-\\x1f\\x7f-\\x9f\\u061c\\u200e\\u200f\\u202a-\\u202e\\u2066-\\u2069]*$"
#: Subject ids (``service.gallery.store.check_subject_id`` enforces it).
SUBJECT_ID_PATTERN = "^[A-Za-z0-9_.@:-]{1,128}$"


def _no_surrogates(text: str, where: str) -> None:
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not text")


def clean_name(value: str | None) -> str | None:
    """A name as people read it: NFC-normalised, no control characters (NUL, ESC, line breaks,
    tabs), no bidirectional overrides, no lone surrogates; surrounding spaces removed."""
    if value is None:
        return None
    _no_surrogates(value, "the name")
    bad = sorted({f"U+{ord(c):04X}" for c in value if unicodedata.category(c) == "Cc" or c in BIDI_CONTROLS})
    if bad:
        raise ValueError(f"the name holds control characters ({', '.join(bad)}): use plain text")
    return unicodedata.normalize("NFC", value).strip()


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _small_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return value
    for text in _strings(value):
        _no_surrogates(text, "the metadata")
    if len(json.dumps(value)) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata must be at most {MAX_METADATA_BYTES} bytes of JSON")
    return value


class SubjectCreate(RequestBody):
    id: str | None = Field(
        None,
        description="1-128 letters, digits or _ . - @ : (generated when left out)",
        examples=["alice.smith"],
        json_schema_extra={"pattern": SUBJECT_ID_PATTERN},
    )
    name: str | None = Field(
        None, max_length=256, examples=["Alice Smith"], json_schema_extra={"pattern": NAME_PATTERN}
    )
    metadata: dict[str, Any] | None = Field(None, examples=[{"employee": 1042}])

    _check_name = field_validator("name")(clean_name)
    _check_metadata = field_validator("metadata")(_small_metadata)


class SubjectUpdate(RequestBody):
    name: str | None = Field(None, max_length=256, json_schema_extra={"pattern": NAME_PATTERN})
    metadata: dict[str, Any] | None = Field(None, description="replaces the stored metadata")

    _check_name = field_validator("name")(clean_name)
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


class FacePage(BaseModel):
    faces: list[FaceOut]
    total: int = Field(description="the subject's faces (of every model)")
    offset: int
    limit: int
    next_offset: int | None = Field(description="offset of the next page; null on the last page")


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
