"""Faces followed across the sampled frames of a video: one track per appearance of a person.

The rule, per sampled frame (numpy only; the caller detects, embeds and searches):

1. **By box.** Every live track seen within ``box_gap_s`` is paired with the detection whose box
   overlaps its last box most, greedily from the largest overlap, when the intersection over
   union is at least ``TrackerSettings.box_iou``.
2. **What to embed.** A detection without a pair is always embedded. A paired one is embedded only
   when its track still wants it: the track has fewer than ``best_n`` embedded faces, the face is
   better (by its quality, 0-1: :func:`models.quality.face_quality`) than the worst of the
   track's best ``best_n``, or ``reembed_every`` sampled frames went by since the track's last
   embedding (``reembed_every=1`` embeds every face: the baseline tracking is measured against).
3. **By likeness.** A paired face whose embedding is less like its track's mean than
   ``split_cosine`` starts a track of its own (another person stepped into the box). A face
   without a pair joins the live track (unpaired this frame) whose mean it is most like, at least
   ``join_cosine``: a person who was missed for a few frames (blurred, turned away), or moved fast.
4. **Ends.** A track not seen for ``max_gap_s`` seconds of the video's clock ends.

A track's decision (made by the caller, :func:`Track.decision_embedding`) uses its best
``best_n`` faces by quality: the mean of their embeddings, normalised; a track of fewer than
``min_faces`` faces gets no decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TrackerSettings:
    """The tracker's rule (see the module); cosines are of the model's unit embeddings."""

    box_iou: float = 0.3
    join_cosine: float = 0.5
    split_cosine: float = 0.2
    box_gap_s: float = 0.5
    max_gap_s: float = 3.0
    best_n: int = 5
    min_faces: int = 3
    reembed_every: int = 10


@dataclass
class TrackedFace:
    """One face of a track: the sampled frame, its time (s), box (x1, y1, x2, y2), detection
    score, quality (0-1) and embedding (None when tracking skipped it)."""

    frame: int
    time_s: float
    box: np.ndarray
    score: float
    quality: float
    embedding: np.ndarray | None = None
    detection: int = -1  # its place among the frame's detections


@dataclass
class Track:
    """The faces of one appearance of a person, in order."""

    id: int
    faces: list[TrackedFace] = field(default_factory=list)
    embedding_sum: np.ndarray | None = None
    embedded_at: int = -(10**9)
    #: how many of the best embedded faces are kept ranked (``TrackerSettings.best_n``)
    keep: int = 5
    #: the best ``keep`` embedded faces, best first (kept as faces arrive: a long track is not re-sorted)
    ranked: list[TrackedFace] = field(default_factory=list)
    #: the face of highest quality so far, embedded or not (the earliest among equals)
    top: TrackedFace | None = None
    #: what the caller kept of ``top`` (e.g. the face's region of its frame)
    best_kept: object = None

    @property
    def last(self) -> TrackedFace:
        return self.faces[-1]

    @property
    def start_s(self) -> float:
        return self.faces[0].time_s

    @property
    def end_s(self) -> float:
        return self.faces[-1].time_s

    def mean(self) -> np.ndarray | None:
        """The unit mean of the track's embeddings (None before the first)."""
        if self.embedding_sum is None:
            return None
        return self.embedding_sum / max(float(np.linalg.norm(self.embedding_sum)), 1e-12)

    def best(self, n: int) -> list[TrackedFace]:
        """The ``n`` (at most ``keep``) embedded faces of highest quality, earliest first among equals."""
        return self.ranked[:n]

    def best_face(self) -> TrackedFace:
        """The track's face of highest quality (embedded or not)."""
        return self.top

    def decision_embedding(self, n: int) -> np.ndarray | None:
        """The unit mean embedding of the best ``n`` faces (None without any)."""
        best = self.best(n)
        if not best:
            return None
        total = np.sum([f.embedding for f in best], axis=0)
        return total / max(float(np.linalg.norm(total)), 1e-12)

    def add(self, face: TrackedFace) -> None:
        self.faces.append(face)
        if self.top is None or face.quality > self.top.quality:
            self.top = face
        if face.embedding is not None:
            e = np.asarray(face.embedding, np.float64)
            self.embedding_sum = e.copy() if self.embedding_sum is None else self.embedding_sum + e
            self.embedded_at = face.frame
            self.ranked = sorted([*self.ranked, face], key=lambda f: (-f.quality, f.frame))[: self.keep]

    def wants_embedding(self, quality: float, frame: int, settings: TrackerSettings) -> bool:
        """Whether a face paired by box should be embedded (rule 2 of the module)."""
        best = self.best(settings.best_n)
        if len(best) < settings.best_n or quality > best[-1].quality:
            return True
        return frame - self.embedded_at >= settings.reembed_every


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box of ``a`` (N x 4) with every box of ``b`` (M x 4)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-12)


