"""A video's faces, frame by frame: detect, track, embed only what the tracker asks for, and time
each stage. The gallery search that decides a track is the caller's (:class:`TrackDecider`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from models.align import align_faces
from models.mtcnn import DetectedFace
from models.pipeline import FacePipeline
from models.quality import face_quality
from models.tracking import FaceTracker, Track, TrackerSettings, box_iou
from models.video import VideoFrame

#: ``quality(face, crop) -> 0..1``: how far a detected face (with its aligned crop) can be trusted.
QualityFn = Callable[[DetectedFace, np.ndarray], float]


def default_quality(face: DetectedFace, crop: np.ndarray) -> float:
    """The face's quality score (:func:`models.quality.face_quality`: detection, size, sharpness,
    pose; no embedding norm, since a face's quality decides whether it is embedded)."""
    return face_quality(float(face.score), face.box, face.landmarks, crop).score


@dataclass
class StageTimes:
    """Seconds spent per stage, and what was counted."""

    seconds: dict[str, float] = field(default_factory=lambda: {"detect": 0.0, "embed": 0.0, "track": 0.0})
    frames: int = 0
    faces: int = 0
    embedded: int = 0

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


#: Around a live track's last box, the region searched between keyframes, in box sides.
REGION_SCALE = 2.5


#: A region is searched at the scale that makes its tracked face about this many pixels across
#: (never enlarged): MTCNN's last stage looks at 48 pixels, so little is lost, and the pyramid of
#: a small region is cheap.
REGION_FACE_PX = 80.0


def detect_near(detector, image: np.ndarray, boxes: list[np.ndarray], scale: float = REGION_SCALE):
    """Faces found in the regions around ``boxes`` (``scale`` box sides, clipped to the image, each
    searched at :data:`REGION_FACE_PX`), in pixels of ``image``; a face found from two regions is
    kept once (the higher score)."""
    height, width = image.shape[:2]
    found: list[DetectedFace] = []
    for box in boxes:
        face_side = max(box[2] - box[0], box[3] - box[1])
        cx, cy, half = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, scale * face_side / 2
        x0, y0 = int(max(0, cx - half)), int(max(0, cy - half))
        x1, y1 = int(min(width, cx + half)), int(min(height, cy + half))
        if x1 - x0 >= 12 and y1 - y0 >= 12:
            found += _detect_region(
                detector, image[y0:y1, x0:x1], (x0, y0), min(1.0, REGION_FACE_PX / face_side)
            )
    return _distinct(found)


def _detect_region(
    detector, region: np.ndarray, corner: tuple[int, int], shrink: float
) -> list[DetectedFace]:
    """The faces of one region, searched at ``shrink`` times its size, in pixels of the image."""
    factors = np.ones(2)
    if shrink < 1.0:
        height, width = region.shape[:2]
        size = (max(12, round(width * shrink)), max(12, round(height * shrink)))
        region = np.asarray(Image.fromarray(np.ascontiguousarray(region)).resize(size, Image.BILINEAR))
        factors = np.array([size[0] / width, size[1] / height])
    offset = np.array(corner, np.float64)
    return [
        DetectedFace(
            np.asarray(f.box) / np.tile(factors, 2) + np.tile(offset, 2),
            f.score,
            (np.asarray(f.landmarks) - 0.5) / factors + 0.5 + offset,  # pixel edges, as faces_to_full
        )
        for f in detector.detect(np.ascontiguousarray(region))
    ]


def _distinct(faces: list[DetectedFace], iou: float = 0.5) -> list[DetectedFace]:
    """``faces`` without the lower-scored of two that overlap by ``iou`` or more."""
    kept: list[DetectedFace] = []
    for face in sorted(faces, key=lambda f: -f.score):
        if not kept or box_iou(np.asarray(face.box)[None], np.stack([k.box for k in kept])).max() < iou:
            kept.append(face)
    return kept


