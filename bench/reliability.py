"""Fault and load suite of the service: real `sphereface serve` processes, real redis-servers, real
photos, real faults (SIGKILL, SIGSTOP), hostile images. Prints a table per scenario and can write
them as Markdown and JSON (``docs/results/reliability.md``).

Scenarios:

* ``load``: clients at several concurrency levels send `/v1/verify` of two phone photos for a fixed
  time: requests, throughput, answers by code, latency of the answered ones (p50/p95/p99). Shows
  what one worker sustains on this machine before it sheds load (503 ``overloaded``).
* ``durability``: writers enroll faces (bulk enrollment of embeddings) while Redis is killed with
  SIGKILL and restarted, and then the API process is killed with SIGKILL and restarted; afterwards
  every acknowledged face must be in Redis (append-only file, ``appendfsync always``).
* ``pause``: Redis paused with SIGSTOP for a few seconds under traffic, then resumed: the slowest
  answer, answers by code, and whether the service answers normally afterwards.
* ``workers``: ``--workers 2``; clients enroll, identify and delete faces concurrently: an enrolled
  face must be found by the next identification (whichever worker answers) and a deleted one never.
* ``hostile``: decompression bombs of every accepted format, truncated and CMYK JPEGs, 16-bit PNGs,
  an animated GIF, a 1x1 image, the 8 EXIF orientations of a face photo: answers by code, no 500,
  the worker's memory before and after.

Usage::

    .venv/bin/python bench/reliability.py                      # every scenario (about 3 minutes)
    .venv/bin/python bench/reliability.py --short              # the short version (make test runs it)
    .venv/bin/python bench/reliability.py --markdown docs/results/reliability.md \
        --json docs/results/reliability.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import signal
import struct
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.paths import SHARED_DATA, short_temp_dir  # noqa: E402
from models.registry import resolve_model  # noqa: E402
from service.redis_server import LocalRedis, find_redis_server  # noqa: E402
from service.serve_process import HEADERS, Service  # noqa: E402

PHOTOS = SHARED_DATA / "photos"


# -- tallies --------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Answers of one scenario: counts by status and code, latencies of the 2xx."""

    codes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    slowest: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: int, code: str | None, seconds: float) -> None:
        with self.lock:
            self.codes[f"{status} {code}" if code else str(status)] += 1
            self.slowest = max(self.slowest, seconds)
            if 200 <= status < 300:
                self.latencies.append(seconds)

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    @property
    def server_errors(self) -> int:
        return sum(
            n
            for key, n in self.codes.items()
            if key.startswith("5") and "overloaded" not in key and "redis_unavailable" not in key
        )

    def percentiles(self) -> dict[str, float | None]:
        if not self.latencies:
            return {"p50": None, "p95": None, "p99": None}
        values = np.percentile(np.asarray(self.latencies) * 1000, [50, 95, 99])
        return {"p50": float(values[0]), "p95": float(values[1]), "p99": float(values[2])}


def call(tally: Tally, send: Callable[[], httpx.Response]) -> httpx.Response | None:
    start = time.monotonic()
    try:
        response = send()
    except httpx.HTTPError as exc:  # the process is down: no answer at all
        tally.add(0, type(exc).__name__, time.monotonic() - start)
        return None
    code = None
    if response.status_code >= 300:
        try:
            code = response.json().get("code")
        except ValueError:
            code = "not_json"
    tally.add(response.status_code, code, time.monotonic() - start)
    return response