def greedy_pairs(score: np.ndarray, minimum: float) -> list[tuple[int, int]]:
    """Pairs (row, column) taken greedily from the highest score, each row and column once,
    while the score is at least ``minimum``."""
    pairs: list[tuple[int, int]] = []
    if score.size == 0:
        return pairs
    order = np.dstack(np.unravel_index(np.argsort(-score, axis=None), score.shape))[0]
    rows, cols = set(), set()
    for r, c in order:
        if score[r, c] < minimum:
            break
        if r in rows or c in cols:
            continue
        pairs.append((int(r), int(c)))
        rows.add(r)
        cols.add(c)
    return pairs


@dataclass
class FramePlan:
    """What the tracker asks of one frame: ``pairs[d]`` is the track paired with detection ``d``
    by box (None: none), and ``embed`` lists the detections to embed."""

    pairs: list[Track | None]
    embed: list[int]


class FaceTracker:
    """Tracks faces over a video's sampled frames (see the module for the rule).

    Use per frame: ``plan = tracker.plan(frame, time_s, boxes, qualities)``, embed the faces
    ``plan.embed`` names, then ``started, ended = tracker.update(plan, frame, time_s, boxes,
    scores, qualities, embeddings)`` with ``embeddings[d]`` None for a face not embedded; at the
    end, :meth:`finish` ends the live tracks."""

    def __init__(self, settings: TrackerSettings = TrackerSettings()) -> None:
        self.settings = settings
        self.live: list[Track] = []
        self.next_id = 1

    def plan(self, frame: int, time_s: float, boxes: np.ndarray, qualities: list[float]) -> FramePlan:
        """Pair detections with live tracks by box and say which to embed (rules 1 and 2)."""
        pairs: list[Track | None] = [None] * len(qualities)
        recent = [t for t in self.live if time_s - t.end_s <= self.settings.box_gap_s]
        if recent and len(qualities):
            last = np.stack([t.last.box for t in recent])
            for t, d in greedy_pairs(box_iou(last, boxes), self.settings.box_iou):
                pairs[d] = recent[t]
        embed = [
            d
            for d, track in enumerate(pairs)
            if track is None or track.wants_embedding(qualities[d], frame, self.settings)
        ]
        return FramePlan(pairs, embed)

    def update(
        self,
        plan: FramePlan,
        frame: int,
        time_s: float,
        boxes: np.ndarray,
        scores: list[float],
        qualities: list[float],
        embeddings: list[np.ndarray | None],
    ) -> tuple[list[Track], list[Track]]:
        """Add the frame's faces to tracks (rules 3 and 4); returns the tracks started and ended."""
        faces = [
            TrackedFace(
                frame, time_s, np.asarray(boxes[d], np.float64), float(scores[d]), qualities[d], embeddings[d]
            )
            for d in range(len(qualities))
        ]
        pairs = self._split_unlike(plan.pairs, faces)
        self._join_by_likeness(pairs, faces)
        started = []
        for d, face in enumerate(faces):
            if pairs[d] is None:
                pairs[d] = Track(self.next_id, keep=self.settings.best_n)
                self.next_id += 1
                self.live.append(pairs[d])
                started.append(pairs[d])
            pairs[d].add(face)
        return started, self._end_quiet(time_s)

    def finish(self) -> list[Track]:
        """End every live track (the video ended)."""
        ended, self.live = self.live, []
        return ended

    def _split_unlike(self, pairs: list[Track | None], faces: list[TrackedFace]) -> list[Track | None]:
        """Unpair a face whose embedding is unlike its box-paired track's mean (rule 3)."""
        out = list(pairs)
        for d, track in enumerate(pairs):
            mean = track.mean() if track is not None else None
            embedding = faces[d].embedding
            if (
                mean is not None
                and embedding is not None
                and float(mean @ embedding) < self.settings.split_cosine
            ):
                out[d] = None
        return out

    def _join_by_likeness(self, pairs: list[Track | None], faces: list[TrackedFace]) -> None:
        """Pair faces left alone with live tracks unpaired this frame by embedding (rule 3)."""
        taken = {id(t) for t in pairs if t is not None}
        free = [t for t in self.live if id(t) not in taken and t.mean() is not None]
        alone = [d for d, t in enumerate(pairs) if t is None and faces[d].embedding is not None]
        if not free or not alone:
            return
        means = np.stack([t.mean() for t in free])
        likeness = means @ np.stack([faces[d].embedding for d in alone]).T
        for t, a in greedy_pairs(likeness, self.settings.join_cosine):
            pairs[alone[a]] = free[t]

    def _end_quiet(self, time_s: float) -> list[Track]:
        """End the tracks not seen for ``max_gap_s`` (rule 4)."""
        ended = [t for t in self.live if time_s - t.end_s > self.settings.max_gap_s]
        self.live = [t for t in self.live if t not in ended]
        return ended
