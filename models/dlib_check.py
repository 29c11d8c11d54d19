"""Our converted dlib ResNet against dlib itself (the ``dlib-bin`` wheel), on the same chips.

Used by ``sphereface import dlib`` (when dlib is installed) and by the tests; never by the service.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from models.errors import ModelFolderError

#: Largest accepted |ours - dlib| of a descriptor value (dlib's descriptors have norm about 1).
DLIB_PARITY_ATOL = 1e-4


class DlibParityError(ModelFolderError):
    code = "dlib_parity"


def dlib_available() -> bool:
    try:
        import dlib  # noqa: F401
    except ImportError:
        return False
    return True


def dlib_descriptors(chips: np.ndarray, dat_path: str | os.PathLike[str]) -> np.ndarray:
    """dlib's ``compute_face_descriptor`` of 150x150 RGB uint8 chips: ``(N, 128)`` float64."""
    import dlib

    model = dlib.face_recognition_model_v1(str(dat_path))
    out = model.compute_face_descriptor([np.ascontiguousarray(c) for c in chips])
    return np.array([np.array(d) for d in out], dtype=np.float64)


def synthetic_chips(n: int = 6, seed: int = 0) -> np.ndarray:
    """Seeded 150x150 chips (smooth random fields, noise, gradients) to compare the two networks
    without any photo: every pixel value and much spatial structure occurs."""
    rng = np.random.default_rng(seed)
    chips = np.empty((n, 150, 150, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:150, 0:150] / 149.0
    for i in range(n):
        if i % 3 == 0:
            chips[i] = rng.integers(0, 256, (150, 150, 3), dtype=np.uint8)
        elif i % 3 == 1:
            phase = rng.uniform(0, 2 * np.pi, 3)
            for c in range(3):
                chips[i, :, :, c] = np.uint8(127.5 + 127.5 * np.sin(6 * xx + 4 * yy * (c + 1) + phase[c]))
        else:
            coarse = rng.uniform(0, 255, (6, 6, 3))
            chips[i] = np.kron(coarse, np.ones((25, 25, 1))).astype(np.uint8)
    return chips


def parity(model_dir: str | os.PathLike[str], dat_path: str | os.PathLike[str], chips: np.ndarray) -> float:
    """Largest |ONNX Runtime output - dlib descriptor| over ``chips`` (raw outputs, no flip).

    Raises:
        DlibParityError: above :data:`DLIB_PARITY_ATOL`.
    """
    from models.embedder import Embedder

    ours = Embedder(model_dir, "cpu").raw(chips).astype(np.float64)
    theirs = dlib_descriptors(chips, dat_path)
    diff = float(np.max(np.abs(ours - theirs)))
    if not diff <= DLIB_PARITY_ATOL:
        raise DlibParityError(
            f"{model_dir}: ONNX Runtime and dlib differ by {diff:.3g} (max abs) on {len(chips)} chips, "
            f"more than {DLIB_PARITY_ATOL:g}"
        )
    return diff


def synthetic_parity(model_dir: str | os.PathLike[str], source: str | os.PathLike[str] | None) -> float:
    """:func:`parity` on :func:`synthetic_chips`, the .dat taken from ``source`` as the importer does."""
    from models.dlib_format import DLIB_RESNET_FILE
    from models.importers import cached_dlib_file

    if source is None:
        dat = cached_dlib_file(DLIB_RESNET_FILE)
    elif Path(source).is_dir():
        dat = Path(source) / DLIB_RESNET_FILE
    elif str(source).endswith(".dat"):
        dat = Path(source)
    else:
        dat = cached_dlib_file(DLIB_RESNET_FILE, source)
    return parity(model_dir, dat, synthetic_chips())
