"""LFW's faces as the quality score sees them: detection, landmarks, aligned crop and raw embedding
of every photo, and of degraded copies (downscaled, blurred, rotated), cached in one ``.npz``.

The face path is the service's: MTCNN on the photo, the detected face nearest the centre (O-Net
alone on the central box when MTCNN finds none, as calibration does), the model's alignment, the
model's fused raw output. Degraded copies are made of half the photos of the people with two or
more photos (seeded), so that the fit and the curves see faces far worse than LFW's own.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from training.evaluation.cache import cache_root
from training.evaluation.faces import load_face_set
from training.evaluation.landmarks import central_box, make_detector
from training.evaluation.lfw_files import IMAGES_DIR, require_images
from training.evaluation.parallel import ordered_map, progress_bar

#: The kinds of copy: 0 the photo as it is, then the degradations.
VARIANTS = ("original", "downscaled", "blurred", "rotated")
#: Bump when the records' meaning changes.
RECORDS_VERSION = 1


@dataclass(frozen=True)
class Job:
    """One face to measure: photo ``image`` of the set, as ``variant`` with strength ``param``
    (downscale factor, blur sigma in pixels, rotation in degrees; 0 for the original)."""

    image: int
    variant: int
    param: float


def degradation_jobs(identities: list[str], seed: int = 0) -> list[Job]:
    """Every photo as it is, then one degraded copy of half the photos of each person with two or
    more photos: downscaled 2-6x (faces of about 17-50 px), blurred (sigma 1-4 px) or rotated
    in the image plane (20-70 degrees either way), chosen at random (``seed``)."""
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    for name in identities:
        counts[name] = counts.get(name, 0) + 1
    jobs = [Job(i, 0, 0.0) for i in range(len(identities))]
    for i, name in enumerate(identities):
        if counts[name] < 2 or rng.random() >= 0.5:
            continue
        variant = int(rng.integers(1, len(VARIANTS)))
        if variant == 1:
            param = float(rng.uniform(2.0, 6.0))
        elif variant == 2:
            param = float(rng.uniform(1.0, 4.0))
        else:
            param = float(rng.choice([-1.0, 1.0]) * rng.uniform(20.0, 70.0))
        jobs.append(Job(i, variant, param))
    return jobs


def degrade(image: np.ndarray, variant: int, param: float) -> np.ndarray:
    """An RGB uint8 photo downscaled by ``param`` (bicubic), blurred (Gaussian, sigma ``param``
    px) or rotated by ``param`` degrees about its centre (black corners); ``variant`` 0: as it is."""
    if variant == 0:
        return image
    pil = Image.fromarray(image)
    if variant == 1:
        size = (max(1, round(pil.width / param)), max(1, round(pil.height / param)))
        pil = pil.resize(size, Image.Resampling.BICUBIC)
    elif variant == 2:
        pil = pil.filter(ImageFilter.GaussianBlur(radius=param))
    else:
        pil = pil.rotate(param, resample=Image.Resampling.BILINEAR)
    return np.asarray(pil)


def _measure(detector, template, image: np.ndarray) -> dict:
    """The central face of one photo: found flag, box, score, landmarks, aligned crop."""
    from models.align import align_face
    from models.mtcnn import select_faces

    faces = select_faces(detector.detect(image), "central", image.shape)
    found = bool(faces)
    face = faces[0] if found else detector.landmarks_in_box(image, central_box(image.shape))
    crop = align_face(image, face.landmarks, template)
    return {"found": found, "box": face.box, "score": face.score, "landmarks": face.landmarks, "crop": crop}


def records_path(model_digest: str, faces_digest: str, seed: int) -> Path:
    key = hashlib.sha256(f"{RECORDS_VERSION}\0{model_digest}\0{faces_digest}\0{seed}".encode())
    return cache_root() / "quality" / f"lfw-{key.hexdigest()[:16]}.npz"


def lfw_quality_records(
    model_dir: str | Path, lfw_dir: str | Path, *, seed: int = 0, workers: int = 2, progress: bool = True
) -> dict[str, np.ndarray]:
    """The records of every job (:func:`degradation_jobs`), from the cache or measured now.

    Returns arrays, one row per job: ``image``, ``variant``, ``param``, ``identity`` (index into
    ``names``), ``found``, ``box`` (4,), ``score``, ``landmarks`` (5, 2), ``raw`` (the model's fused
    output, not normalised), ``gray`` (the aligned crop in grey, uint8: what the sharpness reads),
    ``names`` and ``keys`` of the set."""
    from training.evaluation.cache import ModelKey

    lfw_dir = Path(lfw_dir)
    require_images(lfw_dir)
    faces = load_face_set(lfw_dir / IMAGES_DIR, "lfw-all", probes=True)
    model = ModelKey.of(model_dir)
    path = records_path(model.digest, faces.digest(), seed)
    if path.is_file():
        with np.load(path) as cached:
            return dict(cached)
    records = _measure_all(model_dir, faces, seed, workers, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, **records)
    partial.replace(path)
    return records


def _measure_all(model_dir, faces, seed: int, workers: int, progress: bool) -> dict[str, np.ndarray]:
    """Detect, align and embed every job (threads for the photos, batches for the embedder)."""
    from models.align import get_template
    from models.embedder import Embedder
    from models.image import read_image

    started = time.perf_counter()
    names = sorted(set(faces.identities))
    ident = np.array([names.index(n) for n in faces.identities]) if names else np.zeros(0, int)
    jobs = degradation_jobs(list(faces.identities), seed)
    detector = make_detector("cpu")
    embedder = Embedder(model_dir, "cpu", batch_size=64, intra_op_threads=1 if workers > 1 else 0)
    template = get_template(embedder.manifest.template)

    def work(job: Job) -> dict:
        return _measure(
            detector, template, degrade(read_image(faces.paths[job.image]), job.variant, job.param)
        )

    rows: list[dict] = []
    raws: list[np.ndarray] = []
    batch: list[dict] = []
    for row in progress_bar(ordered_map(work, jobs, workers, 8 * workers), len(jobs), "quality", progress):
        batch.append(row)
        if len(batch) == 64:
            raws.append(embedder.embed(np.stack([r["crop"] for r in batch]), normalize=False))
            rows.extend(batch)
            batch = []
    if batch:
        raws.append(embedder.embed(np.stack([r["crop"] for r in batch]), normalize=False))
        rows.extend(batch)
    grey = np.array([0.299, 0.587, 0.114])
    return {
        "image": np.array([j.image for j in jobs]),
        "variant": np.array([j.variant for j in jobs]),
        "param": np.array([j.param for j in jobs]),
        "identity": ident[[j.image for j in jobs]],
        "found": np.array([r["found"] for r in rows]),
        "box": np.stack([np.asarray(r["box"], np.float64) for r in rows]),
        "score": np.array([r["score"] for r in rows]),
        "landmarks": np.stack([np.asarray(r["landmarks"], np.float64).reshape(5, 2) for r in rows]),
        "raw": np.concatenate(raws).astype(np.float32),
        "gray": np.stack([np.rint(r["crop"] @ grey).astype(np.uint8) for r in rows]),
        "names": np.array(names),
        "keys": np.array(faces.keys),
        "meta": np.array(json.dumps({"seed": seed, "seconds": time.perf_counter() - started})),
    }
