"""What decoding costs: JPEGs at the scale detection needs, bombs refused before decoding, and a
serving worker's memory after large and hostile photos.

Sections (each figure over several runs, min/median/max):

1. ``decode``: CPU ms to decode the JPEGs of ``photos/`` at full size, at the service's scale
   (``decode_photo(min_side=--max-side)``) and at 1/2 and 1/4 (DCT scaling), summed over the photos,
   and the same for one photo at a phone camera's 4000x3000 (a real photo upscaled); ``path``: CPU
   ms per photo of decoding, detection and crops, full decode against the service's;
2. ``agreement``: the face path on the full decode (``decode_image`` + ``FacePipeline.crops``)
   against the reduced one (``decode_photo`` + ``FacePipeline.photo_crops``), per photo: the
   landmark shift in full-size pixels, the decode the crop came from, the cosine of the two
   embeddings, and whether every pair's verification decision is the same; at ``--max-side`` and at
   ``--stress-side`` (small enough that most photos decode at 1/2 or less);
3. ``bomb``: CPU seconds and peak memory of decode + detection of the 2,189-byte JPEG that claims
   6000x6000, each run in a fresh process;
4. ``service`` (``--service``): a real ``sphereface serve``: the bomb's answer and the worker's CPU
   time for it, and the worker's RSS at the start, after a hostile set and after 100 normal photos;
5. ``lfw`` (``--lfw``): the official LFW protocol with detected landmarks, detecting on each photo
   decoded at 1/``--lfw-reduction`` (DCT scaling) and cropping from the full photo, against the
   full decode: accuracy, landmark error, and landmark shift between the two (about 6 minutes on
   2 cores; ``--only-lfw`` runs it alone). The evaluation reads each photo and then calls the
   detector on its pixels: ``models.image.read_image`` is wrapped here to tell the detector which
   file to decode reduced.

    .venv/bin/python bench/decode_cost.py --service --lfw ../shared/data/lfw \
        --json docs/results/bench_decode_cost.json
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.processes import worker_cpu_s  # noqa: E402
from models.errors import FacePathError  # noqa: E402
from models.image import decode_image, decode_photo  # noqa: E402

#: The hostile photo of the decoding-cost finding: 2,189 bytes whose header claims 6000x6000.
BOMB_SIDE, BOMB_KEEP = 6000, 2187


def jpeg_bomb() -> bytes:
    """A flat 6000x6000 JPEG cut after 2,187 bytes and closed by an end-of-image marker."""
    buf = io.BytesIO()
    Image.new("RGB", (BOMB_SIDE, BOMB_SIDE), (128, 128, 128)).save(buf, "JPEG", quality=1)
    return buf.getvalue()[:BOMB_KEEP] + b"\xff\xd9"


def spread(values: list[float], digits: int = 1) -> dict[str, float]:
    return {
        "min": round(float(min(values)), digits),
        "median": round(float(np.median(values)), digits),
        "max": round(float(max(values)), digits),
    }


def photo_paths(data: Path) -> list[Path]:
    return sorted(p for p in (data / "photos").rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))


def phone_size_photo(data: Path) -> bytes:
    """people/lennon/1.jpg (1400x1050) upscaled to a phone camera's 4000x3000, JPEG quality 92."""
    with Image.open(data / "photos" / "people" / "lennon" / "1.jpg") as image:
        large = image.convert("RGB").resize((4000, 3000), Image.Resampling.LANCZOS)
    return _encode(large, "JPEG", quality=92)