def run_clients(count: int, seconds: float, work: Callable[[int], None]) -> None:
    deadline = time.monotonic() + seconds

    def loop(index: int) -> None:
        while time.monotonic() < deadline:
            work(index)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> list[list[float]]:
    v = rng.normal(size=(n, dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).tolist()


# -- scenarios ------------------------------------------------------------------------------------


def scenario_load(model: Path, workdir: Path, levels: list[tuple[int, bool]], seconds: float) -> list[dict]:
    """``levels``: (clients, honour Retry-After). Clients that honour it wait the seconds it says
    after a 503; the others retry at once (a retry storm)."""
    service = Service(model, workdir / "load")
    pair = sorted((PHOTOS / "people" / "obama").glob("*.jpg"))[:2]
    files = {"photo1": pair[0].read_bytes(), "photo2": pair[1].read_bytes()}
    rows = []
    try:
        client = httpx.Client(base_url=service.url, headers=HEADERS, timeout=60)
        for clients, backoff in levels:
            tally = Tally()

            def verify(_: int, tally: Tally = tally, backoff: bool = backoff) -> None:
                response = call(tally, lambda: client.post("/v1/verify", files=files))
                if backoff and response is not None and response.status_code == 503:
                    time.sleep(float(response.headers.get("retry-after", 1)))

            run_clients(clients, seconds, verify)
            answered = len(tally.latencies)
            rows.append(
                {
                    "clients": clients,
                    "honour Retry-After": backoff,
                    "requests": tally.requests,
                    "answered per s": round(answered / seconds, 2),
                    **{k: round(v) if v is not None else None for k, v in tally.percentiles().items()},
                    "codes": dict(tally.codes),
                    "server errors": tally.server_errors,
                }
            )
            print(f"load {clients:>3} clients: {rows[-1]}", flush=True)
        client.close()
    finally:
        service.stop()
    return rows


def scenario_durability(model: Path, workdir: Path, seconds: float, writers: int = 4) -> dict:
    redis = LocalRedis(workdir / "dur-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "dur-api", redis.url)
    state = {"url": service.url}
    acknowledged: list[str] = []
    tally = Tally()
    ack_lock = threading.Lock()
    counter = iter(range(10**9))

    def write(index: int) -> None:
        batch = [next(counter) for _ in range(5)]
        body = {
            "subjects": [f"w{index}-s{n % 50}" for n in batch],
            "embeddings": [unit_vectors(np.random.default_rng(n), 1, 128)[0] for n in batch],  # no duplicates
            "create_subjects": True,
        }
        with httpx.Client(base_url=state["url"], headers=HEADERS, timeout=10) as client:
            response = call(tally, lambda: client.post("/v1/enroll", json=body))
        if response is not None and response.status_code == 200:
            with ack_lock:
                acknowledged.extend(i["face"]["id"] for i in response.json()["items"] if i["status"] == "ok")
        elif response is None or response.status_code >= 500:
            time.sleep(0.05)

    faults = []

    def inject() -> None:
        nonlocal service
        time.sleep(seconds / 3)
        redis.kill()
        faults.append(("SIGKILL redis", len(acknowledged)))
        time.sleep(1.0)
        redis.start()
        time.sleep(seconds / 3 - 1.0)
        service.process.kill()  # SIGKILL of the API: no graceful shutdown
        service.process.wait()
        faults.append(("SIGKILL api", len(acknowledged)))
        service = Service(model, workdir / "dur-api2", redis.url)
        state["url"] = service.url

    injector = threading.Thread(target=inject)
    injector.start()
    run_clients(writers, seconds + 10, write)  # the restart of the API takes a few seconds
    injector.join()
    service.stop()
    client = redis.client()
    present = sum(bool(client.exists(f"sf:face:{face_id}")) for face_id in acknowledged)
    redis.stop()
    result = {
        "writes acknowledged": len(acknowledged),
        "present afterwards": present,
        "lost": len(acknowledged) - present,
        "faults": [f"{what} after {n} acknowledged" for what, n in faults],
        "codes": dict(tally.codes),
        "server errors": tally.server_errors,
    }
    print(f"durability: {result}", flush=True)
    return result


def scenario_pause(model: Path, workdir: Path, pause: float) -> dict:
    redis = LocalRedis(workdir / "pause-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "pause-api", redis.url)
    client = httpx.Client(base_url=service.url, headers=HEADERS, timeout=30)
    client.post("/v1/subjects", json={"id": "ada"})
    during, after = Tally(), Tally()
    try:
        os.kill(redis.pid, signal.SIGSTOP)
        run_clients(4, pause, lambda _: call(during, lambda: client.get("/v1/subjects/ada")))
        ready_start = time.monotonic()
        ready_during = client.get("/readyz")  # not tallied: its 503 is the answer a probe wants
        ready_seconds = time.monotonic() - ready_start
        os.kill(redis.pid, signal.SIGCONT)
        time.sleep(0.2)
        run_clients(2, 1.0, lambda _: call(after, lambda: client.get("/v1/subjects/ada")))
        result = {
            "paused s": pause,
            "answers while paused": dict(during.codes),
            "slowest answer while paused s": round(during.slowest, 2),
            "readyz while paused": f"{ready_during.status_code} {ready_during.json()['status']} "
            f"in {ready_seconds:.2f} s",
            "answers after resume": dict(after.codes),
            "server errors": during.server_errors + after.server_errors,
        }
    finally:
        client.close()
        service.stop()
        redis.stop()
    print(f"pause: {result}", flush=True)
    return result


def scenario_workers(model: Path, workdir: Path, seconds: float) -> dict:
    redis = LocalRedis(workdir / "workers-redis", binary=find_redis_server()).start()
    service = Service(model, workdir / "workers-api", redis.url, extra_env={"SPHEREFACE_WORKERS": "2"})
    tally = Tally()
    misses = Counter()
    rng = np.random.default_rng(1)
    lock = threading.Lock()
    ids = iter(range(10**9))

    def cycle(index: int) -> None:
        with lock:
            n = next(ids)
            vector = unit_vectors(rng, 1, 128)[0]
        subject = f"c{index}-{n}"
        with httpx.Client(base_url=service.url, headers=HEADERS, timeout=30) as client:
            r = call(
                tally,
                lambda: client.post(
                    "/v1/enroll",
                    json={"subjects": [subject], "embeddings": [vector], "create_subjects": True},
                ),
            )
            if r is None or r.status_code != 200:
                return
            for _ in range(2):  # two identifications: likely one on each worker
                found = call(
                    tally, lambda: client.post("/v1/identify", json={"embeddings": [vector]}, params={"k": 1})
                )
                if found is not None and found.status_code == 200:
                    best = found.json()["faces"][0]["candidates"]
                    misses["enrolled but not found"] += not best or best[0]["subject_id"] != subject
                    misses["checks"] += 1
            call(tally, lambda: client.delete(f"/v1/subjects/{subject}"))
            gone = call(
                tally, lambda: client.post("/v1/identify", json={"embeddings": [vector]}, params={"k": 1})
            )
            if gone is not None and gone.status_code == 200:
                best = gone.json()["faces"][0]["candidates"]
                misses["deleted but found"] += bool(best) and best[0]["subject_id"] == subject
                misses["checks"] += 1

    try:
        run_clients(8, seconds, cycle)
    finally:
        service.stop()
        redis.stop()
    result = {
        "requests": tally.requests,
        "consistency checks": misses["checks"],
        "enrolled but not found": misses["enrolled but not found"],
        "deleted but found": misses["deleted but found"],
        "codes": dict(tally.codes),
        "server errors": tally.server_errors,
    }
    print(f"workers: {result}", flush=True)
    return result


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


def scenario_hostile(model: Path, workdir: Path) -> dict:
    service = Service(model, workdir / "hostile")
    client = httpx.Client(base_url=service.url, headers=HEADERS, timeout=60)
    rows = []
    try:
        client.post("/v1/embed", files=[("photos", (PHOTOS / "people" / "obama" / "1.jpg").read_bytes())])
        before = service.rss_mib()
        for name, data, expected in hostile_images():
            start = time.monotonic()
            r = client.post("/v1/embed", files=[("photos", (name, data))])
            seconds = time.monotonic() - start
            if r.status_code == 200:
                item = r.json()["photos"][0]
                got = item["status"] if item["status"] != "ok" or item["faces"] else "no_face"
            else:
                got = f"{r.status_code} {r.json().get('code')}"
            rows.append(
                {
                    "image": name,
                    "bytes": len(data),
                    "expected": expected,
                    "answer": got,
                    "as expected": got == expected,
                    "ms": round(seconds * 1000),
                }
            )
        after = service.rss_mib()
    finally:
        client.close()
        service.stop()
    result = {
        "images": rows,
        "as expected": sum(r["as expected"] for r in rows),
        "server errors": sum(r["answer"].startswith("5") for r in rows),
        "rss before MiB": round(before),
        "rss after MiB": round(after),
    }
    print(
        f"hostile: {result['as expected']}/{len(rows)} as expected, RSS {before:.0f} -> {after:.0f} MiB",
        flush=True,
    )
    return result


# -- report ---------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """The tables of the scenarios ``results`` holds (a run with ``--only`` and no earlier JSON has
    only some)."""
    lines = [f"# Reliability suite ({results['when']}, {results['machine']})"]
    if "load" in results:
        lines += _load_table(results["load"])
    for name in ("durability", "pause", "workers"):
        if name in results:
            lines += ["", f"## {name.capitalize()}", "", "| measure | value |", "|---|---|"]
            lines += [f"| {key} | {value} |" for key, value in results[name].items()]
    if "hostile" in results:
        lines += _hostile_table(results["hostile"])
    return "\n".join(lines) + "\n"


def _load_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## Load: `/v1/verify` of two phone photos, one worker",
        "",
        "| clients | honour Retry-After | requests | answered / s | p50 ms | p95 ms | p99 ms | answers "
        "| server errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(row["codes"].items()))
        backoff = "yes" if row["honour Retry-After"] else "no: retry at once"
        lines.append(
            f"| {row['clients']} | {backoff} | {row['requests']} | {row['answered per s']} | {row['p50']} | "
            f"{row['p95']} | {row['p99']} | {codes} | {row['server errors']} |"
        )
    return lines


def _hostile_table(hostile: dict) -> list[str]:
    lines = [
        "",
        "## Hostile images (`/v1/embed`, one per request)",
        "",
        f"{hostile['as expected']}/{len(hostile['images'])} as expected, {hostile['server errors']} server "
        f"errors; worker RSS {hostile['rss before MiB']} MiB before, {hostile['rss after MiB']} MiB after.",
        "",
        "| image | bytes | expected | answer | ms |",
        "|---|---|---|---|---|",
    ]
    for row in hostile["images"]:
        lines.append(
            f"| {row['image']} | {row['bytes']:,} | {row['expected']} | {row['answer']} | {row['ms']} |"
        )
    return lines


SCENARIOS = ("load", "durability", "pause", "workers", "hostile")


def run(short: bool, only: tuple[str, ...] = SCENARIOS) -> dict:
    model = resolve_model("default")
    workdir = short_temp_dir()
    levels = [(1, True), (4, True)] if short else [(n, True) for n in (1, 2, 4, 8, 16, 32)] + [(16, False)]
    scenarios = {
        "load": lambda: scenario_load(model, workdir, levels, 3 if short else 15),
        "durability": lambda: scenario_durability(model, workdir, 6 if short else 30),
        "pause": lambda: scenario_pause(model, workdir, 2 if short else 5),
        "workers": lambda: scenario_workers(model, workdir, 4 if short else 20),
        "hostile": lambda: scenario_hostile(model, workdir),
    }
    results = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "short": short,
    }
    try:
        for name in only:
            results[name] = scenarios[name]()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="short durations (the version make test runs)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIOS, help="run these scenarios; the others are kept from --json"
    )
    args = parser.parse_args()
    random.seed(0)
    results = run(args.short, tuple(args.only or SCENARIOS))
    if args.only and args.json and args.json.exists():
        results = {**json.loads(args.json.read_text()), **results}
    text = markdown(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