class VideoFaces:
    """Faces of the sampled frames of one video, tracked.

    Args:
        pipeline: the detector, aligner and embedder.
        settings: the tracker's rule.
        quality: a face's quality (default: :func:`default_quality`).
        audit: embed every face and keep ``(time_s, box, embedding)`` of each here, while the
            tracker still gets only the embeddings its rule asks for (the benchmark's per-frame
            decisions); None: embed only those.
        keep_best: ``keep_best(image, face)`` is called with the frame whenever a track's face is
            its best so far, and what it returns is kept as the track's ``best_kept`` (the service
            keeps the face's region, to show an unknown person); None: nothing is kept.
        keyframe_every: detect in the whole frame every this many sampled frames; in the frames
            between, only around the boxes of the tracks seen in the last ``box_gap_s``
            (:func:`detect_near`), and not at all when there are none. A new face is found at the
            next keyframe. 1: every frame whole.
    """

    def __init__(
        self,
        pipeline: FacePipeline,
        settings: TrackerSettings,
        quality: QualityFn = default_quality,
        audit: list | None = None,
        keep_best: Callable[[np.ndarray, DetectedFace], object] | None = None,
        keyframe_every: int = 1,
    ) -> None:
        self.keyframe_every = max(1, keyframe_every)
        self.audit = audit
        self.keep_best = keep_best
        self.pipeline = pipeline
        self.tracker = FaceTracker(settings)
        self.quality = quality
        self.times = StageTimes()
        self.ended: list[Track] = []

    def frame(self, frame: VideoFrame) -> tuple[list[Track], list[Track]]:
        """One sampled frame through detection, tracking and embedding; the tracks it started
        and ended."""
        clock = time.perf_counter()
        found = self._detect(frame)
        self.times.add("detect", time.perf_counter() - clock)
        self.times.frames += 1
        self.times.faces += len(found)
        if not found:
            return self._update(frame, [], np.zeros((0, 4)), [], [])
        boxes = np.stack([np.asarray(f.box, np.float64) for f in found])
        crops = align_faces(frame.image, np.stack([f.landmarks for f in found]), self.pipeline.template)
        qualities = [self.quality(f, crops[d]) for d, f in enumerate(found)]
        return self._update(frame, found, boxes, qualities, crops)

    def _detect(self, frame: VideoFrame) -> list[DetectedFace]:
        """The frame's faces: the whole frame on a keyframe, else around the recent tracks."""
        gap = self.tracker.settings.box_gap_s
        recent = [t.last.box for t in self.tracker.live if frame.time_s - t.end_s <= gap]
        if frame.index % self.keyframe_every == 0:
            return self.pipeline.detector.detect(frame.image)
        return detect_near(self.pipeline.detector, frame.image, recent) if recent else []

    def _update(self, frame: VideoFrame, found, boxes: np.ndarray, qualities: list[float], crops):
        clock = time.perf_counter()
        plan = self.tracker.plan(frame.index, frame.time_s, boxes, qualities)
        self.times.add("track", time.perf_counter() - clock)
        embeddings: list[np.ndarray | None] = [None] * len(found)
        if self.audit is not None and len(found):
            every = self.pipeline.embed_aligned(crops)
            self.audit.extend((frame.time_s, boxes[d], every[d]) for d in range(len(found)))
            for d in plan.embed:
                embeddings[d] = every[d]
        elif plan.embed:
            clock = time.perf_counter()
            vectors = self.pipeline.embed_aligned(crops[plan.embed])
            self.times.add("embed", time.perf_counter() - clock)
            self.times.embedded += len(plan.embed)
            for d, v in zip(plan.embed, vectors, strict=True):
                embeddings[d] = v
        clock = time.perf_counter()
        scores = [float(f.score) for f in found]
        changed = self.tracker.update(plan, frame.index, frame.time_s, boxes, scores, qualities, embeddings)
        self.times.add("track", time.perf_counter() - clock)
        self.ended.extend(changed[1])
        if self.keep_best is not None:
            self._keep_best(frame, found)
        return changed

    def _keep_best(self, frame: VideoFrame, found: list[DetectedFace]) -> None:
        """Keep what ``keep_best`` makes of each face of this frame that is its track's best."""
        for track in self.tracker.live:
            face = track.last
            if face.frame == frame.index and track.top is face:
                track.best_kept = self.keep_best(frame.image, found[face.detection])

    def finish(self) -> list[Track]:
        """End the live tracks (the video ended); every track of the video, in the order they started."""
        self.ended.extend(self.tracker.finish())
        return sorted(self.ended, key=lambda t: t.id)


@dataclass
class TrackDecision:
    """A track's one decision: ``status`` known or unknown, the subject when known, the best
    score, and the candidates ``(subject_id, score, face_id)`` best first."""

    track: Track
    status: str
    subject_id: str | None
    score: float | None
    candidates: list = field(default_factory=list)


#: ``search(vectors (N x D), k) -> per vector, hits with .subject_id, .score, .face_id, best first``
SearchFn = Callable[[np.ndarray, int], list[list]]


def decide_tracks(
    tracks: list[Track], search: SearchFn, threshold: float, settings: TrackerSettings, k: int = 1
) -> tuple[list[TrackDecision], int]:
    """One decision per track of at least ``settings.min_faces`` faces, from the mean of its best
    ``settings.best_n`` embedded faces (:meth:`Track.decision_embedding`); known when the best
    subject's cosine reaches ``threshold``. Returns the decisions and the number of tracks too
    short to decide."""
    kept = [t for t in tracks if len(t.faces) >= settings.min_faces and t.best(1)]
    if not kept:
        return [], len(tracks)
    vectors = np.stack([t.decision_embedding(settings.best_n) for t in kept]).astype(np.float32)
    results = search(vectors, k)
    decisions = []
    for track, hits in zip(kept, results, strict=True):
        best = hits[0] if hits else None
        known = best is not None and best.score >= threshold
        decisions.append(
            TrackDecision(
                track,
                "known" if known else "unknown",
                best.subject_id if known else None,
                float(best.score) if best is not None else None,
                list(hits),
            )
        )
    return decisions, len(tracks) - len(kept)
