"""The hostile part of the fault suite: images no decoder should take down, requests the strict
inputs must refuse, and what they cost a real ``sphereface serve`` worker: the CPU of the
6000x6000 JPEG bomb, and the worker's memory at the start, after the hostile set and after normal
photos (each measured once the worker has been idle, as it gives memory back then).

The decoding set (the bomb, a sparse 16 MP PNG, a 36 MP PNG that really decodes, a 12 MP JPEG of
noise, a forged TIFF) comes from ``bench/decode_cost.py``; the requests from
``bench/hostile_requests.py``.
"""

from __future__ import annotations

import io
import struct
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from bench.decode_cost import hostile_set, jpeg_bomb
from bench.hostile_requests import hostile_requests, run_cases
from bench.paths import SHARED_DATA
from bench.processes import settled_rss, worker_cpu_s
from service.serve_process import Service

PHOTOS = SHARED_DATA / "photos"
#: The answers to the decoding set of ``bench/decode_cost.py``, by name.
DECODING_EXPECTED = {
    "bomb_6000.jpg": "unreadable_image",
    "sparse_4000.png": "image_too_large",
    "rows_6000.png": "no_face",
    "noise_12mp.jpg": "no_face",
    "ifd_65535.tif": "unreadable_image",
}
#: Bomb requests whose worker CPU is measured (the worker's CPU is counted in 10 ms ticks).
BOMB_RUNS = 5


