"""Landmarks from our MTCNN: the face nearest the image centre with its no-face fallback (the rule
of LFW's detect mode, MegaFace and calibration), and how far they lie from LFW's ``landmarks.txt``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.lfw_files import IMAGES_DIR, LANDMARKS_FILE, read_landmarks
from training.evaluation.parallel import ordered_map, progress_bar

LANDMARK_NAMES = ("left_eye", "right_eye", "nose", "left_mouth", "right_mouth")
NO_FACE_POLICY = (
    "the detected face nearest the image centre is used (select_faces 'central'); when MTCNN finds "
    "no face, O-Net alone places the landmarks in the central square box of side 0.5*min(H, W) "
    "(landmarks_in_box) and the image is listed in no_face_list"
)


def central_box(shape: Sequence[int]) -> np.ndarray:
    """The fallback box: a square of side ``0.5 * min(H, W)`` centred in the image (x1, y1, x2, y2)."""
    height, width = int(shape[0]), int(shape[1])
    side = 0.5 * min(height, width)
    x1, y1 = (width - side) / 2.0, (height - side) / 2.0
    return np.array([x1, y1, x1 + side, y1 + side], dtype=np.float64)


def detect_central_landmarks(detector: Any, image: np.ndarray) -> tuple[np.ndarray, bool]:
    """Landmarks of the face nearest the image centre, with the no-face fallback.

    Returns:
        ``((5, 2) landmarks, found)``; ``found`` is False when MTCNN found no face and O-Net was run
        alone on :func:`central_box`.
    """
    from models.mtcnn import select_faces

    faces = select_faces(detector.detect(image), "central", image.shape)
    if faces:
        return np.asarray(faces[0].landmarks, dtype=np.float64).reshape(5, 2), True
    face = detector.landmarks_in_box(image, central_box(image.shape))
    return np.asarray(face.landmarks, dtype=np.float64).reshape(5, 2), False


def landmark_error_stats(predicted: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    """Euclidean errors in pixels of ``(N, 5, 2)`` landmarks against references.

    Returns mean and median over all N*5 points, the mean per point, the 95th percentile, the
    mean normalised by the reference inter-ocular distance (NME) and the mean signed offset
    ``(dx, dy)`` of predicted minus reference points (a systematic shift, e.g. a pixel convention).
    """
    predicted = np.asarray(predicted, dtype=np.float64).reshape(-1, 5, 2)
    reference = np.asarray(reference, dtype=np.float64).reshape(-1, 5, 2)
    if len(predicted) == 0:
        return {
            "images": 0,
            "mean": None,
            "median": None,
            "p95": None,
            "per_point": {},
            "nme": None,
            "mean_offset_xy": None,
            "images_over_5px": 0,
        }
    errors = np.linalg.norm(predicted - reference, axis=2)  # (N, 5)
    interocular = np.linalg.norm(reference[:, 1] - reference[:, 0], axis=1)
    per_image = errors.mean(axis=1)
    return {
        "images": int(len(errors)),
        "mean": float(errors.mean()),
        "median": float(np.median(errors)),
        "p95": float(np.percentile(errors, 95)),
        "per_point": {name: float(v) for name, v in zip(LANDMARK_NAMES, errors.mean(axis=0), strict=True)},
        "nme": float(np.mean(per_image / np.maximum(interocular, 1e-6))),
        "images_over_5px": int(np.count_nonzero(per_image > 5.0)),
        "mean_offset_xy": [float(v) for v in (predicted - reference).reshape(-1, 2).mean(axis=0)],
    }


def make_detector(providers: str | Sequence[str]) -> Any:
    """A new :class:`models.mtcnn.MTCNNDetector` with the constructor's settings on ``providers``."""
    from models.mtcnn import MTCNNDetector

    # One thread per ONNX Runtime call: MTCNN's many small runs are several times faster than
    # with a thread pool per call, and parallelism comes from the worker threads instead.
    return MTCNNDetector(providers=providers, intra_op_threads=1)


def detector_landmark_report(
    data_dir: str | Path,
    detector: Any = None,
    *,
    limit: int | None = None,
    workers: int = 2,
    providers: str | Sequence[str] = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """How well the detector finds LFW faces and places their landmarks, over all LFW images.

    Runs ``detector`` (default: a new :class:`models.mtcnn.MTCNNDetector`) on every image listed in
    ``landmarks.txt`` (13,233; the first ``limit`` in file order if given), keeps the face nearest
    the centre and compares its 5 landmarks with the file's.

    Returns:
        a JSON-ready dict: ``images``, ``faces_found``, ``faces_found_share``, ``no_face_list``,
        ``landmark_error_px`` (see :func:`landmark_error_stats`, over images with a found face),
        ``seconds`` and ``images_per_s``.
    """
    from models.image import read_image

    data_dir = Path(data_dir)
    reference = read_landmarks(data_dir / LANDMARKS_FILE)
    names = list(reference)[:limit] if limit is not None else list(reference)
    if detector is None:
        detector = make_detector(providers)

    def work(name: str) -> tuple[np.ndarray, bool]:
        return detect_central_landmarks(detector, read_image(data_dir / IMAGES_DIR / name))

    started = time.perf_counter()
    predicted, found = [], []
    stream = ordered_map(work, names, workers, window=4 * max(workers, 1))
    for points, ok in progress_bar(stream, len(names), "detect", progress):
        predicted.append(points)
        found.append(ok)
    seconds = time.perf_counter() - started
    found_mask = np.array(found, dtype=bool)
    refs = np.stack([reference[n] for n in names]) if names else np.zeros((0, 5, 2))
    preds = np.stack(predicted) if predicted else np.zeros((0, 5, 2))
    return {
        "images": len(names),
        "faces_found": int(found_mask.sum()),
        "faces_found_share": float(found_mask.mean()) if names else None,
        "no_face_images": int((~found_mask).sum()),
        "no_face_list": [n for n, ok in zip(names, found, strict=True) if not ok],
        "landmark_error_px": landmark_error_stats(preds[found_mask], refs[found_mask]),
        "landmark_error_px_fallback": landmark_error_stats(preds[~found_mask], refs[~found_mask]),
        "seconds": seconds,
        "images_per_s": len(names) / seconds if seconds > 0 else None,
        "workers": workers,
    }
