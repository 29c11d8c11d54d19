"""Decoding photo bytes: formats, EXIF orientation, and typed errors for bad input."""

import io

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
    with pytest.raises(ImageTooLargeError, match="20000 pixels") as info:
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
