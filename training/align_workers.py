"""The photo workers of ``sphereface prepare``: read, detect and align photos in worker processes.

Each worker holds one MTCNN on one ONNX Runtime thread; results come back in task order
(:func:`training.worker_pool.ordered_results`, which reports a worker that died). The face
nearest the photo centre is kept (``select_faces(..., "central", ...)``) and aligned onto the
SphereFace 112x96 template (thesis §2.3.6 "Preprocessing").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from models.align import SPHEREFACE_TEMPLATE_112x96
from models.errors import FacePathError
from training.worker_pool import ordered_results

TEMPLATE = SPHEREFACE_TEMPLATE_112x96
FACE_POLICY = "central"
#: MTCNN's usual smallest face, in pixels (``sphereface prepare --min-face-size``).
DEFAULT_MIN_FACE_SIZE = 20.0

#: This process's MTCNN and the (providers, min face size) it was made for.
_WORKER_DETECTOR: tuple[tuple[str, float], Any] | None = None
_WORKER_SETTINGS: tuple[str, float] = ("cpu", DEFAULT_MIN_FACE_SIZE)


def worker_init(providers: str, min_face_size: float = DEFAULT_MIN_FACE_SIZE) -> None:
    global _WORKER_SETTINGS
    _WORKER_SETTINGS = (providers, float(min_face_size))


def _detector(providers: str, min_face_size: float = DEFAULT_MIN_FACE_SIZE) -> Any:
    """This process's MTCNN (made on first use, with one ONNX Runtime thread per call)."""
    global _WORKER_DETECTOR
    key = (providers, float(min_face_size))
    if _WORKER_DETECTOR is None or _WORKER_DETECTOR[0] != key:
        from models.mtcnn import MTCNNDetector

        detector = MTCNNDetector(providers=providers, intra_op_threads=1, min_face_size=min_face_size)
        _WORKER_DETECTOR = (key, detector)
    return _WORKER_DETECTOR[1]


def align_photo(detector: Any, path: str | Path) -> tuple[np.ndarray | None, str | None, str | None]:
    """Read, detect and align one photo.

    Returns:
        ``(crop, None, None)`` with a ``(112, 96, 3)`` uint8 RGB crop, or ``(None, reason,
        message)`` when the photo is skipped: ``reason`` is ``no_face`` or the read error's code
        (``unreadable_image``, ``image_too_large``).
    """
    from models.align import align_face
    from models.image import read_image
    from models.mtcnn import select_faces

    try:
        image = read_image(path)
    except FacePathError as exc:
        return None, exc.code, exc.message
    faces = select_faces(detector.detect(image), FACE_POLICY, image.shape)
    if not faces:
        return None, "no_face", f"MTCNN found no face in the {image.shape[1]}x{image.shape[0]} photo"
    return align_face(image, faces[0].landmarks, TEMPLATE), None, None


def work(task: tuple[int, str]) -> tuple[int, np.ndarray | None, str | None, str | None]:
    """Pool task: ``(photo index, absolute path)`` -> ``(index, crop, reason, message)``."""
    index, path = task
    detector = _detector(*_WORKER_SETTINGS)
    try:
        crop, reason, message = align_photo(detector, path)
    except Exception as exc:  # one odd photo must not stop a long job; it is recorded instead
        crop, reason, message = None, "error", f"{type(exc).__name__}: {exc}"
    return index, crop, reason, message


def aligned_results(
    tasks: list[tuple[int, str]], workers: int, providers: str, min_face_size: float
) -> Iterator[tuple[int, np.ndarray | None, str | None, str | None]]:
    """Results of :func:`work` over ``tasks``, in task order (``workers <= 1``: in this process).

    Raises:
        training.worker_pool.WorkerDied: a worker process died; its ``tasks`` are the
            ``(photo index, path)`` it was aligning.
    """
    chunksize = max(1, min(16, len(tasks) // (max(workers, 1) * 8)))
    settings = (providers, min_face_size)
    yield from ordered_results(
        work, tasks, workers, initializer=worker_init, initargs=settings, chunksize=chunksize
    )
