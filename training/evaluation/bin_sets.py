"""insightface's ``.bin`` verification sets (LFW, CFP-FP, AgeDB-30, CALFW, CPLFW): reading them
safely, writing them, and LFW's View-2 pairs as one.

The layout (what insightface's recognition code, ``eval/verification.py``, loads): one pickle of
the pair ``(bins, issame_list)``:

* ``bins``: ``2P`` encoded images (JPEG in the published sets), each a 112x112 face aligned onto
  the ArcFace template (:data:`models.align.ARCFACE_TEMPLATE_112x112`);
* ``issame_list``: ``P`` bools; pair ``i`` is images ``2i`` and ``2i + 1``, the same person when
  True. The pairs keep the set's order, and insightface cuts that order into 10 contiguous folds
  (:func:`training.evaluation.verification.contiguous_folds`).

Most published files were written by Python 2, whose byte strings are read back as ``bytes``.

A pickle may name any callable for the reader to run, and a ``.bin`` comes from elsewhere, so
:func:`read_bin` unpickles with a reader that names none, except the two that Python's own pickler
writes for ``bytes`` at protocols 0 to 2 (``bytes()`` for an empty string,
``_codecs.encode(text, "latin1")`` for any other), each accepted with exactly those arguments; the
result must then be exactly that pair of a list of bytes and a list of bools.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.errors import VerificationSetError

#: Height and width of every face of a set.
FACE_SIZE = (112, 112)
#: The JPEG quality of the faces :func:`lfw_bin` encodes (OpenCV's ``imwrite`` default, with
#: which insightface's aligned faces were written; Pillow's default 4:2:0 chroma subsampling is
#: OpenCV's too).
JPEG_QUALITY = 95


@dataclass(frozen=True)
class VerificationBin:
    """One ``.bin`` set: ``images[2i]`` and ``images[2i + 1]`` are pair ``i``."""

    name: str
    images: list[bytes]
    is_same: np.ndarray

    def __len__(self) -> int:
        return len(self.is_same)


def _empty_bytes(*args: Any) -> bytes:
    if args:
        raise pickle.UnpicklingError("bytes() is accepted only without arguments")
    return b""


def _latin1_bytes(*args: Any) -> bytes:
    if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is accepted only as encode(text, 'latin1')")
    return args[0].encode("latin1")


#: The only callables a ``.bin`` pickle may name (Python 2 spells builtins ``__builtin__``).
_ALLOWED: dict[tuple[str, str], Callable[..., bytes]] = {
    ("builtins", "bytes"): _empty_bytes,
    ("__builtin__", "bytes"): _empty_bytes,
    ("_codecs", "encode"): _latin1_bytes,
}


class _SetUnpickler(pickle.Unpickler):
    """Unpickles lists, tuples, bools, ints and byte strings; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}; a verification set holds only lists of bytes and bools"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to persistent objects; a verification set has none")


def _checked(path: Path, loaded: Any) -> tuple[list[bytes], np.ndarray]:
    """``(bins, is_same)`` of what the pickle held, or the error naming what is wrong with it."""
    if not isinstance(loaded, (tuple, list)) or len(loaded) != 2:
        raise VerificationSetError(f"{path}: expected the pair (images, issame), got {type(loaded).__name__}")
    bins, same = loaded
    for what, items, kind in (("images", bins, (bytes, bytearray)), ("issame", same, bool)):
        if not isinstance(items, (list, tuple)):
            raise VerificationSetError(f"{path}: {what} must be a list, got {type(items).__name__}")
        bad = next((i for i, item in enumerate(items) if not isinstance(item, kind)), None)
        if bad is not None:
            raise VerificationSetError(
                f"{path}: {what}[{bad}] is a {type(items[bad]).__name__}, not "
                + ("encoded image bytes" if what == "images" else "a bool")
            )
    if len(bins) != 2 * len(same):
        raise VerificationSetError(
            f"{path}: {len(same)} pairs need {2 * len(same)} images (two per pair), the file has {len(bins)}"
        )
    is_same = np.array(same, dtype=bool)
    if len(is_same) < 10 or is_same.all() or not is_same.any():
        raise VerificationSetError(
            f"{path}: 10 folds need at least 10 pairs, same and different; the file has "
            f"{int(is_same.sum())} same and {int((~is_same).sum())} different"
        )
    return [bytes(b) for b in bins], is_same


