"""Decoding photo bytes into RGB arrays, honouring EXIF orientation, with size limits."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from models.errors import ImageTooLargeError, UnreadableImageError

#: Default limits: 20 MB of encoded bytes, 40 megapixels decoded.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000


def decode_image(
    data: bytes,
    *,
    max_bytes: int = MAX_IMAGE_BYTES,
    max_pixels: int = MAX_IMAGE_PIXELS,
) -> np.ndarray:
    """Decode encoded image bytes (JPEG, PNG, WebP, BMP, ...) into an RGB array.

    Returns a ``(H, W, 3)`` uint8 array in RGB order, rotated upright according to the EXIF
    orientation tag. Alpha channels are dropped; greyscale and palette images become RGB.

    Raises:
        UnreadableImageError: the bytes are empty, truncated or not an image.
        ImageTooLargeError: more than ``max_bytes`` bytes or ``max_pixels`` pixels; the pixel
            count is checked from the header, before the pixels are decoded.
    """
    if len(data) == 0:
        raise UnreadableImageError("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ImageTooLargeError(f"the image is {len(data)} bytes; the limit is {max_bytes} bytes")
    too_large = f"the limit is {max_pixels:,} pixels"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageTooLargeError(
                    f"the image is {width}x{height} = {width * height:,} pixels; {too_large}"
                )
            image.load()
            image = ImageOps.exif_transpose(image)
            rgb = _to_rgb(image)
    except ImageTooLargeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard (far above ours) fires before the size is known: quote our limit.
        raise ImageTooLargeError(f"the image is too large to decode; {too_large}") from exc
    except UnidentifiedImageError as exc:
        raise UnreadableImageError("the data is not an image in a format that can be read") from exc
    except MemoryError as exc:
        raise ImageTooLargeError(
            f"the image needs more memory to decode than the service has; {too_large}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - every decoder's failure (AVIF RuntimeError, DDS NotImplementedError, ...)
        raise UnreadableImageError(
            f"the image could not be decoded ({type(exc).__name__}: {exc})"[:300]
        ) from exc
    return rgb


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


def image_size(stream) -> tuple[int, int] | None:
    """(width, height) from an image's header without decoding its pixels; None if unreadable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(stream) as image:
                return image.size
    except Exception:  # noqa: BLE001 - decode_image reports what is wrong with it
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
