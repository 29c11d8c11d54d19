"""Video clips made from real photos, with the truth of every frame: the tests' and the video
benchmark's clips.

An actor is the region around the face of one photo (2.4 times the detected face box, found by
the project's detector once), moving along a straight path across a textured background while it
is scaled, and blurred for part of its time on screen. :func:`write_clip` encodes the frames with
PyAV (H.264, yuv420p) and returns, per encoded frame, where each actor's face is: the truth that
tracks and decisions are scored against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from models.image import read_image

#: The actor's region around its face box, in face-box sides.
REGION_SCALE = 2.4
#: The actor's face is kept at most this many pixels across (its largest size in any clip here).
MAX_FACE_SIDE = 320


@dataclass
class ActorPhoto:
    """The region around one photo's face (RGB) and the face box inside it (x1, y1, x2, y2)."""

    name: str
    region: np.ndarray
    face: np.ndarray


@dataclass
class Actor:
    """One appearance: ``photo`` on screen from ``t0`` to ``t1`` seconds, its region's centre
    moving from ``start`` to ``end`` (fractions of the frame), its face ``side0`` to ``side1``
    pixels across, blurred with a Gaussian of ``blur`` pixels between ``blur_from`` and
    ``blur_to`` seconds."""

    photo: ActorPhoto
    t0: float
    t1: float
    start: tuple[float, float]
    end: tuple[float, float]
    side0: float
    side1: float
    blur: float = 0.0
    blur_from: float = 0.0
    blur_to: float = 0.0


def actor_photo(pipeline, path: str | Path, name: str) -> ActorPhoto:
    """The region of ``path``'s largest face (found by ``pipeline``'s detector), edge-padded."""
    image = read_image(path)
    faces = pipeline.detector.detect(image)
    if not faces:
        raise ValueError(f"no face in {path}")
    face = max(faces, key=lambda f: (f.box[2] - f.box[0]) * (f.box[3] - f.box[1]))
    x1, y1, x2, y2 = (float(v) for v in face.box)
    side = max(x2 - x1, y2 - y1) * REGION_SCALE
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    left, top = int(round(cx - side / 2)), int(round(cy - side / 2))
    size = int(round(side))
    pad = max(0, -left, -top, left + size - image.shape[1], top + size - image.shape[0])
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), mode="edge")
    region = padded[top + pad : top + pad + size, left + pad : left + pad + size]
    face_box = np.array([x1 - left, y1 - top, x2 - left, y2 - top])
    shrink = min(1.0, MAX_FACE_SIDE / max(x2 - x1, y2 - y1))  # the frames never need more pixels
    if shrink < 1.0:
        side_px = max(8, int(round(size * shrink)))
        region = np.asarray(Image.fromarray(region).resize((side_px, side_px), Image.LANCZOS))
        face_box = face_box * (side_px / size)
    return ActorPhoto(name, np.ascontiguousarray(region), face_box)


def background(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth random texture (a room's wall, roughly): low-frequency noise, upsampled."""
    rng = np.random.default_rng(seed)
    small = rng.integers(60, 190, size=(max(2, height // 40), max(2, width // 40), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR))


def _placed(actor: Actor, t: float, width: int, height: int):
    """The actor's scaled region, its top-left corner and its face box in the frame at ``t``."""
    a = (t - actor.t0) / max(actor.t1 - actor.t0, 1e-9)
    face_side = actor.side0 + a * (actor.side1 - actor.side0)
    photo = actor.photo
    scale = face_side / max(photo.face[2] - photo.face[0], photo.face[3] - photo.face[1])
    size = max(8, int(round(photo.region.shape[0] * scale)))
    cx = (actor.start[0] + a * (actor.end[0] - actor.start[0])) * width
    cy = (actor.start[1] + a * (actor.end[1] - actor.start[1])) * height
    left, top = int(round(cx - size / 2)), int(round(cy - size / 2))
    region = Image.fromarray(photo.region).resize((size, size), Image.BILINEAR)
    if actor.blur > 0 and actor.blur_from <= t <= actor.blur_to:
        region = region.filter(ImageFilter.GaussianBlur(actor.blur))
    face = photo.face * (size / photo.region.shape[0]) + np.array([left, top, left, top])
    return np.asarray(region), left, top, face


def render(
    actors: list[Actor], t: float, base: np.ndarray
) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
    """The frame at ``t`` and, per actor on screen, its name and face box (clipped actors too)."""
    frame = base.copy()
    height, width = frame.shape[:2]
    truth = []
    for actor in actors:
        if not actor.t0 <= t < actor.t1:
            continue
        region, left, top, face = _placed(actor, t, width, height)
        x0, y0 = max(0, left), max(0, top)
        x1, y1 = min(width, left + region.shape[1]), min(height, top + region.shape[0])
        if x1 > x0 and y1 > y0:
            frame[y0:y1, x0:x1] = region[y0 - top : y1 - top, x0 - left : x1 - left]
            truth.append((actor.photo.name, face))
    return frame, truth


def write_clip(
    path: str | Path, actors: list[Actor], *, width: int, height: int, fps: int = 25, seconds: float,
    seed: int = 0, crf: int = 23,
) -> list[list[tuple[str, np.ndarray]]]:  # fmt: skip
    """Encode the clip to ``path`` (H.264 in MP4 or MKV by its suffix); per frame, the truth."""
    import av

    base = background(width, height, seed)
    truth = []
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for i in range(int(round(seconds * fps))):
            frame, faces = render(actors, i / fps, base)
            truth.append(faces)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return truth


def two_people_and_a_stranger(photos: dict[str, ActorPhoto], seconds: float = 8.0) -> list[Actor]:
    """The acceptance clip: ``photos['a']`` and ``photos['b']`` (enrolled) cross the frame, their
    faces growing and, for a second each, blurred; ``photos['stranger']`` walks in as they leave."""
    return [
        Actor(photos["a"], 0.0, 4.5, (0.25, 0.45), (0.4, 0.5), 70, 110, blur=2.5, blur_from=1.5, blur_to=2.5),
        Actor(photos["b"], 1.0, 5.5, (0.8, 0.5), (0.65, 0.45), 110, 80, blur=2.5, blur_from=3.0, blur_to=4.0),
        Actor(photos["stranger"], 5.0, seconds, (0.3, 0.55), (0.6, 0.5), 90, 100),
    ]