def read_bin(path: str | Path) -> VerificationBin:
    """Read an insightface ``.bin`` set (see the module's notes on what is accepted).

    Raises:
        VerificationSetError: the file is missing, is not such a pickle, names a callable, or holds
            anything but ``2P`` byte strings and ``P`` bools (at least 10 pairs of both kinds).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise VerificationSetError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        loaded = _SetUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise VerificationSetError(f"{path} is not an insightface verification set: {exc}") from None
    bins, is_same = _checked(path, loaded)
    return VerificationBin(path.stem, bins, is_same)


def write_bin(path: str | Path, images: Sequence[bytes], is_same: Sequence[bool], protocol: int = 4) -> Path:
    """Write a ``.bin`` set: pair ``i`` is ``images[2i]`` and ``images[2i + 1]`` (encoded faces).

    ``protocol``: the pickle protocol (2: what a Python 2 reader also loads).
    """
    if len(images) != 2 * len(is_same):
        raise ValueError(f"{len(is_same)} pairs need {2 * len(is_same)} images, got {len(images)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        pickle.dump(([bytes(i) for i in images], [bool(s) for s in is_same]), handle, protocol=protocol)
    return path


def decode_face(data: bytes, index: int, source: str) -> np.ndarray:
    """One encoded face of a set as ``(112, 112, 3)`` uint8 RGB.

    Raises:
        VerificationSetError: the bytes are not an image, or not a 112x112 one (the message names
            ``source`` and the image's index).
    """
    from models.errors import FacePathError
    from models.image import decode_image

    try:
        face = decode_image(data, max_pixels=4 * FACE_SIZE[0] * FACE_SIZE[1])
    except FacePathError as exc:
        raise VerificationSetError(f"{source}: image {index} cannot be decoded: {exc}") from None
    if face.shape[:2] != FACE_SIZE:
        raise VerificationSetError(
            f"{source}: image {index} is {face.shape[1]}x{face.shape[0]}; the faces of a set are "
            "112x112, aligned onto the ArcFace template"
        )
    return face


def encode_face(face: np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    """A ``(112, 112, 3)`` uint8 RGB face as JPEG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(face).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def lfw_bin(
    data_dir: str | Path,
    pairs_per_fold: int | None = None,
    *,
    landmarks: str = "file",
    quality: int = JPEG_QUALITY,
    workers: int = 2,
    progress: bool = False,
) -> VerificationBin:
    """LFW's View-2 pairs (``pairs.txt`` order: fold by fold, same pairs first) as a ``.bin`` set:
    every image aligned onto the ArcFace 112x112 template with ``landmarks`` (``file``:
    ``landmarks.txt``; ``detect``: our MTCNN, as ``sphereface evaluate lfw`` places them) and
    JPEG-encoded at ``quality``. With ``pairs_per_fold``, the first ``n/2`` same and different
    pairs of each fold."""
    from models.align import ARCFACE_TEMPLATE_112x112
    from training.evaluation.lfw import aligned_lfw_crops

    faces, names, pairs = aligned_lfw_crops(
        data_dir, pairs_per_fold, landmarks=landmarks, workers=workers, progress=progress,
        template=ARCFACE_TEMPLATE_112x112,
    )  # fmt: skip
    encoded = {name: encode_face(face, quality) for name, face in zip(names, faces, strict=True)}
    images = [encoded[name] for pair in zip(pairs.left, pairs.right, strict=True) for name in pair]
    return VerificationBin("lfw", images, pairs.is_same.copy())
