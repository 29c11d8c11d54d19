"""Request and response models of the REST API (shown with examples at /docs)."""

from __future__ import annotations

from pydantic import BaseModel, Field


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
    faces: list[Face] = Field(description="the face used from each photo, in request order")


class Health(BaseModel):
    status: str


class Ready(BaseModel):
    status: str
    model_id: str | None = None
    provider: str | None = None
