"""Video identification: decision accuracy per track against per frame, track purity, and the frames
per second one worker sustains at 720p and 1080p, with where the time goes.

    .venv/bin/python bench/video.py --json docs/results/bench_video.json   # make bench-video

**Accuracy.** ``--clips`` clips (640x360, 25 fps, 10 s; seed i for clip i) made from LFW photos
(``bench/video_clip.py``): in each, two people of the gallery and two strangers walk across the
frame at random, their faces 40 to 120 px across, each blurred (Gaussian, 1.5 to 4 px) for a random
third of its time, the strangers coming in as the others go. The gallery (in memory; the service's
decision: the best subject's cosine against the model's identification threshold) holds one other
photo of each of ``--gallery`` LFW people, the clips' people among them. Every detected face is
scored against the truth (the actor whose face box it overlaps most, IoU >= 0.3; a face with
no such actor, e.g. a second person beside the face in an LFW photo, is not scored, nor a track
made of such faces): **per frame** each face decided alone (every face embedded); **per track**
each track's one decision (models/video_faces.py) counted once per track, and also once per face
it holds. **Purity**: the share of a track's faces that are its main actor's, over all tracked
faces.

**Cost.** One 10 s clip of two people per resolution (1280x720, 1920x1080), sampled at
``--sample-fps``, through decode, detect (the service's settings: detection at 1024 px on the
longer side), track and embed, three ways: every face detected in the whole frame and embedded
(``reembed_every=1``: a per-frame pipeline), the tracker's embedding rule, and that rule with the
whole frame detected only every ``--keyframe-every`` sampled frames (around the tracked faces in
between); in ``--rounds`` rounds, the order rotated each round: medians with ranges.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_cost import spread  # noqa: E402
from bench.machine import cpu_model  # noqa: E402
from bench.video_clip import Actor, actor_photo, write_clip  # noqa: E402
from models.tracking import TrackerSettings, box_iou  # noqa: E402
from models.video import VideoLimits, sample_frames  # noqa: E402
from models.video_faces import VideoFaces, decide_tracks  # noqa: E402
from service.app import load_pipeline  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.video import tracker_settings  # noqa: E402

FPS = 25
SECONDS = 10.0


class MemoryGallery:
    """One embedding per subject; the service's search: subjects by their best cosine."""

    def __init__(self, names: list[str], vectors: np.ndarray) -> None:
        self.names, self.vectors = names, vectors

    def search(self, queries: np.ndarray, k: int) -> list[list]:
        from types import SimpleNamespace

        scores = queries @ self.vectors.T
        order = np.argsort(-scores, axis=1)[:, :k]
        return [
            [SimpleNamespace(subject_id=self.names[j], score=float(s[j]), face_id=self.names[j]) for j in row]
            for s, row in zip(scores, order, strict=True)
        ]


