"""Request and response models of the REST API (shown with examples at /docs)."""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ErrorResponse(BaseModel):
    code: str = Field(examples=["no_face"], description="machine-readable error code")
    message: str = Field(examples=["no face was found in the photo"], description="for people")


QUALITY_DESCRIPTION = (
    "face quality in [0, 1]: the estimated probability that this face is recognised (matches a "
    "typical photo of the same person at a false match rate of 1e-3), from the detection score, "
    "the face's size, its sharpness, its pose and the embedding's norm; null without a photo"
)


class Face(BaseModel):
    box: list[float] = Field(
        description="x1, y1, x2, y2 in pixels of the upright photo", examples=[[120.0, 80.0, 260.0, 250.0]]
    )
    landmarks: list[list[float]] = Field(
        description="5 (x, y) points: left eye, right eye, nose, left and right mouth corners"
    )
    detection_score: float = Field(ge=0, le=1, description="MTCNN O-Net face probability")
    quality: float | None = Field(None, ge=0, le=1, description=QUALITY_DESCRIPTION, examples=[0.93])


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
    as ``nmae`` must not pass unnoticed), and values are taken as they are typed (strict): a
    number is a JSON number, not a string such as ``"0.1"`` nor ``true``; a flag is ``true`` or
    ``false``, not ``1`` nor ``"yes"``. Integers are numbers (``1`` is ``1.0``)."""

    model_config = ConfigDict(extra="forbid", strict=True)


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
#: Unicode categories refused in names: controls (Cc: NUL, ESC, CR, LF, tab ...), format
#: characters (Cf: zero-width spaces and joiners, the soft hyphen, bidirectional controls such as
#: U+202E, tags), line and paragraph separators (Zl, Zp: U+2028, U+2029). A name is one line of
#: visible text; these would hide, reorder or break it where it is shown or logged.
NAME_REFUSED_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


#: The Unicode planes searched for them: the others hold only ideographs (2, 3), nothing yet (4-13)
#: or private use characters (15, 16).
NAME_SCANNED_PLANES = (0, 1, 14)


def _refused_ranges() -> list[tuple[int, int]]:
    """The code point ranges of :data:`NAME_REFUSED_CATEGORIES` (this Python's Unicode data)."""
    ranges: list[tuple[int, int]] = []
    for code in (c for plane in NAME_SCANNED_PLANES for c in range(plane << 16, (plane + 1) << 16)):
        if unicodedata.category(chr(code)) in NAME_REFUSED_CATEGORIES:
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1] = (ranges[-1][0], code)
            else:
                ranges.append((code, code))
    return ranges


def _class_char(code: int) -> str:
    """A code point in a regex character class: escaped in the BMP (``\\xNN``, ``\\uNNNN``, read
    alike by ECMA-262 and Python), the character itself beyond (no escape means it in both)."""
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)


#: What the OpenAPI document says of names: no character of :data:`NAME_REFUSED_CATEGORIES`
#: (the validator below enforces this very pattern, and trims spaces).
NAME_PATTERN = (
    "^[^"
    + "".join(
        _class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in _refused_ranges()
    )
    + "]*$"
)
_NAME_REFUSED = re.compile(NAME_PATTERN[1:-2].replace("[^", "[", 1))
#: Subject ids: 1-128 letters, digits or ``_ . - @ :``, not only dots (``.`` and ``..`` are path
#: segments that URLs drop: such a subject could not be addressed). Enforced by
#: ``service.gallery.store.check_subject_id``.
SUBJECT_ID_PATTERN = "^[A-Za-z0-9_.@:-]*[A-Za-z0-9_@:-][A-Za-z0-9_.@:-]*$"


def _no_surrogates(text: str, where: str) -> None:
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not text")


