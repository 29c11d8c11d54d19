"""Decoding photo bytes into RGB arrays, honouring EXIF orientation, within size and cost limits.

A JPEG can be decoded at 1/2, 1/4 or 1/8 of its size by libjpeg's DCT scaling (Pillow's
``Image.draft``), for about the cost of the smaller image: :func:`decode_photo` does so when the
caller needs no more than ``min_side`` pixels on the longer side (the face detector searches a
large photo as if it were that size) and says how to map coordinates back to the full photo.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from models.errors import FacePathError, ImageTooLargeError, UnreadableImageError
from models.image_bytes import describe_bytes, jpeg_frame, sniff_format, tiff_first_directory

#: Default limits: 20 MB of encoded bytes, 40 megapixels decoded.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000
#: Pixels any image may decode to whatever its size in bytes (a few tens of ms of decoding).
FREE_DECODE_PIXELS = 4_000_000
#: Beyond :data:`FREE_DECODE_PIXELS`, the most pixels an image may decode to per byte it holds.
#: Photos hold 1 byte per 2 to 30 pixels (JPEG and PNG); only flat, synthetic images reach 100.
#: The project's own bound, so that a request costs in proportion to what it sends.
MAX_PIXELS_PER_BYTE = 100
#: libjpeg's DCT scaling factors, the largest first.
JPEG_REDUCTIONS = (8, 4, 2)
#: The output axes (x, y) that each EXIF orientation flips once the photo is upright.
_FLIPPED_AXES = {
    1: (False, False),
    2: (True, False),
    3: (True, True),
    4: (False, True),
    5: (False, False),
    6: (True, False),
    7: (True, True),
    8: (False, True),
}


@dataclass
class DecodedPhoto:
    """A photo decoded upright, possibly at a reduced scale.

    Attributes:
        image: ``(h, w, 3)`` uint8 RGB, rotated upright by the EXIF orientation.
        reduction: full-size pixels per decoded pixel on each side: 1, 2, 4 or 8.
        full_size: ``(width, height)`` of the upright photo at full size.
        orientation: the EXIF orientation applied (1 to 8; 1: none).
        data: the encoded bytes, kept to decode again at a finer scale (:meth:`finer`).
    """

    image: np.ndarray
    reduction: int
    full_size: tuple[int, int]
    orientation: int = 1
    data: bytes = field(default=b"", repr=False)

    def _axes(self) -> np.ndarray:
        """Per axis (x, y), the full-size coordinate of decoded coordinate 0.

        Decoded pixel ``i`` covers full pixels ``s*i .. s*i + s - 1`` of the photo as stored (DCT
        scaling works from its top-left corner), so its centre is ``s*i + (s - 1) / 2``; an axis the
        EXIF orientation flips is counted from the other edge, whose last block may be partial."""
        s = self.reduction
        full = np.asarray(self.full_size, dtype=np.float64)
        decoded = np.asarray(self.image.shape[1::-1], dtype=np.float64)
        flipped = np.asarray(_FLIPPED_AXES.get(self.orientation, (False, False)))
        return (s - 1) / 2 + np.where(flipped, full - s * decoded, 0.0)

    def to_full(self, points: np.ndarray) -> np.ndarray:
        """``(..., 2)`` (x, y) pixel coordinates of the decoded image -> of the full-size photo."""
        return np.asarray(points, dtype=np.float64) * self.reduction + self._axes()

    def from_full(self, points: np.ndarray) -> np.ndarray:
        """``(..., 2)`` (x, y) pixel coordinates of the full-size photo -> of the decoded image."""
        return (np.asarray(points, dtype=np.float64) - self._axes()) / self.reduction

    def box_to_full(self, box: np.ndarray) -> np.ndarray:
        """An inclusive pixel box ``(x1, y1, x2, y2, ...)`` -> the full-size pixels it covers
        (columns after the 4th, such as a score, are kept)."""
        out = np.array(box, dtype=np.float64)
        half = (self.reduction - 1) / 2
        out[:2] = self.to_full(out[:2]) - half
        out[2:4] = self.to_full(out[2:4]) + half
        return out

    def box_from_full(self, box: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`box_to_full`."""
        out = np.array(box, dtype=np.float64)
        half = (self.reduction - 1) / 2
        out[:2] = self.from_full(out[:2] + half)
        out[2:4] = self.from_full(out[2:4] - half)
        return out

    def finer(self, reduction: int) -> DecodedPhoto:
        """This photo decoded again with at most ``reduction`` (1: full size); itself when it already
        is. The decode cost rule still holds: a scale it does not allow stays coarser."""
        if reduction >= self.reduction or not self.data:
            return self
        width, height = self.full_size
        while reduction < self.reduction and not _affordable(len(self.data), width, height, reduction):
            reduction *= 2
        if reduction >= self.reduction:
            return self
        with _decoder_errors(self.data, MAX_IMAGE_PIXELS):
            return _decode(_open(self.data), self.data, reduction)