def decode_times(blobs: list[bytes], side: int, rounds: int) -> dict[str, Any]:
    """CPU ms to decode every photo once, per way, interleaved over ``rounds``."""
    ways = {
        "full": lambda d: decode_photo(d),
        f"service (min_side {side})": lambda d: decode_photo(d, min_side=side),
        "1/2": lambda d: _forced(d, 2),
        "1/4": lambda d: _forced(d, 4),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    pixels = {name: sum(int(np.prod(way(d).image.shape[:2])) for d in blobs) for name, way in ways.items()}
    for r in range(rounds):
        for name in ways if r % 2 == 0 else list(ways)[::-1]:
            started = time.process_time()
            for data in blobs:
                ways[name](data)
            times[name].append(1e3 * (time.process_time() - started))
    return {
        "photos": len(blobs),
        "cpu_ms_all_photos": {name: spread(v) for name, v in times.items()},
        "decoded_megapixels": {name: round(p / 1e6, 2) for name, p in pixels.items()},
    }


def path_times(pipeline, blobs: list[bytes], rounds: int) -> dict[str, Any]:
    """CPU ms per photo of decode + detection + crops (policy largest): the full decode
    (``decode_image`` + ``crops``) against the service's (``decode_photo`` + ``photo_crops``)."""

    def full(data: bytes) -> None:
        pipeline.crops(decode_image(data), "largest")

    def reduced(data: bytes) -> None:
        pipeline.photo_crops(decode_photo(data, min_side=pipeline.decode_side), "largest")

    ways = {"full decode": full, "reduced decode": reduced}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in ways if r % 2 == 0 else list(ways)[::-1]:
            started = time.process_time()
            for data in blobs:
                try:
                    ways[name](data)
                except FacePathError:
                    pass
            times[name].append(1e3 * (time.process_time() - started) / len(blobs))
    return {"cpu_ms_per_photo": {name: spread(v) for name, v in times.items()}}


def _forced(data: bytes, reduction: int):
    """``data`` decoded at 1/``reduction`` (DCT scaling) whatever its size."""
    with Image.open(io.BytesIO(data)) as image:
        longest = max(image.size)
    return decode_photo(data, min_side=max(1, -(-longest // reduction)))


def agreement(pipeline, paths: list[Path], threshold: float) -> dict[str, Any]:
    """The full-size face path against the reduced one on each photo (policy largest)."""
    rows, full_embeddings, reduced_embeddings = [], [], []
    for path in paths:
        data = path.read_bytes()
        try:
            faces, crops = pipeline.crops(decode_image(data), "largest")
            found = pipeline.photo_crops(decode_photo(data, min_side=pipeline.decode_side), "largest")
        except FacePathError as exc:
            rows.append({"photo": path.name, "error": exc.code})
            continue
        photo = decode_photo(data, min_side=pipeline.decode_side)
        side = float(np.sqrt(faces[0].area))
        shift = float(np.abs(faces[0].landmarks - found.faces[0].landmarks).max())
        a, b = pipeline.embed_aligned(crops)[0], pipeline.embed_aligned(found.crops)[0]
        full_embeddings.append(a)
        reduced_embeddings.append(b)
        rows.append(
            {
                "photo": f"{path.parent.name}/{path.name}",
                "detected_at": photo.reduction,
                "cropped_at": found.source.reduction,
                "face_side_px": round(side, 1),
                "landmark_shift_px": round(shift, 2),
                "landmark_shift_of_side": round(shift / side, 4),
                "embedding_cosine": round(float(a @ b), 4),
            }
        )
    same = _same_decisions(np.array(full_embeddings), np.array(reduced_embeddings), threshold)
    shifts = [r["landmark_shift_px"] for r in rows if "landmark_shift_px" in r]
    cosines = [r["embedding_cosine"] for r in rows if "embedding_cosine" in r]
    return {
        "photos": len(rows),
        "reduced_for_detection": sum(r.get("detected_at", 1) > 1 for r in rows),
        "cropped_from_reduced": sum(r.get("cropped_at", 1) > 1 for r in rows),
        "landmark_shift_px": spread(shifts, 2) if shifts else None,
        "max_landmark_shift_of_side": max((r.get("landmark_shift_of_side", 0.0) for r in rows), default=None),
        "min_embedding_cosine": min(cosines, default=None),
        "pair_decisions": same,
        "per_photo": rows,
    }


def _same_decisions(full: np.ndarray, reduced: np.ndarray, threshold: float) -> dict[str, Any]:
    """Verification of every pair of photos at ``threshold``, full path against reduced path."""
    pairs = list(itertools.combinations(range(len(full)), 2))
    differ = [
        (i, j) for i, j in pairs if (full[i] @ full[j] >= threshold) != (reduced[i] @ reduced[j] >= threshold)
    ]
    deltas = [abs(float(full[i] @ full[j] - reduced[i] @ reduced[j])) for i, j in pairs]
    return {
        "pairs": len(pairs),
        "different_decisions": len(differ),
        "threshold": threshold,
        "max_cosine_change": round(max(deltas, default=0.0), 4),
    }


def bomb_child(model: str, side: int) -> dict[str, Any]:
    """One decode + detection of the bomb in this (fresh) process: CPU seconds, peak RSS growth."""
    from models.pipeline import FacePipeline
    from models.registry import resolve_model

    pipeline = FacePipeline(resolve_model(model), max_image_side=side, intra_op_threads=1)
    bomb = jpeg_bomb()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.process_time()
    try:
        pipeline.photo_crops(decode_photo(bomb, min_side=pipeline.decode_side), "largest")
        answer = "faces"
    except FacePathError as exc:
        answer = exc.code
    cpu = time.process_time() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"answer": answer, "cpu_s": cpu, "peak_rss_growth_mib": (peak - before) / 1024}


def bomb_runs(model: str, side: int, runs: int) -> dict[str, Any]:
    results = []
    for _ in range(runs):
        command = [sys.executable, __file__, "--bomb-child", "--model", model, "--max-side", str(side)]
        out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "bytes": len(jpeg_bomb()),
        "claims": f"{BOMB_SIDE}x{BOMB_SIDE}",
        "answers": sorted({r["answer"] for r in results}),
        "cpu_s": spread([r["cpu_s"] for r in results], 4),
        "peak_rss_growth_mib": spread([r["peak_rss_growth_mib"] for r in results], 1),
        "runs": runs,
    }


def hostile_set() -> list[tuple[str, bytes]]:
    """Large and hostile photos: the JPEG bomb, a 4000x4000 1-bit PNG of 2 KB, a 36 MP PNG that
    really decodes (108 MB), a 12 MP JPEG of noise (a phone photo's size), a forged TIFF."""
    rng = np.random.default_rng(0)
    rows = np.zeros((6000, 6000, 3), np.uint8)
    rows[::7] = 200
    noise = rng.integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + payload))
        return struct.pack(">I", len(payload)) + kind + payload + crc

    ihdr = struct.pack(">2I5B", 4000, 4000, 1, 0, 0, 0, 0)
    idat = zlib.compress(b"".join(b"\0" + bytes(500) for _ in range(4000)), 9)
    sparse = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    entries = b"".join(struct.pack("<HHII", tag, 3, 1, 1) for tag in range(65535))
    tiff = b"II*\x00" + struct.pack("<IH", 8, 65535) + entries + b"\0\0\0\0"
    return [
        ("bomb_6000.jpg", jpeg_bomb()),
        ("sparse_4000.png", sparse),
        ("rows_6000.png", _encode(Image.fromarray(rows), "PNG", compress_level=1)),
        ("noise_12mp.jpg", _encode(Image.fromarray(noise), "JPEG", quality=90)),
        ("ifd_65535.tif", tiff),
    ] * 2


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def service_run(model: Path, paths: list[Path], normal: int, idle_s: float) -> dict[str, Any]:
    """A real ``sphereface serve`` (1 worker): the bomb's answer and CPU, RSS through it all."""
    from service.serve_process import Service

    with tempfile.TemporaryDirectory(prefix="sfd") as work:
        service = Service(model, Path(work) / "data", extra_env={"SPHEREFACE_MAX_UPLOAD_BYTES": "67108864"})
        try:
            return _service_measure(service, paths, normal, idle_s)
        finally:
            service.stop()


