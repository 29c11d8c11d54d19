"""Request and response models of ``/v1/unknowns`` (the kept unknown faces and their clusters)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class UnknownFaceOut(BaseModel):
    id: str
    cluster_id: str
    created_at: str = Field(description="when identify saw the face (UTC)")
    source: str = Field(description="the `source` identify was given (default `identify`)")
    photo_sha256: str = Field(description="SHA-256 of the photo's bytes")
    box: list[float] | None = None
    detection_score: float | None = None
    has_image: bool = Field(
        description="the region around the face is stored: GET /v1/unknowns/faces/{id}/image"
    )


class MergeRule(BaseModel):
    threshold: float = Field(
        description="cosine a face needs to its cluster's closest faces (mean of up to 3)"
    )
    threshold_far: float | None = Field(
        description="false-accept rate per comparison the threshold was calibrated for"
    )
    threshold_name: str = Field(description="the model's threshold used (manifest key)")
    false_merge_rate: float | None = Field(
        description="measured on every LFW photo, clustered in a shuffled order with nobody enrolled: "
        "the fraction of same-cluster face pairs that are two different people (1 - pairwise precision)"
    )
    mixed_cluster_rate: float | None = Field(
        None,
        description="measured likewise: the fraction of clusters of 2 or more faces holding 2 or more people",
    )


class UnknownClusterOut(BaseModel):
    id: str
    faces: int = Field(description="faces kept in the cluster")
    first_seen: str
    last_seen: str
    representatives: list[UnknownFaceOut] = Field(description="up to 3 faces nearest the cluster's mean")


class UnknownClusterPage(BaseModel):
    model_id: str
    rule: MergeRule
    clusters: list[UnknownClusterOut]
    total: int = Field(description="clusters with at least `min_faces` faces")
    pooled_faces: int = Field(description="unknown faces kept for this model")
    offset: int
    limit: int
    next_offset: int | None


class UnknownClusterDetail(BaseModel):
    id: str
    model_id: str
    rule: MergeRule
    faces: list[UnknownFaceOut] = Field(description="every face of the cluster, oldest first")


class ClusterEnroll(BaseModel):
    subject_id: str = Field(max_length=128, description="the subject the cluster's faces are enrolled for")
    create_subject: bool = Field(False, description="create the subject when it does not exist")
    name: str | None = Field(None, max_length=200, description="the new subject's name (with create_subject)")


class ClusterEnrolled(BaseModel):
    cluster_id: str
    subject_id: str
    subject_created: bool
    enrolled: list[str] = Field(description="the gallery face ids made from the cluster's faces")
    failed: int = Field(description="faces not enrolled (e.g. the subject's face limit)")
    left_pool: int = Field(
        description="unknown faces removed from the pool, the cluster's and others now known"
    )


class UnknownsDeleted(BaseModel):
    removed: int = Field(description="unknown faces removed")