def jpeg_reduction(width: int, height: int, min_side: int | None) -> int:
    """The largest DCT scaling (8, 4, 2 or 1) that leaves at least ``min_side`` pixels on the longer
    side and at least 1 on the shorter; 1 when ``min_side`` is None."""
    if min_side is None:
        return 1
    for reduction in JPEG_REDUCTIONS:
        if -(-max(width, height) // reduction) >= min_side and min(width, height) >= reduction:
            return reduction
    return 1


def decode_photo(
    data: bytes,
    *,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
    min_side: int | None = None,
) -> DecodedPhoto:
    """Decode encoded image bytes (JPEG, PNG, WebP, BMP, ...) upright into RGB; a JPEG at the
    smallest DCT scale with at least ``min_side`` pixels on its longer side (None: full size).

    Before any pixel is decoded, the header's size is checked against the limits and against the
    bytes: a JPEG with less data than its size needs (:meth:`models.image_bytes.JpegFrame.least_bytes`)
    is truncated or forged, and beyond :data:`FREE_DECODE_PIXELS` an image may decode to at most
    :data:`MAX_PIXELS_PER_BYTE` pixels per byte.

    Raises:
        UnreadableImageError: the bytes are empty, truncated, forged or not an image.
        ImageTooLargeError: more than ``max_bytes`` bytes or ``max_pixels`` pixels, or more pixels
            than the bytes pay for.
    """
    if len(data) == 0:
        raise UnreadableImageError("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ImageTooLargeError(f"the image is {len(data)} bytes; the limit is {max_bytes} bytes")
    problem = tiff_first_directory(data)
    if problem:  # Pillow would read every entry first (0.5 s for 65,535), then misname the problem
        raise UnreadableImageError(f"the data is {describe_bytes(data)} and {problem}: the file is corrupt")
    with _decoder_errors(data, max_pixels):
        image = _open(data)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageTooLargeError(
                f"the image is {width}x{height} = {width * height:,} pixels; "
                f"the limit is {max_pixels:,} pixels"
            )
        _check_jpeg_data(data, image)
        return _decode(image, data, jpeg_reduction(width, height, min_side))


def decode_image(
    data: bytes,
    *,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> np.ndarray:
    """Decode encoded image bytes (JPEG, PNG, WebP, BMP, ...) into an RGB array at full size.

    Returns a ``(H, W, 3)`` uint8 array in RGB order, rotated upright according to the EXIF
    orientation tag. Alpha channels are dropped; greyscale and palette images become RGB.
    The checks and errors are :func:`decode_photo`'s.
    """
    return decode_photo(data, max_bytes=max_bytes, max_pixels=max_pixels).image


def _open(data: bytes) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data))


def _decode(image: Image.Image, data: bytes, reduction: int) -> DecodedPhoto:
    """Load ``image`` (just opened) with DCT scaling ``reduction`` where its format has it, within the
    decode cost rule, and make it upright RGB."""
    width, height = image.size
    if reduction > 1:
        drafted = image.draft(None, (width // reduction, height // reduction))
        reduction = round(width / drafted[1][2]) if drafted else 1
    _check_cost(len(data), width, height, reduction)
    image.load()
    orientation = image.getexif().get(0x0112, 1)
    orientation = orientation if orientation in _FLIPPED_AXES else 1
    upright = ImageOps.exif_transpose(image)
    full_size = (height, width) if orientation >= 5 else (width, height)
    return DecodedPhoto(_to_rgb(upright), reduction, full_size, orientation, data)


def _affordable(nbytes: int, width: int, height: int, reduction: int) -> bool:
    pixels = -(-width // reduction) * -(-height // reduction)
    return pixels <= FREE_DECODE_PIXELS or pixels <= MAX_PIXELS_PER_BYTE * nbytes


def _check_cost(nbytes: int, width: int, height: int, reduction: int) -> None:
    """Refuse a decode of more pixels than the bytes pay for (:data:`MAX_PIXELS_PER_BYTE`)."""
    if _affordable(nbytes, width, height, reduction):
        return
    pixels = -(-width // reduction) * -(-height // reduction)
    scale = f" (decoded at 1/{reduction} scale)" if reduction > 1 else ""
    raise ImageTooLargeError(
        f"the image decodes to {pixels:,} pixels{scale} from only {nbytes:,} bytes, "
        f"{pixels / nbytes:,.0f} pixels per byte; beyond {FREE_DECODE_PIXELS:,} pixels an image must "
        f"hold at least 1 byte per {MAX_PIXELS_PER_BYTE} pixels (photos hold 1 per 2 to 30): "
        "send a photo, or a smaller image"
    )


def _check_jpeg_data(data: bytes, image: Image.Image) -> None:
    """Refuse a JPEG with less data than an image of its size can be coded in: libjpeg would fill
    the missing part with grey, at the full cost of decoding it."""
    if image.format not in ("JPEG", "MPO"):
        return
    frame = jpeg_frame(data)
    if frame is None or len(data) >= frame.least_bytes():
        return
    raise UnreadableImageError(
        f"the JPEG is cut short: a {frame.width}x{frame.height} {frame.coding} JPEG needs at least "
        f"{frame.least_bytes():,} bytes of image data and the file has {len(data):,} bytes in all "
        "(truncated, or a header that claims a larger image than the data holds)"
    )


@contextmanager
def _decoder_errors(data: bytes, max_pixels: int) -> Iterator[None]:
    """Every failure of Pillow's decoders as :class:`UnreadableImageError` or
    :class:`ImageTooLargeError`, naming the format Pillow tried and what the bytes are."""
    too_large = f"the limit is {max_pixels:,} pixels"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore", UserWarning)  # Pillow's "Corrupt EXIF data" and such
            yield
    except FacePathError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard (far above ours) fires before the size is known: quote our limit.
        raise ImageTooLargeError(f"the image is too large to decode; {too_large}") from exc
    except UnidentifiedImageError as exc:
        raise UnreadableImageError(_unidentified_message(data)) from exc
    except MemoryError as exc:
        raise ImageTooLargeError(
            f"the image needs more memory to decode than the service has; {too_large}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - every decoder's failure (AVIF RuntimeError, DDS NotImplementedError, ...)
        raise UnreadableImageError(_decoder_message(data, exc)) from exc


def _unidentified_message(data: bytes) -> str:
    sniffed = sniff_format(data)
    if sniffed is None:
        return f"the data is not an image in a format that can be read: {describe_bytes(data)}"
    problem = tiff_first_directory(data)
    detail = f": {problem}" if problem else ", but it could not be read as one (corrupt or unsupported)"
    return f"the data is {describe_bytes(data)}{detail}"


def _decoder_message(data: bytes, exc: Exception) -> str:
    """``the image could not be decoded (...)`` with what the bytes are and, for a TIFF, what is
    wrong with its first directory (Pillow's own message can name another format entirely)."""
    reason = f"{type(exc).__name__}: {exc}"[:200]
    problem = tiff_first_directory(data)
    if problem:
        return (
            f"the image could not be decoded: the data is {describe_bytes(data)} and {problem}, "
            f"so the file is corrupt (the decoder said {reason!r})"
        )[:400]
    return f"the image could not be decoded ({reason}); the data is {describe_bytes(data)}"[:400]


def _to_rgb(image: Image.Image) -> np.ndarray:
    """An RGB uint8 array of any Pillow mode; 16- and 32-bit greyscale are scaled, not clipped
    (Pillow's ``convert("RGB")`` turns every value above 255 white)."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        grey = np.asarray(image).astype(np.float32)
        peak = 65535.0 if image.mode.startswith("I;16") or grey.max(initial=0) > 255 else 255.0
        grey8 = np.clip(np.rint(grey * (255.0 / peak)), 0, 255).astype(np.uint8)
        return np.repeat(grey8[:, :, None], 3, axis=2)
    if image.mode == "F":
        grey = np.asarray(image, dtype=np.float32)
        scale = 255.0 if float(np.nanmax(grey, initial=0.0)) <= 1.0 else 1.0
        grey8 = np.clip(np.rint(np.nan_to_num(grey) * scale), 0, 255).astype(np.uint8)
        return np.repeat(grey8[:, :, None], 3, axis=2)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def image_size(stream, min_side: int | None = None) -> tuple[int, int] | None:
    """(width, height) from an image's header without decoding its pixels, or, with ``min_side``,
    the size :func:`decode_photo` will decode it at; None if unreadable."""
    try:
        start = stream.tell()
        if sniff_format(stream.read(4)) == "TIFF":
            stream.seek(start)
            if tiff_first_directory(stream.read()):
                return None
        stream.seek(start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(stream) as image:
                width, height = image.size
                if image.format not in ("JPEG", "MPO"):
                    return width, height
                reduction = jpeg_reduction(width, height, min_side)
                return -(-width // reduction), -(-height // reduction)
    except Exception:  # noqa: BLE001 - decode_photo reports what is wrong with it
        return None


def read_image(path: str | Path, **limits: int) -> np.ndarray:
    """Read and decode an image file; see :func:`decode_image`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UnreadableImageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return decode_image(data, **limits)
    except UnreadableImageError as exc:
        raise UnreadableImageError(f"{path}: {exc.message}") from exc
