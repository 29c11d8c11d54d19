"""Decoding photo bytes: formats, EXIF orientation, and typed errors for bad input."""

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from models.errors import ImageTooLargeError, UnreadableImageError
from models.image import decode_image, decode_photo, image_size, read_image
from models.image_bytes import jpeg_frame


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


# -- decoding cost ---------------------------------------------------------------------------------


def jpeg_bomb(side: int = 6000, keep: int = 2187) -> bytes:
    """A JPEG whose header claims ``side`` x ``side`` but whose data stops after ``keep`` bytes,
    closed by an end-of-image marker (libjpeg fills the missing blocks with grey): 2,189 bytes."""
    data = _encode(Image.new("RGB", (side, side), (128, 128, 128)), "JPEG", quality=1)
    return data[:keep] + b"\xff\xd9"


def test_a_jpeg_bomb_is_refused_before_its_pixels_are_decoded():
    """Before: the 2,189-byte JPEG claiming 6000x6000 decoded to 108 MB of grey (about 0.4 s of CPU
    here, 1.5 s with detection, 500 MB peak) and the photo was answered no_face. Now its header is
    weighed against its data first: a sequential JPEG codes at least 2 bits per 8x8 block."""
    bomb = jpeg_bomb()
    assert len(bomb) == 2189
    started = time.process_time()
    with pytest.raises(UnreadableImageError, match="cut short") as caught:
        decode_image(bomb)
    cpu = time.process_time() - started
    assert "6000x6000" in caught.value.message and "2,189 bytes" in caught.value.message
    assert cpu < 0.2, f"{cpu:.3f} s of CPU"  # about 1 ms; the whole decode took 0.4 s


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_the_least_jpeg_data_bound_holds_for_the_flattest_complete_jpegs(mode, progressive):
    """A flat image with optimised Huffman tables is the smallest a complete JPEG can be (1-bit
    codes): it still decodes, so the bound refuses only data that cannot be a whole image."""
    flat = Image.new(mode, (1001, 777), 128 if mode == "L" else (128, 128, 128))
    data = _encode(flat, "JPEG", quality=1, optimize=True, progressive=progressive)
    assert jpeg_frame(data).least_bytes() <= len(data)
    assert decode_image(data).shape == (777, 1001, 3)
    with pytest.raises(UnreadableImageError, match="cut short"):
        decode_image(data[: jpeg_frame(data).least_bytes() // 2] + b"\xff\xd9")


def test_more_pixels_than_the_bytes_pay_for_is_image_too_large():
    """Before: a 4,000 x 4,000 PNG of 2 KB (one bit per pixel, all zero) was decoded, 16 MP at
    8,000 pixels per byte. Beyond 4 MP an image now pays at least a byte per 100 pixels."""
    raw = zlib.compress(b"".join(b"\0" + bytes(500) for _ in range(4000)), 9)
    ihdr = struct.pack(">2I5B", 4000, 4000, 1, 0, 0, 0, 0)
    chunks = _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", raw) + _png_chunk(b"IEND", b"")
    png = b"\x89PNG\r\n\x1a\n" + chunks
    with pytest.raises(ImageTooLargeError, match="pixels per byte"):
        decode_image(png)
    small = Image.new("1", (1500, 1500))  # 2.25 MP: under the free size, decoded whatever its bytes
    assert decode_image(_encode(small, "PNG")).shape == (1500, 1500, 3)


def tiff_with_entries(count: int) -> bytes:
    """A little-endian TIFF whose first directory has ``count`` SHORT entries, tags 0, 1, 2, ..."""
    entries = b"".join(struct.pack("<HHII", tag, 3, 1, 1) for tag in range(count))
    return b"II*\x00" + struct.pack("<IH", 8, count) + entries + b"\0\0\0\0"


def test_decoder_errors_name_the_real_problem():
    """Before: a TIFF of 65,535 directory entries (one of them JPEG XR's tag 0xBC01) was answered
    "Windows Media Photo files not yet supported"; now the message says what the bytes are and
    what is wrong with them."""
    started = time.process_time()
    with pytest.raises(UnreadableImageError) as caught:
        decode_image(tiff_with_entries(65535))
    assert time.process_time() - started < 0.1  # Pillow read all 65,535 entries first: 0.25 s
    message = caught.value.message
    assert "TIFF" in message and "65,535 entries" in message and "corrupt" in message
    with pytest.raises(UnreadableImageError) as caught:
        decode_image(tiff_with_entries(65535)[:2000])
    assert "claims 65,535 entries" in caught.value.message
    with pytest.raises(UnreadableImageError, match="no known image signature"):
        decode_image(b"not an image at all")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_reduced_decode_maps_back_to_the_full_photo(orientation):
    """A JPEG decoded at 1/4 (DCT scaling): a bright square found in it maps back onto the full
    decode's square for every EXIF orientation and an odd size (partial last blocks)."""
    upright = np.zeros((131, 203, 3), np.uint8)
    upright[40:52, 150:162] = 255  # its centre is (155.5, 45.5)
    undo = {
        1: None,
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_90,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_270,
    }[orientation]
    stored = Image.fromarray(upright)
    stored = stored.transpose(undo) if undo is not None else stored
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(stored, "JPEG", quality=100, subsampling=0, exif=exif.tobytes())
    full, reduced = decode_photo(data), decode_photo(data, min_side=50)
    assert full.reduction == 1 and reduced.reduction == 4
    assert reduced.full_size == (203, 131) and reduced.image.shape == (33, 51, 3)
    found = reduced.to_full(_bright_centre(reduced.image))
    assert np.abs(found - _bright_centre(full.image)).max() < 0.1, found
    assert np.abs(reduced.from_full(found) - _bright_centre(reduced.image)).max() < 1e-9
    box = np.array([10.0, 3.0, 20.0, 7.0])
    assert np.allclose(reduced.box_from_full(reduced.box_to_full(box)), box)


def _bright_centre(image: np.ndarray) -> np.ndarray:
    weight = image.astype(np.float64).mean(axis=2)
    ys, xs = np.mgrid[0 : weight.shape[0], 0 : weight.shape[1]]
    return np.array([(xs * weight).sum(), (ys * weight).sum()]) / weight.sum()


def test_a_large_jpeg_is_decoded_at_the_scale_asked_for():
    data = _encode(Image.new("RGB", (4001, 3000), (30, 60, 90)), "JPEG")
    assert decode_photo(data).image.shape == (3000, 4001, 3)
    half = decode_photo(data, min_side=1024)
    assert half.reduction == 2 and half.image.shape == (1500, 2001, 3)
    assert image_size(io.BytesIO(data), 1024) == (2001, 1500)
    assert image_size(io.BytesIO(data)) == (4001, 3000)
    assert decode_photo(data, min_side=2500).reduction == 1  # 1/2 would leave 2,001 pixels
    assert half.finer(1).image.shape == (3000, 4001, 3)
    png = _encode(Image.new("RGB", (4001, 30)), "PNG")
    assert decode_photo(png, min_side=100).reduction == 1  # only JPEG has DCT scaling