# -- hostile images -------------------------------------------------------------------------------


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def _with_header_size(fmt: str, width: int, height: int) -> bytes:
    """A small valid image whose header claims ``width`` x ``height`` (a decompression bomb)."""
    small = Image.new("RGB", (16, 16), (90, 120, 150))
    if fmt == "PNG":
        ihdr = struct.pack(">2I5B", width, height, 8, 2, 0, 0, 0)
        idat = zlib.compress(b"\0" * 64)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b"")
        )
    data = bytearray(_encode(small, "TIFF" if fmt == "TIFF" else fmt))
    if fmt == "JPEG":
        sof = data.index(b"\xff\xc0")
        data[sof + 5 : sof + 9] = struct.pack(">2H", height, width)
    elif fmt == "GIF":
        data[6:10] = struct.pack("<2H", width, height)
        pos = 13 + (3 * 2 ** ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
        while data[pos] == 0x21:  # extension blocks before the image descriptor
            pos += 2
            while data[pos]:
                pos += data[pos] + 1
            pos += 1
        data[pos + 5 : pos + 9] = struct.pack("<2H", width, height)
    elif fmt == "BMP":
        data[18:26] = struct.pack("<2i", width, height)
    elif fmt == "WEBP":  # the VP8 frame header: 14-bit width and height after the start code
        start = data.index(b"\x9d\x01\x2a") + 3
        data[start : start + 4] = struct.pack("<2H", min(width, 16383), min(height, 16383))
    elif fmt == "TIFF":  # ImageWidth (256) and ImageLength (257) of the first IFD, as LONGs
        ifd = struct.unpack_from("<I", data, 4)[0]
        for i in range(struct.unpack_from("<H", data, ifd)[0]):
            entry = ifd + 2 + 12 * i
            tag = struct.unpack_from("<H", data, entry)[0]
            if tag in (256, 257):
                struct.pack_into("<HHII", data, entry, tag, 4, 1, width if tag == 256 else height)
    return bytes(data)


def _orientations(face: Image.Image) -> list[tuple[str, bytes]]:
    """The face photo stored as a camera would with each EXIF orientation (upright once applied)."""
    inverse = {
        1: lambda im: im,
        2: lambda im: im.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
        3: lambda im: im.transpose(Image.Transpose.ROTATE_180),
        4: lambda im: im.transpose(Image.Transpose.FLIP_TOP_BOTTOM),
        5: lambda im: im.transpose(Image.Transpose.TRANSPOSE),
        6: lambda im: im.transpose(Image.Transpose.ROTATE_90),
        7: lambda im: im.transpose(Image.Transpose.TRANSVERSE),
        8: lambda im: im.transpose(Image.Transpose.ROTATE_270),
    }
    out = []
    for tag, undo in inverse.items():
        exif = Image.Exif()
        exif[0x0112] = tag
        out.append(
            (f"exif_orientation_{tag}.jpg", _encode(undo(face), "JPEG", exif=exif.tobytes(), quality=90))
        )
    return out


def hostile_images() -> list[tuple[str, bytes, str]]:
    """(name, bytes, what the service should answer: ok, image_too_large or unreadable_image)."""
    face = Image.open(PHOTOS / "people" / "obama" / "1.jpg").convert("RGB")
    face.thumbnail((600, 600))
    grey = np.asarray(face.convert("L"))
    jpeg = _encode(face, "JPEG", quality=90)
    images = [
        (f"bomb.{fmt.lower()}", _with_header_size(fmt, 30000, 30000), "image_too_large")
        for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
    ]
    images += [
        ("bomb_64mp.png", _with_header_size("PNG", 8000, 8000), "image_too_large"),
        ("truncated.jpg", jpeg[: len(jpeg) // 2], "unreadable_image"),
        ("empty.jpg", b"", "unreadable_image"),
        ("text.jpg", b"not an image at all", "unreadable_image"),
        ("cmyk.jpg", _encode(face.convert("CMYK"), "JPEG", quality=90), "ok"),
        ("grey16.png", _encode(Image.fromarray(grey.astype(np.uint16) * 257), "PNG"), "ok"),
        ("rgba16.png", _rgba16_png(np.asarray(face)), "ok"),
        ("animated.gif", _animated_gif(face), "ok"),
        ("1x1.png", _encode(Image.new("RGB", (1, 1)), "PNG"), "no_face"),
    ]
    images += [(name, data, "ok") for name, data in _orientations(face)]
    return images


def _rgba16_png(rgb: np.ndarray) -> bytes:
    """A 16-bit RGBA PNG (Pillow cannot write one): rows of big-endian 16-bit samples, filter 0."""
    height, width, _ = rgb.shape
    rgba = np.concatenate([rgb, np.full((height, width, 1), 255, np.uint8)], axis=2).astype(">u2") * 257
    raw = b"".join(b"\0" + row.tobytes() for row in rgba)
    ihdr = struct.pack(">2I5B", width, height, 16, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )


def _animated_gif(face: Image.Image) -> bytes:
    frames = [face.convert("P"), Image.new("RGB", face.size, (0, 0, 0)).convert("P")]
    return _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def decoding_images(decoding: dict[str, bytes]) -> list[tuple[str, bytes, str]]:
    """(name, bytes, expected answer) of the decoding set (by name), each once."""
    return [(name, data, DECODING_EXPECTED.get(name, "?")) for name, data in decoding.items()]


# -- the scenario ---------------------------------------------------------------------------------


def embed_answer(response: httpx.Response) -> str:
    """What ``/v1/embed`` of one photo answered: the photo's status (``no_face`` for ``ok`` without
    faces), or the status and code of a refused request."""
    if response.status_code == 200:
        item = response.json()["photos"][0]
        return item["status"] if item["status"] != "ok" or item["faces"] else "no_face"
    return f"{response.status_code} {response.json().get('code')}"


def _image_rows(client: httpx.Client, images: list[tuple[str, bytes, str]]) -> list[dict]:
    rows = []
    for name, data, expected in images:
        start = time.monotonic()
        got = embed_answer(client.post("/v1/embed", files=[("photos", (name, data))]))
        rows.append(
            {
                "image": name,
                "bytes": len(data),
                "expected": expected,
                "answer": got,
                "as expected": got == expected,
                "ms": round((time.monotonic() - start) * 1000),
            }
        )
    return rows


def _bomb_cpu(client: httpx.Client, pid: int) -> dict:
    """The 6000x6000 JPEG bomb sent :data:`BOMB_RUNS` times: its answers and the worker's CPU
    seconds per request."""
    bomb, answers, cpu = jpeg_bomb(), set(), []
    for _ in range(BOMB_RUNS):
        before = worker_cpu_s(pid)
        answers.add(embed_answer(client.post("/v1/embed", files=[("photos", ("bomb.jpg", bomb))])))
        cpu.append(worker_cpu_s(pid) - before)
    return {"bytes": len(bomb), "answers": sorted(answers), "worker CPU s": round(float(np.mean(cpu)), 3)}


def _normal(client: httpx.Client, count: int) -> None:
    photos = sorted((PHOTOS / "people").rglob("*.jpg"))
    for i in range(count):
        photo = photos[i % len(photos)]
        client.post("/v1/embed", files=[("photos", (photo.name, photo.read_bytes()))])


def scenario_hostile(model: Path, workdir: Path, normal: int) -> dict:
    """Hostile images and requests, one per request, on one worker; then ``normal`` photos (none:
    no RSS after normal photos)."""
    service = Service(model, workdir / "hostile")
    try:
        client, pid = service.client, service.process.pid
        _normal(client, 3)
        rss = {"start": settled_rss(service)}
        bomb = _bomb_cpu(client, pid)
        decoding = dict(hostile_set())
        rows = _image_rows(client, hostile_images() + decoding_images(decoding))
        requests = run_cases(client, hostile_requests(jpeg_bomb(), decoding["ifd_65535.tif"]))
        rss["after hostile"] = settled_rss(service)
        if normal:
            _normal(client, normal)
            rss["after normal"] = settled_rss(service)
    finally:
        service.stop()
    result = {
        "images": rows,
        "as expected": sum(r["as expected"] for r in rows),
        "requests": requests,
        "requests as expected": sum(r["as expected"] for r in requests),
        "server errors": sum(r["answer"].startswith("5") for r in rows + requests),
        "bomb": bomb,
        "normal photos": normal,
        "rss MiB": {k: round(v) for k, v in rss.items()},
        "rss / start": {k: round(v / rss["start"], 2) for k, v in rss.items()},
    }
    print(
        f"hostile: {result['as expected']}/{len(rows)} images, {result['requests as expected']}/"
        f"{len(requests)} requests as expected; bomb {bomb}; RSS {result['rss MiB']}",
        flush=True,
    )
    return result


def hostile_tables(hostile: dict) -> list[str]:
    """The Markdown of the hostile scenario: a summary, the images, the requests."""
    rss, ratio = hostile["rss MiB"], hostile["rss / start"]
    bomb = hostile["bomb"]
    lines = [
        "",
        "## Hostile images and requests (one per request, one worker)",
        "",
        f"{hostile['as expected']}/{len(hostile['images'])} images and {hostile['requests as expected']}/"
        f"{len(hostile['requests'])} requests answered as expected, {hostile['server errors']} server "
        f"errors. The {bomb['bytes']:,}-byte JPEG claiming 6000x6000: {', '.join(bomb['answers'])}, "
        f"{bomb['worker CPU s']} s of worker CPU per request. Worker RSS (idle): {rss['start']} MiB at "
        f"the start, {rss['after hostile']} MiB after the hostile set ({ratio['after hostile']}x)"
        + (
            f", {rss['after normal']} MiB after {hostile['normal photos']} normal photos "
            f"({ratio['after normal']}x)."
            if "after normal" in rss
            else "."
        ),
        "",
        "| image | bytes | expected | answer | ms |",
        "|---|---|---|---|---|",
    ]
    for row in hostile["images"]:
        lines.append(
            f"| {row['image']} | {row['bytes']:,} | {row['expected']} | {row['answer']} | {row['ms']} |"
        )
    lines += ["", "| request | expected | answer | ms |", "|---|---|---|---|"]
    for row in hostile["requests"]:
        lines.append(f"| {row['request']} | {row['expected']} | {row['answer']} | {row['ms']} |")
    return lines
