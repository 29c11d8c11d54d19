"""Decoding photo bytes: formats, EXIF orientation, and typed errors for bad input."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from models.errors import ImageTooLargeError, UnreadableImageError
from models.image import decode_image, read_image


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def test_jpeg_decodes_to_rgb_uint8():
    data = _encode(Image.new("RGB", (30, 20), (200, 10, 10)), "JPEG")
    out = decode_image(data)
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    assert out[10, 15, 0] > 180 and out[10, 15, 1] < 40


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 10, 20))  # white band on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    out = decode_image(_encode(image, "JPEG", exif=exif.tobytes()))
    assert out.shape == (40, 20, 3)
    assert out[2, 10].mean() > 200 and out[-3, 10].mean() < 50  # the band is now on top


def test_rgba_and_greyscale_become_rgb():
    assert decode_image(_encode(Image.new("RGBA", (8, 8), (1, 2, 3, 0)), "PNG")).shape == (8, 8, 3)
    assert decode_image(_encode(Image.new("L", (8, 8), 77), "PNG")).shape == (8, 8, 3)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", b"\xff\xd8\xff\xe0" + b"\x00" * 64],
    ids=["empty", "text", "jpeg-header"],
)
def test_non_images_raise_unreadable_image(data):
    with pytest.raises(UnreadableImageError) as info:
        decode_image(data)
    assert info.value.code == "unreadable_image" and info.value.message


def test_truncated_jpeg_raises_unreadable_image():
    data = _encode(Image.new("RGB", (300, 300), (5, 100, 5)), "JPEG")
    with pytest.raises(UnreadableImageError):
        decode_image(data[: len(data) // 2])


def test_too_many_pixels_raises_before_decoding():
    data = _encode(Image.new("RGB", (200, 100)), "PNG")
    with pytest.raises(ImageTooLargeError, match="20,000 pixels") as info:
        decode_image(data, max_pixels=10_000)
    assert info.value.code == "image_too_large"


def test_too_many_bytes_raises_image_too_large():
    with pytest.raises(ImageTooLargeError, match="bytes"):
        decode_image(b"x" * 101, max_bytes=100)


def test_read_image_names_the_file_in_its_error(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"garbage")
    with pytest.raises(UnreadableImageError, match="broken.jpg"):
        read_image(bad)
    with pytest.raises(UnreadableImageError, match="missing.jpg"):
        read_image(tmp_path / "missing.jpg")


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def test_16_bit_greyscale_is_scaled_not_clipped_to_white():
    """Before: Pillow's convert("RGB") clipped every 16-bit value above 255, so a 16-bit PNG
    decoded all white and its face was not found."""
    grey8 = np.random.default_rng(0).integers(0, 256, (40, 60), dtype=np.uint8)
    grey16 = grey8.astype(np.uint16) * 257  # the same picture at 16 bits
    assert Image.open(io.BytesIO(encoded(grey16))).mode.startswith("I;16")
    from_16, from_8 = decode_image(encoded(grey16)), decode_image(encoded(grey8))
    assert from_16.dtype == np.uint8 and from_16.shape == (40, 60, 3)
    assert np.abs(from_16.astype(int) - from_8.astype(int)).max() <= 1


@pytest.mark.shared_data
def test_16_bit_greyscale_photo_of_a_face_is_found(photos_dir, default_model_dir):
    from models.pipeline import FacePipeline

    grey = np.asarray(Image.open(photos_dir / "people" / "obama" / "1.jpg").convert("L"))
    pipeline = FacePipeline(default_model_dir)
    faces_16 = pipeline.detector.detect(decode_image(encoded(grey.astype(np.uint16) * 257)))
    faces_8 = pipeline.detector.detect(decode_image(encoded(grey)))
    assert len(faces_16) == len(faces_8) == 1
    assert np.abs(faces_16[0].box - faces_8[0].box).max() < 2


def test_every_decoder_failure_is_unreadable_image():
    """A DDS with a pixel format Pillow does not implement raised NotImplementedError: a 500."""
    header = b"DDS " + struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + bytes(44)
    pixel_format = struct.pack("<2I", 32, 0x4) + b"XYZ1" + bytes(20)
    data = header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + bytes(64)
    with pytest.raises(UnreadableImageError, match="NotImplementedError"):
        decode_image(data)


def test_size_messages_quote_the_service_limit():
    with pytest.raises(ImageTooLargeError, match="the limit is 1,000 pixels"):
        decode_image(encoded(np.zeros((40, 40, 3), np.uint8)), max_pixels=1000)
    # Pillow's own bomb guard (2x its MAX_IMAGE_PIXELS) fires inside Image.open: the message
    # still gives the service's limit, not Pillow's internal one
    huge = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">2I5B", 20000, 20000, 8, 2, 0, 0, 0))
    with pytest.raises(ImageTooLargeError) as caught:
        decode_image(huge + _png_chunk(b"IEND", b""))
    assert "40,000,000 pixels" in caught.value.message and "178956970" not in caught.value.message


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
