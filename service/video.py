"""Video identification, shared by ``POST /v1/identify/video`` and ``sphereface watch``: the limits
and tracker rule from the settings and the model's thresholds, a track's decision as the API's
schema, and the ``track.started`` / ``track.ended`` events' data."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models.manifest import ModelManifest
from models.tracking import Track, TrackedFace, TrackerSettings
from models.video import VideoLimits
from models.video_faces import TrackDecision, VideoFaces
from service.schemas import Candidate, TrackFace, VideoTrack
from service.settings import Settings

#: A face less like its track's mean than the model's verification threshold minus this starts a
#: track of its own (someone else stepped into the box).
SPLIT_MARGIN = 0.2


def video_limits(settings: Settings, sample_fps: float | None = None, *, live: bool = False) -> VideoLimits:
    """The bounds of one video from the settings (a live source has no duration or frame bound)."""
    return VideoLimits(
        sample_fps=sample_fps or settings.video_sample_fps,
        max_seconds=None if live else settings.max_video_seconds,
        max_frames=None if live else settings.max_video_frames,
        max_pixels=settings.max_video_frame_pixels,
    )


def tracker_settings(
    settings: Settings, manifest: ModelManifest, min_faces: int | None = None
) -> TrackerSettings:
    """The tracker's rule: faces join a track at the model's verification threshold (its
    identification one without it; 0.5 without either) and split from it below that minus
    :data:`SPLIT_MARGIN`; decisions on the settings' best faces and minimum."""
    known = manifest.thresholds.get("verification") or manifest.thresholds.get("identification")
    join = known.value if known is not None else 0.5
    return TrackerSettings(
        join_cosine=join,
        split_cosine=join - SPLIT_MARGIN,
        best_n=settings.track_best_faces,
        min_faces=min_faces or settings.track_min_faces,
    )


def video_faces(pipeline, settings: Settings, rule: TrackerSettings, *, keep_regions: bool) -> VideoFaces:
    """A video's faces under the settings' keyframe rule; ``keep_regions``: also keep the region of
    each track's best face (to show an unknown person), unless face images are not stored."""
    keep = keep_regions and settings.store_face_images
    return VideoFaces(
        pipeline, rule, keep_best=_face_region if keep else None, keyframe_every=settings.video_keyframe_every
    )


def _face_region(image: np.ndarray, face):
    """The stored region of a face of ``image``, as the gallery keeps around enrolled faces."""
    from service.gallery.face_images import cut_face_region

    return cut_face_region(image, face.box, face.landmarks)


def track_face(face: TrackedFace) -> TrackFace:
    return TrackFace(
        frame=face.frame, time_s=round(face.time_s, 3), box=[round(float(v), 1) for v in face.box],
        quality=round(face.quality, 4),
    )  # fmt: skip


def track_schema(decision: TrackDecision, names: dict[str, str | None], best_n: int) -> VideoTrack:
    """One decided track as the API answers it."""
    track = decision.track
    candidates = [
        Candidate(subject_id=h.subject_id, name=names.get(h.subject_id), score=h.score, face_id=h.face_id)
        for h in decision.candidates
    ]
    return VideoTrack(
        track_id=track.id,
        status=decision.status,
        subject_id=decision.subject_id,
        name=names.get(decision.subject_id) if decision.subject_id else None,
        score=decision.score,
        candidates=candidates,
        start_s=round(track.start_s, 3),
        end_s=round(track.end_s, 3),
        faces=len(track.faces),
        decided_on=len(track.best(best_n)),
        best_face=track_face(track.best_face()),
        path=[track_face(f) for f in track.faces],
    )


def track_started_data(track: Track, source: str) -> dict:
    """The ``track.started`` event's data: where and when a face was first seen."""
    first = track.faces[0]
    return {"source": source, "track_id": track.id, "time_s": round(first.time_s, 3),
            "box": [round(float(v), 1) for v in first.box]}  # fmt: skip


def track_ended_data(track: VideoTrack, source: str, model_id: str) -> dict:
    """The ``track.ended`` event's data: the track's decision, time span and best face (no
    embeddings, no images)."""
    return {
        "source": source,
        "model": model_id,
        "track_id": track.track_id,
        "status": track.status,
        "subject_id": track.subject_id,
        "score": track.score,
        "start_s": track.start_s,
        "end_s": track.end_s,
        "faces": track.faces,
        "best_face": track.best_face.model_dump(),
    }


def keep_unknown_tracks(pool, decisions: list[TrackDecision], answers: list[VideoTrack], source: str,
                        sha256: str, best_n: int) -> None:  # fmt: skip
    """Keep each ``unknown`` track in the unknown-face pool (its decision embedding, and the region
    of its best face when one was kept) and name the kept face and its cluster in its answer."""
    from service.unknowns.pool import KeptFace

    for decision, answer in zip(decisions, answers, strict=True):
        if answer.status != "unknown":
            continue
        best = decision.track.best_face()
        kept = KeptFace(
            embedding=decision.track.decision_embedding(best_n).astype(np.float32),
            source=source,
            photo_sha256=sha256,
            box=[float(v) for v in best.box],
            detection_score=best.score,
            region=decision.track.best_kept,
        )
        answer.unknown_face_id, answer.cluster_id = pool.add(kept)


#: ``names(subject_ids) -> {id: name}``
NamesFn = Callable[[list[str]], dict[str, str | None]]