def _service_measure(service, paths: list[Path], normal: int, idle_s: float) -> dict[str, Any]:
    client, pid = service.client, service.process.pid

    def embed(name: str, data: bytes) -> tuple[str, float]:
        cpu = worker_cpu_s(pid)
        r = client.post("/v1/embed", files=[("photos", (name, data))])
        body = r.json()
        status = body["photos"][0]["status"] if r.status_code == 200 else f"{r.status_code} {body['code']}"
        return status, worker_cpu_s(pid) - cpu

    for path in paths[:3]:
        embed(path.name, path.read_bytes())
    time.sleep(idle_s)
    rss = {"start": service.rss_mib()}
    bombs = [embed("bomb.jpg", jpeg_bomb()) for _ in range(5)]
    hostile, peak = [], rss["start"]
    for name, data in hostile_set():
        status, cpu = embed(name, data)
        hostile.append({"photo": name, "bytes": len(data), "answer": status, "worker_cpu_s": round(cpu, 2)})
        peak = max(peak, service.rss_mib())
    rss["after_hostile_busy"] = service.rss_mib()
    time.sleep(idle_s)
    rss["after_hostile_idle"] = service.rss_mib()
    for i in range(normal):
        embed(paths[i % len(paths)].name, paths[i % len(paths)].read_bytes())
    rss["after_normal_busy"] = service.rss_mib()
    time.sleep(idle_s)
    rss["after_normal_idle"] = service.rss_mib()
    return {
        "bomb_answer": sorted({status for status, _ in bombs}),
        "bomb_worker_cpu_s": spread([cpu for _, cpu in bombs], 3),
        "hostile": hostile,
        "rss_mib": {k: round(v) for k, v in rss.items()},
        "rss_peak_mib": round(peak),
        "normal_requests": normal,
        "ratio_to_start": {k: round(v / rss["start"], 2) for k, v in rss.items()},
    }