def lfw_people(lfw: Path, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` LFW people with at least two photos, at random."""
    people = sorted(p.name for p in (lfw / "images").iterdir() if len(list(p.glob("*.jpg"))) >= 2)
    return [people[i] for i in rng.choice(len(people), count, replace=False)]


def random_actor(photo, rng: np.random.Generator, t0: float, t1: float) -> Actor:
    y0, y1 = rng.uniform(0.3, 0.7, 2)
    x0, x1 = (0.15, 0.85) if rng.random() < 0.5 else (0.85, 0.15)
    blur_start = rng.uniform(t0, t1 - (t1 - t0) / 3)
    return Actor(
        photo,
        t0,
        t1,
        (x0, y0),
        (x1, y1),
        rng.uniform(40, 120),
        rng.uniform(40, 120),
        blur=rng.uniform(1.5, 4.0),
        blur_from=blur_start,
        blur_to=blur_start + (t1 - t0) / 3,
    )


def make_clip(pipeline, lfw: Path, enrolled: list[str], strangers: list[str], seed: int, out: Path):
    """One accuracy clip: two enrolled people, then two strangers (photo 2 of each)."""
    rng = np.random.default_rng(seed)
    who = [enrolled[i] for i in rng.choice(len(enrolled), 2, replace=False)]
    who += [strangers[i] for i in rng.choice(len(strangers), 2, replace=False)]
    spans = [(0.0, 5.5), (1.0, 6.5), (5.0, 10.0), (6.0, 10.0)]
    actors = []
    for name, (t0, t1) in zip(who, spans, strict=True):
        photo = actor_photo(pipeline, lfw / "images" / name / f"{name}_0002.jpg", name)
        actors.append(random_actor(photo, rng, t0, t1))
    truth = write_clip(out, actors, width=640, height=360, fps=FPS, seconds=SECONDS, seed=seed)
    return truth


def truth_of(box: np.ndarray, faces: list[tuple[str, np.ndarray]]) -> str | None:
    if not faces:
        return None
    iou = box_iou(box[None], np.stack([f for _, f in faces]))[0]
    best = int(np.argmax(iou))
    return faces[best][0] if iou[best] >= 0.3 else None


def score_clip(
    pipeline,
    clip: Path,
    truth,
    gallery: MemoryGallery,
    threshold: float,
    rule: TrackerSettings,
    keyframes: int,
):
    """Per-face truths, per-frame and per-track decisions of one clip."""
    every: list = []
    faces = VideoFaces(pipeline, rule, audit=every, keyframe_every=keyframes)
    for frame in sample_frames(str(clip), VideoLimits(sample_fps=5, max_seconds=None, max_frames=None)):
        faces.frame(frame)
    tracks = faces.finish()
    decisions, short = decide_tracks(tracks, gallery.search, threshold, rule, k=1)
    enrolled = set(gallery.names)
    rows = {
        "frame": [],
        "track": [],
        "track_faces": [],
        "purity": [0, 0],
        "short": short,
        "tracks": len(tracks),
        "unlabelled": 0,
    }
    for d in decisions:
        actors = [truth_of(f.box, truth[round(f.time_s * FPS)]) for f in d.track.faces]
        main, count = Counter(actors).most_common(1)[0]
        rows["purity"][0] += count
        rows["purity"][1] += len(actors)
        if main is None:  # a face beside an actor's in its photo: no truth to score against
            rows["unlabelled"] += 1
            continue
        want = main if main in enrolled else None
        rows["track"].append(d.subject_id == want)
        rows["track_faces"] += [
            d.subject_id == (a if a in enrolled else None) for a in actors if a is not None
        ]
    for time_s, box, embedding in every:
        actor = truth_of(box, truth[round(time_s * FPS)])
        if actor is not None:
            hit = gallery.search(embedding[None].astype(np.float32), 1)[0][0]
            decided = hit.subject_id if hit.score >= threshold else None
            rows["frame"].append(decided == (actor if actor in enrolled else None))
    return rows


def accuracy(args, pipeline, threshold: float, rule: TrackerSettings, work: Path) -> dict:
    rng = np.random.default_rng(args.seed)
    people = lfw_people(args.lfw, args.gallery + 2 * args.clips, rng)
    enrolled, strangers = people[: args.gallery], people[args.gallery :]
    vectors = [
        pipeline.faces(_read(args.lfw / "images" / n / f"{n}_0001.jpg"), "largest")[0].embedding
        for n in enrolled
    ]
    gallery = MemoryGallery(enrolled, np.stack(vectors))
    totals = {
        "frame": [],
        "track": [],
        "track_faces": [],
        "purity": [0, 0],
        "short": 0,
        "tracks": 0,
        "unlabelled": 0,
    }
    for seed in range(args.clips):
        clip = work / f"clip{seed}.mp4"
        truth = make_clip(pipeline, args.lfw, enrolled[: args.clips * 2], strangers, seed, clip)
        rows = score_clip(pipeline, clip, truth, gallery, threshold, rule, args.keyframe_every)
        for key in ("frame", "track", "track_faces"):
            totals[key] += rows[key]
        totals["purity"] = [a + b for a, b in zip(totals["purity"], rows["purity"], strict=True)]
        for key in ("short", "tracks", "unlabelled"):
            totals[key] += rows[key]
        print(
            f"clip {seed}: {sum(rows['track'])}/{len(rows['track'])} tracks right, "
            f"{sum(rows['frame'])}/{len(rows['frame'])} faces right alone",
            flush=True,
        )
    return {
        "clips": args.clips,
        "appearances": 4 * args.clips,
        "gallery": args.gallery,
        "tracks": totals["tracks"],
        "decided_tracks": len(totals["track"]),
        "short_tracks": totals["short"],
        "unlabelled_tracks": totals["unlabelled"],
        "per_track_accuracy": float(np.mean(totals["track"])),
        "per_track_accuracy_over_faces": float(np.mean(totals["track_faces"])),
        "per_frame_accuracy": float(np.mean(totals["frame"])),
        "faces_scored": len(totals["frame"]),
        "purity": totals["purity"][0] / max(totals["purity"][1], 1),
    }


def _read(path: Path) -> np.ndarray:
    from models.image import read_image

    return read_image(path)


def cost_clip(pipeline, photos: Path, width: int, height: int, out: Path) -> None:
    a = actor_photo(pipeline, photos / "people" / "obama" / "2.jpg", "obama")
    b = actor_photo(pipeline, photos / "people" / "biden" / "2.jpg", "biden")
    side = height / 6
    write_clip(
        out,
        [
            Actor(a, 0, SECONDS, (0.2, 0.4), (0.5, 0.5), side, 1.5 * side),
            Actor(b, 0, SECONDS, (0.8, 0.5), (0.6, 0.4), 1.5 * side, side),
        ],
        width=width,
        height=height,
        fps=FPS,
        seconds=SECONDS,
    )


def one_run(pipeline, clip: Path, rule: TrackerSettings, sample_fps: float, keyframes: int = 1) -> dict:
    faces = VideoFaces(pipeline, rule, keyframe_every=keyframes)
    frames = sample_frames(
        str(clip),
        VideoLimits(sample_fps=sample_fps, max_seconds=None, max_frames=None, max_pixels=1920 * 1088),
    )
    started = time.perf_counter()
    decode = 0.0
    while True:
        clock = time.perf_counter()
        frame = next(frames, None)
        decode += time.perf_counter() - clock
        if frame is None:
            break
        faces.frame(frame)
    wall = time.perf_counter() - started
    times = faces.times
    return {
        "wall_s": wall,
        "decode_s": decode,
        **{f"{k}_s": v for k, v in times.seconds.items()},
        "frames": times.frames,
        "faces": times.faces,
        "embedded": times.embedded,
    }


def cost_modes(rule: TrackerSettings, keyframes: int) -> dict[str, tuple[TrackerSettings, int]]:
    """The pipelines timed: every face detected in the whole frame and embedded (per frame), the
    tracker's embedding rule alone, and with whole-frame detection only every ``keyframes``."""
    every = TrackerSettings(**{**rule.__dict__, "reembed_every": 1})
    return {
        "every face": (every, 1),
        "tracking": (rule, 1),
        f"tracking, whole frame every {keyframes}": (rule, keyframes),
    }


def cost(args, pipeline, rule: TrackerSettings, work: Path) -> dict:
    modes = cost_modes(rule, args.keyframe_every)
    names = list(modes)
    results = {}
    for label, (w, h) in (("720p", (1280, 720)), ("1080p", (1920, 1080))):
        clip = work / f"cost_{label}.mp4"
        cost_clip(pipeline, args.photos, w, h, clip)
        one_run(pipeline, clip, rule, args.sample_fps)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
                settings, keyframes = modes[name]
                runs[name].append(one_run(pipeline, clip, settings, args.sample_fps, keyframes))
        results[label] = {name: _summarise(rs) for name, rs in runs.items()}
        base = runs["every face"]
        for name in names[1:]:
            speed = [b["wall_s"] / t["wall_s"] for t, b in zip(runs[name], base, strict=True)]
            results[label][name]["speed_up"] = spread(speed, 2)
        print(f"{label}: {json.dumps(results[label])}", flush=True)
    return results


def _summarise(runs: list[dict]) -> dict:
    out = {
        "sampled_fps": spread([r["frames"] / r["wall_s"] for r in runs], 2),
        "realtime_x": spread([SECONDS / r["wall_s"] for r in runs], 2),
    }
    for stage in ("decode", "detect", "embed", "track"):
        out[f"{stage}_ms_per_frame"] = spread([1000 * r[f"{stage}_s"] / r["frames"] for r in runs], 1)
    out["faces_embedded"] = f"{runs[0]['embedded']} of {runs[0]['faces']}"
    return out


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lfw", type=Path, default=root.parent / "shared" / "data" / "lfw")
    ap.add_argument("--photos", type=Path, default=root.parent / "shared" / "data" / "photos")
    ap.add_argument("--clips", type=int, default=8)
    ap.add_argument("--gallery", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sample-fps", type=float, default=5.0)
    ap.add_argument("--keyframe-every", type=int, default=None, help="default: the service's setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", choices=("accuracy", "cost"), default=None)
    ap.add_argument(
        "--split-margin", type=float, default=None, help="the tracker's split margin (default: the service's)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    settings = Settings()
    if args.keyframe_every is None:
        args.keyframe_every = settings.video_keyframe_every
    pipeline = load_pipeline(settings)
    manifest = pipeline.manifest
    rule = tracker_settings(settings, manifest)
    if args.split_margin is not None:
        rule = TrackerSettings(**{**rule.__dict__, "split_cosine": rule.join_cosine - args.split_margin})
    threshold = manifest.thresholds["identification"].value
    report = {
        "what": "bench/video.py",
        "cpu": cpu_model(),
        "model": manifest.model_id,
        "threshold": threshold,
        "rule": rule.__dict__,
        "sample_fps": args.sample_fps,
        "keyframe_every": args.keyframe_every,
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip != "accuracy":
            report["accuracy"] = accuracy(args, pipeline, threshold, rule, Path(tmp))
            print(json.dumps(report["accuracy"], indent=1), flush=True)
        if args.skip != "cost":
            report["cost"] = cost(args, pipeline, rule, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
