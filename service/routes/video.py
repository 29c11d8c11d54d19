"""Identification in a video clip: the people in it as tracks, one decision each."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool

from models.video import VideoTooLargeError, sample_frames
from models.video_faces import VideoFaces, decide_tracks
from service.auth import require_read
from service.events.stream import TRACK_ENDED, Event, EventStream
from service.routes.common import FaceWork, StrictRoute, form_files, get_face_work, openapi_body, read_form
from service.routes.identify import chosen_threshold
from service.schemas import ErrorResponse, VideoIdentifyResponse
from service.video import (
    keep_unknown_tracks,
    track_ended_data,
    track_schema,
    tracker_settings,
    video_faces,
    video_limits,
)

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 413, 415, 422, 503)}
router = APIRouter(
    tags=["video"], responses=ERRORS, dependencies=[Depends(require_read)], route_class=StrictRoute
)


@router.post(
    "/identify/video",
    operation_id="identify_video",
    response_model=VideoIdentifyResponse,
    summary="Who is in this clip? One decision per person's appearance (track)",
    openapi_extra=openapi_body({"video": "a video clip (MP4, MKV, WebM, MOV, AVI, ...)"}),
)
async def identify_video(
    request: Request,
    work: Annotated[FaceWork, Depends(get_face_work)],
    sample_fps: Annotated[
        float | None, Query(gt=0, le=30, description="frames sampled per second (default: server setting)")
    ] = None,
    k: Annotated[int | None, Query(ge=1, le=100, description="subjects per track")] = None,
    min_faces: Annotated[
        int | None,
        Query(ge=1, le=1000, description="faces a track needs for a decision (default: server setting)"),
    ] = None,
    threshold: Annotated[
        float | None,
        Query(ge=-1, le=1, description="cosine threshold instead of the model's identification threshold"),
    ] = None,
    source: Annotated[
        str | None,
        Query(max_length=128, description="where the clip comes from (a camera), kept with unknown tracks"),
    ] = None,
) -> VideoIdentifyResponse:
    """Send a clip (multipart field `video`). Frames are sampled at `sample_fps`, faces are
    detected and followed across frames (box overlap, then embedding likeness), and each track
    of at least `min_faces` faces gets one decision: the mean embedding of its best faces
    (by quality) against the gallery, `known` when the best subject reaches the threshold. Clips
    over the size, duration or frame limits are refused (413 `video_too_large`, 422
    `video_too_long`); undecodable or truncated ones are 422 `unreadable_video`. With
    `SPHEREFACE_KEEP_UNKNOWN=true` each `unknown` track is kept as one unknown face (its decision
    embedding, the region of its best face) and clustered like identify's."""
    form = await read_form(request, max_files=1, what="the clip (field `video`)")
    settings = work.settings
    chosen = chosen_threshold(work, threshold)
    k = k or settings.identify_top_k
    upload = form_files(form, "video")[0]
    data = await run_in_threadpool(_read_clip, upload, settings.max_video_bytes)
    manifest = work.pipeline.manifest
    rule = tracker_settings(settings, manifest, min_faces)
    state = request.app.state
    faces = video_faces(work.pipeline, settings, rule, keep_regions=state.unknowns is not None)
    frames = sample_frames(data, video_limits(settings, sample_fps), name=upload.filename or "video")
    last_time = 0.0
    try:
        while (frame := await work.in_turn(_next_frame, faces, frames)) is not None:
            last_time = frame
    finally:
        frames.close()  # the container closes at once, also after an error or a lost client
    tracks = faces.finish()
    decided, answers, short = await work.off_turn(_decide, state, tracks, rule, chosen[0], k)
    name = upload.filename or "video"
    if state.unknowns is not None:
        sha = hashlib.sha256(data).hexdigest()
        where = source or f"video:{name}"
        await work.off_turn(keep_unknown_tracks, state.unknowns, decided, answers, where, sha, rule.best_n)
    answer = VideoIdentifyResponse(
        model_id=manifest.model_id, threshold=chosen[0], threshold_far=chosen[1], threshold_source=chosen[2],
        k=k, sample_fps=sample_fps or settings.video_sample_fps, frames=faces.times.frames,
        duration_s=round(last_time, 3), faces=faces.times.faces, embedded=faces.times.embedded,
        short_tracks=short, tracks=answers,
    )  # fmt: skip
    events: EventStream = state.events
    if events.identification and answer.tracks:
        source = f"upload:{name}"
        published = [
            Event(TRACK_ENDED, track_ended_data(t, source, manifest.model_id)) for t in answer.tracks
        ]
        await work.off_turn(events.publish, published)
    return answer


def _read_clip(upload, limit: int) -> bytes:
    """The clip's bytes, at most ``limit`` (413 ``video_too_large`` beyond)."""
    upload.file.seek(0)
    data = upload.file.read(limit + 1)
    if len(data) > limit:
        raise VideoTooLargeError(f"{upload.filename or 'video'} is larger than {limit} bytes")
    return data


def _next_frame(faces: VideoFaces, frames) -> float | None:
    """Decode the next sampled frame and track its faces (a face-path turn's work); its time, or
    None at the end of the clip."""
    frame = next(frames, None)
    if frame is None:
        return None
    faces.frame(frame)
    return frame.time_s


def _decide(state, tracks, rule, threshold: float, k: int):
    """Every track's decision, as the API answers it too, and the number too short to decide
    (Redis work)."""
    decisions, short = decide_tracks(tracks, state.search.search, threshold, rule, k)
    ids = sorted({h.subject_id for d in decisions for h in d.candidates})
    names = state.store.subject_names(ids)
    return decisions, [track_schema(d, names, rule.best_n) for d in decisions], short
