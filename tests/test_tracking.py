"""The tracker's rule on boxes and embeddings made in the test (models/tracking.py), and the track
decision (models/video_faces.decide_tracks)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from models.tracking import FaceTracker, TrackerSettings, box_iou, greedy_pairs
from models.video_faces import decide_tracks

RNG = np.random.default_rng(0)
PEOPLE = {n: v / np.linalg.norm(v) for n, v in ((n, RNG.normal(size=64)) for n in ("ann", "bob", "cat"))}


def seen(name: str, noise: float = 0.05) -> np.ndarray:
    v = PEOPLE[name] + RNG.normal(scale=noise, size=64)
    return v / np.linalg.norm(v)


def run(tracker: FaceTracker, frames: list[list[tuple[str, list[float]]]], fps: float = 5.0):
    """Feed frames of (person, box); returns every track (ended and live) and the faces embedded."""
    tracks, embedded = [], 0
    for i, faces in enumerate(frames):
        boxes = np.array([b for _, b in faces], np.float64).reshape(-1, 4)
        qualities = [0.9] * len(faces)
        plan = tracker.plan(i, i / fps, boxes, qualities)
        embeddings = [seen(faces[d][0]) if d in plan.embed else None for d in range(len(faces))]
        embedded += len(plan.embed)
        started, ended = tracker.update(plan, i, i / fps, boxes, [0.99] * len(faces), qualities, embeddings)
        tracks += ended
    return tracks + tracker.finish(), embedded


def box(x: float, y: float = 100, side: float = 80) -> list[float]:
    return [x, y, x + side, y + side]


def names_of(track, frames) -> set[str]:
    return {next(n for n, b in frames[f.frame] if np.allclose(b, f.box)) for f in track.faces}


def test_box_overlap_and_greedy_pairs():
    iou = box_iou(np.array([box(0), box(200)]), np.array([box(40), box(0)]))
    assert np.allclose(iou, [[40 * 80 / (2 * 6400 - 40 * 80), 1.0], [0.0, 0.0]])
    assert greedy_pairs(np.array([[0.9, 0.8], [0.85, 0.1]]), 0.5) == [(0, 0)]
    assert greedy_pairs(np.array([[0.9, 0.8], [0.85, 0.1]]).T, 0.5) == [(0, 0)]
    assert greedy_pairs(np.array([[0.2, 0.8], [0.85, 0.1]]), 0.5) == [(1, 0), (0, 1)]


def test_two_people_walking_apart_keep_one_track_each_and_tracked_faces_are_not_all_embedded():
    frames = [[("ann", box(100 + 10 * i)), ("bob", box(500 - 10 * i, 300))] for i in range(30)]
    tracks, embedded = run(FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5)), frames)
    assert [len(t.faces) for t in tracks] == [30, 30]
    assert [names_of(t, frames) for t in tracks] == [{"ann"}, {"bob"}]
    assert embedded < 60 and embedded >= 2 * 5  # the best five each, then one in ten
    baseline, every = run(
        FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5, reembed_every=1)), frames
    )
    assert every == 60 and [len(t.faces) for t in baseline] == [30, 30]


def test_someone_else_in_the_same_box_starts_a_new_track():
    frames = [[("ann", box(100))]] * 10 + [[("cat", box(102))]] * 10
    tracker = FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5, reembed_every=1))
    tracks, _ = run(tracker, frames)
    assert [(len(t.faces), names_of(t, frames)) for t in tracks] == [(10, {"ann"}), (10, {"cat"})]


def test_a_short_gap_rejoins_by_likeness_and_a_long_one_ends_the_track():
    gap = [[]] * 10  # 2 s at 5 fps: shorter than max_gap_s = 3
    frames = (
        [[("ann", box(100))]] * 5 + gap + [[("ann", box(400))]] * 5 + [[]] * 20 + [[("ann", box(100))]] * 5
    )
    tracks, _ = run(FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5)), frames)
    assert [len(t.faces) for t in tracks] == [10, 5]
    assert tracks[0].end_s - tracks[0].start_s > 3.0


def test_a_track_is_decided_on_its_best_faces_and_short_tracks_are_not_decided():
    frames = [[("ann", box(100))]] * 6 + [[("bob", box(600))]] * 2
    tracks, _ = run(FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5, min_faces=3)), frames)
    gallery = {"ann": PEOPLE["ann"]}

    def search(vectors, k):
        return [[SimpleNamespace(subject_id=s, score=float(v @ g), face_id="f1") for s, g in gallery.items()]
                for v in vectors]  # fmt: skip

    decisions, short = decide_tracks(tracks, search, 0.9, TrackerSettings(min_faces=3), k=1)
    assert short == 1 and len(decisions) == 1
    assert (decisions[0].status, decisions[0].subject_id) == ("known", "ann") and decisions[0].score > 0.9
    stranger_tracks, _ = run(
        FaceTracker(TrackerSettings(join_cosine=0.8, split_cosine=0.5)), [[("cat", box(0))]] * 4
    )
    unknown, _ = decide_tracks(stranger_tracks, search, 0.9, TrackerSettings(min_faces=3))
    assert (unknown[0].status, unknown[0].subject_id) == ("unknown", None)
