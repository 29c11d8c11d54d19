"""Augmented MegaFace distractors: more distractors than there are photos, each one a real
distractor face re-aligned with a random jitter and pixel changes, then embedded by the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.cache import DETECTOR_TAG, ModelKey, cached_embeddings
from training.evaluation.errors import MegaFaceDataError
from training.evaluation.faces import FaceSet

#: Augmented distractors: what each one is (recorded in the JSON).
AUGMENTATION_VERSION = "aug-v1"
AUGMENTATION_DESCRIPTION = (
    "aug-v1: a real distractor face (cycled in a fixed random order), re-aligned from its detected "
    "landmarks after a random similarity jitter (rotation +-10 deg, scale 0.9-1.1, shift +-4 px), "
    "mirrored with p=0.5, then brightness +-32, contrast 0.7-1.3, gamma 0.7-1.4, greyscale p=0.2, "
    "3x3 box blur p=0.3, Gaussian noise sigma 0-6; every one embedded by the model"
)


def augment_face(
    image: np.ndarray, landmarks: np.ndarray, template: Any, rng: np.random.Generator
) -> np.ndarray:
    """One :data:`AUGMENTATION_DESCRIPTION` variant of a face: jittered alignment, then pixels."""
    from models.align import align_face

    angle = np.deg2rad(rng.uniform(-10, 10))
    scale = rng.uniform(0.9, 1.1)
    shift = rng.uniform(-4, 4, size=2)
    centre = landmarks.mean(axis=0)
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]) * scale
    jittered = (landmarks - centre) @ rot.T + centre + shift
    face = align_face(image, jittered, template).astype(np.float32)
    if rng.random() < 0.5:
        face = face[:, ::-1]
    face = (face - 127.5) * rng.uniform(0.7, 1.3) + 127.5 + rng.uniform(-32, 32)
    face = 255.0 * (np.clip(face, 0, 255) / 255.0) ** rng.uniform(0.7, 1.4)
    if rng.random() < 0.2:
        face[:] = face @ np.array([0.299, 0.587, 0.114], dtype=np.float32)[:, None]
    if rng.random() < 0.3:
        padded = np.pad(face, ((1, 1), (1, 1), (0, 0)), mode="edge")
        h, w = face.shape[:2]
        face = sum(padded[dy : dy + h, dx : dx + w] for dy in range(3) for dx in range(3)) / 9.0
    face = face + rng.normal(0.0, rng.uniform(0, 6), size=face.shape)
    return np.clip(np.rint(face), 0, 255).astype(np.uint8)


def embed_augmented(
    source: FaceSet,
    landmarks: np.ndarray,
    count: int,
    model: ModelKey,
    embedder: Any,
    cache_dir: Path,
    *,
    seed: int = 0,
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> tuple[np.ndarray, list[str]]:
    """``count`` embedded augmentations of the ``source`` faces (resumable; a larger ``count`` later
    keeps the rows already made: augmentation ``i`` depends only on ``seed`` and ``i``)."""
    from models.align import get_template
    from models.image import read_image

    if len(source) == 0:
        raise MegaFaceDataError("augmented distractors need at least one real distractor face")
    template = get_template(embedder.manifest.template)
    order = np.random.default_rng(seed).permutation(len(source))
    digest = source.digest()

    def crop(i: int) -> np.ndarray:
        j = int(order[i % len(order)])
        rng = np.random.default_rng([seed, i])
        return augment_face(read_image(source.paths[j]), landmarks[j], template, rng)

    features = cached_embeddings(
        cache_dir / "features" / model.folder / f"{source.name}-{AUGMENTATION_VERSION}-s{seed}-{digest[:16]}",
        {
            "source": source.name,
            "digest": digest,
            "augmentation": AUGMENTATION_VERSION,
            "seed": seed,
            "detector": DETECTOR_TAG,
            "model": model.digest,
        },
        count,
        crop,
        embedder,
        batch_size=batch_size,
        workers=workers,
        desc="embed augmented",
        progress=progress,
    )
    keys = [f"{AUGMENTATION_VERSION}/{i}/{source.keys[int(order[i % len(order)])]}" for i in range(count)]
    return features, keys