class _LastRead(threading.local):
    path: Path | None = None


def lfw_runs(lfw: Path, model: str, reduction: int, pairs_per_fold: int | None = None) -> dict[str, Any]:
    """The official protocol, detecting on the full decode and on the 1/``reduction`` decode."""
    import models.image as image_module
    from models.mtcnn import MTCNNDetector
    from models.registry import resolve_model
    from training.evaluation.lfw import run_lfw_evaluation

    last = _LastRead()
    read_image = image_module.read_image

    def reading(path, **limits):  # the evaluation reads each photo, then detects on it
        last.path = Path(path)
        return read_image(path, **limits)

    out: dict[str, Any] = {"reduction": reduction}
    points: dict[str, dict[str, np.ndarray]] = {}
    image_module.read_image = reading
    try:
        for way in ("full", f"1/{reduction}"):
            scale = 1 if way == "full" else reduction
            detector = _LfwDetector(MTCNNDetector(intra_op_threads=1), last, scale)
            evaluation = run_lfw_evaluation(
                resolve_model(model), lfw, "detect", detector=detector, pairs_per_fold=pairs_per_fold
            )
            report = evaluation.to_dict()
            keys = ("accuracy", "std", "faces_found_share", "landmark_error_px")
            out[way] = {k: report.get(k) for k in keys}
            points[way] = detector.points
    finally:
        image_module.read_image = read_image
    both = sorted(set(points["full"]) & set(points[f"1/{reduction}"]))
    shifts = np.array([np.abs(points["full"][k] - points[f"1/{reduction}"][k]).max() for k in both])
    out["landmark_shift_px"] = {
        "photos": len(both),
        "median": float(np.median(shifts)),
        "p99": float(np.percentile(shifts, 99)),
        "max": float(shifts.max()),
    }
    return out


class _LfwDetector:
    """``detect`` on the photo the evaluation just read, decoded at 1/``reduction``; faces in the
    full photo's pixels (the evaluation crops from its full decode)."""

    def __init__(self, detector, last: _LastRead, reduction: int) -> None:
        self.detector, self.last, self.reduction = detector, last, reduction
        self.provider = detector.provider
        self.points: dict[str, np.ndarray] = {}

    def detect(self, image: np.ndarray) -> list:
        from models.mtcnn import select_faces
        from models.pipeline import faces_to_full

        path = self.last.path
        if self.reduction == 1:
            faces = self.detector.detect(image)
        else:
            photo = _forced(path.read_bytes(), self.reduction)
            faces = faces_to_full(photo, self.detector.detect(photo.image))
        if faces:
            central = select_faces(faces, "central", image.shape)[0]
            self.points[f"{path.parent.name}/{path.name}"] = central.landmarks
        return faces

    def landmarks_in_box(self, image, box):
        return self.detector.landmarks_in_box(image, box)