def clean_name(value: str | None) -> str | None:
    """A name as people read it: NFC-normalised, one line of visible text (no character of
    :data:`NAME_REFUSED_CATEGORIES`), no lone surrogates; surrounding spaces removed."""
    if value is None:
        return None
    _no_surrogates(value, "the name")
    bad = sorted({f"U+{ord(c):04X}" for c in _NAME_REFUSED.findall(value)})
    if bad:
        raise ValueError(
            f"the name holds control characters or invisible format characters ({', '.join(bad[:8])}): "
            "use one line of plain text"
        )
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
        description="1-128 letters, digits or _ . - @ :, not only dots (generated when left out)",
        examples=["alice.smith"],
        json_schema_extra={"pattern": SUBJECT_ID_PATTERN, "minLength": 1, "maxLength": 128},
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
    quality: float | None = Field(None, ge=0, le=1, description=QUALITY_DESCRIPTION)
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
        "low_quality, duplicate_photo, subject_not_found, invalid_embedding, invalid_request"
    )
    message: str | None = None
    reason: Literal["too_small", "blurred", "turned_away", "unclear_face"] | None = Field(
        None, description="low_quality only: what lowers the face's quality most"
    )
    quality: float | None = Field(None, ge=0, le=1, description="low_quality only: the face's quality")
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
    quality: float | None = Field(None, ge=0, le=1, description=QUALITY_DESCRIPTION)
    status: Literal["known", "unknown"] = Field(
        description="known: the best subject reaches the threshold; unknown: no subject does"
    )
    subject_id: str | None = Field(description="the best subject when known")
    name: str | None = None
    score: float | None = Field(description="the best subject's score (null with an empty gallery)")
    candidates: list[Candidate] = Field(description="top-k subjects, best first")
    unknown_face_id: str | None = Field(
        None, description="an unknown face kept (SPHEREFACE_KEEP_UNKNOWN): its id under /v1/unknowns"
    )
    cluster_id: str | None = Field(None, description="the unknown-face cluster that face is in now")


class IdentifyResponse(BaseModel):
    model_id: str
    threshold: float
    threshold_far: float | None
    threshold_source: str | None
    k: int
    gallery_faces: int = Field(description="faces of this model searched")
    faces: list[IdentifiedFace]


class TrackFace(BaseModel):
    frame: int = Field(description="the sampled frame's number (0 is the first sampled frame)")
    time_s: float = Field(description="seconds from the video's first frame")
    box: list[float] = Field(description="x1, y1, x2, y2 in pixels of the frame")
    quality: float = Field(ge=0, le=1, description="how far the face can be trusted (0-1)")


class VideoTrack(BaseModel):
    track_id: int = Field(description="1, 2, ... in the order the tracks started")
    status: Literal["known", "unknown"] = Field(
        description="known: the track's best faces reach the threshold for `subject_id`; "
        "unknown: no subject does"
    )
    subject_id: str | None = Field(description="the subject when known")
    name: str | None = None
    score: float | None = Field(description="cosine of the best subject to the track's decision embedding")
    candidates: list[Candidate] = Field(description="top-k subjects, best first")
    start_s: float
    end_s: float
    faces: int = Field(description="faces of the track (one per sampled frame it is seen in)")
    decided_on: int = Field(description="faces whose mean embedding made the decision (its best ones)")
    best_face: TrackFace
    path: list[TrackFace] = Field(description="the track's faces in order: its boxes over time")
    unknown_face_id: str | None = Field(
        None,
        description="with SPHEREFACE_KEEP_UNKNOWN=true, an unknown track's kept face (its decision "
        "embedding and the region of its best face)",
    )
    cluster_id: str | None = Field(None, description="the unknown-face cluster that face is in now")


class VideoIdentifyResponse(BaseModel):
    model_id: str
    threshold: float
    threshold_far: float | None
    threshold_source: str | None
    k: int
    sample_fps: float = Field(description="frames sampled per second of video")
    frames: int = Field(description="frames sampled")
    duration_s: float = Field(description="time of the last sampled frame")
    faces: int = Field(description="faces detected in all sampled frames")
    embedded: int = Field(description="faces embedded (tracking skips faces its track does not need)")
    short_tracks: int = Field(
        description="tracks of fewer than `min_faces` faces, left undecided and unlisted"
    )
    tracks: list[VideoTrack]