def environment() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": cpu, "logical_cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--model", default="default")
    p.add_argument("--max-side", type=int, default=1024, help="the service's detect_max_side")
    p.add_argument("--stress-side", type=int, default=512, help="a smaller side: most photos reduced")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--service", action="store_true", help="also measure a real sphereface serve")
    p.add_argument("--normal", type=int, default=100, help="normal photos sent to the service")
    p.add_argument("--lfw", type=Path, help="an LFW folder: also run the protocol on reduced decodes")
    p.add_argument("--lfw-reduction", type=int, default=2)
    p.add_argument("--lfw-pairs-per-fold", type=int, help="a quick run on part of each fold")
    p.add_argument("--only-lfw", action="store_true", help="skip the other sections")
    p.add_argument("--json", type=Path)
    p.add_argument("--bomb-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.bomb_child:
        print(json.dumps(bomb_child(args.model, args.max_side)))
        return 0
    from models.manifest import load_manifest
    from models.pipeline import FacePipeline
    from models.registry import resolve_model

    paths = photo_paths(args.data)
    model_dir = resolve_model(args.model)
    threshold = load_manifest(model_dir).thresholds["verification"].value
    result: dict[str, Any] = {"env": environment(), "max_side": args.max_side, "rounds": args.rounds}
    if args.only_lfw and args.lfw:
        result["lfw"] = lfw_runs(args.lfw, args.model, args.lfw_reduction, args.lfw_pairs_per_fold)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    blobs, phone = [p.read_bytes() for p in paths], phone_size_photo(args.data)
    result["decode"] = decode_times(blobs, args.max_side, args.rounds)
    result["decode_4000x3000"] = decode_times([phone], args.max_side, args.rounds)
    result["agreement"], result["path"] = {}, {}
    for side in (args.max_side, args.stress_side):
        pipeline = FacePipeline(model_dir, max_image_side=side, intra_op_threads=2)
        result["agreement"][str(side)] = agreement(pipeline, paths, threshold)
        result["path"][str(side)] = path_times(pipeline, blobs, args.rounds)
        if side == args.max_side:
            result["path_4000x3000"] = path_times(pipeline, [phone] * 3, args.rounds)
    result["bomb"] = bomb_runs(args.model, args.max_side, args.rounds)
    if args.service:
        result["service"] = service_run(model_dir, paths, args.normal, idle_s=2.0)
    if args.lfw:
        result["lfw"] = lfw_runs(args.lfw, args.model, args.lfw_reduction, args.lfw_pairs_per_fold)
    result["env"]["loadavg_end"] = list(os.getloadavg())
    print(json.dumps(result, indent=1) if args.json is None else _summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _summary(result: dict[str, Any]) -> str:
    """The headline figures (the JSON file has them all)."""
    lines = [f"{result['env']['cpu_model']}, {result['env']['logical_cpus']} CPUs"]
    for key in ("decode", "decode_4000x3000"):
        for way, ms in result[key]["cpu_ms_all_photos"].items():
            mp = result[key]["decoded_megapixels"][way]
            lines.append(f"  {key} {way:24s} {ms['median']:7.1f} ms ({ms['min']}-{ms['max']}), {mp} MP")
    paths = [*((f"path {side}", t) for side, t in result["path"].items())]
    for key, times in [*paths, ("path 4000x3000", result["path_4000x3000"])]:
        for way, ms in times["cpu_ms_per_photo"].items():
            lines.append(f"  {key} {way:16s} {ms['median']:7.1f} ms/photo ({ms['min']}-{ms['max']})")
    for side, agree in result["agreement"].items():
        lines.append(
            f"  side {side}: {agree['reduced_for_detection']}/{agree['photos']} detected reduced, "
            f"{agree['cropped_from_reduced']} cropped reduced; "
            f"landmark shift {agree['landmark_shift_px']} px; "
            f"min cosine {agree['min_embedding_cosine']}; decisions differ "
            f"{agree['pair_decisions']['different_decisions']}/{agree['pair_decisions']['pairs']}"
        )
    bomb = result["bomb"]
    lines.append(f"  bomb: {bomb['answers']} CPU {bomb['cpu_s']} s, peak +{bomb['peak_rss_growth_mib']} MiB")
    if "service" in result:
        svc = result["service"]
        lines.append(f"  service bomb {svc['bomb_answer']} worker CPU {svc['bomb_worker_cpu_s']} s")
        lines.append(f"  service RSS {svc['rss_mib']} (peak {svc['rss_peak_mib']} MiB)")
        lines.append(f"  service RSS / start {svc['ratio_to_start']}")
    if "lfw" in result:
        lines.append("  lfw " + json.dumps(result["lfw"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
