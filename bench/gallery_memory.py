"""Memory of `sphereface serve --workers 2` with 1M stored faces: every worker its own copy of the
vectors, against one snapshot that the workers map (service/gallery/snapshot.py).

1. A local redis-server gets ``--faces`` seeded random faces of the served model (128 numbers for
   the default model), written as the service writes them (face hashes and the model's face set).
2. For each mode (``off``: ``SPHEREFACE_GALLERY_SNAPSHOTS=off``, each worker loads Redis into its
   own matrix; ``shared``: the default of ``--workers 2``, a snapshot in /dev/shm), a real
   ``sphereface serve --workers 2`` starts on that Redis; once both workers have loaded the
   gallery and answered 20 ``/v1/identify`` requests (a real photo; the requests are spread over
   the workers), each worker's RSS, PSS (its fair share of pages shared with others) and private
   memory are read from ``/proc/<pid>/smaps_rollup``, with the snapshot's size in /dev/shm. The
   machine's total is the workers' private memory, plus /dev/shm, plus the shared libraries once.
3. Search latency over the mapped snapshot against the private matrix, in process: the same
   gallery as a :class:`VectorIndex` and as a :class:`LayeredIndex` on its snapshot, 5
   interleaved rounds of 20 queries (median per query and the range of the round medians).

    .venv/bin/python bench/gallery_memory.py --json docs/results/bench_gallery_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gallery_data import make_queries, synthetic_gallery  # noqa: E402
from service.gallery.index import LayeredIndex, VectorIndex  # noqa: E402
from service.gallery.snapshot import SnapshotFolder  # noqa: E402
from service.gallery.store import GalleryStore  # noqa: E402
from service.redis_server import LocalRedis, find_redis_server  # noqa: E402
from service.serve_process import free_port, serve_command  # noqa: E402

KEY = "bench-gallery-memory-key"
SEARCHES = 20
BATCH = 5000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_gallery(store: GalleryStore, model_id: str, vectors: np.ndarray, codes: np.ndarray) -> float:
    """Write faces as the service stores them (face hash + the model's face set); seconds."""
    started = time.perf_counter()
    little = vectors.astype("<f4", copy=False)
    for a in range(0, len(vectors), BATCH):
        pipe = store.redis.pipeline(transaction=False)
        ids = [f"f{i:08x}" for i in range(a, min(len(vectors), a + BATCH))]
        for i, face_id in enumerate(ids, start=a):
            pipe.hset(
                store.face_key(face_id),
                mapping={
                    "subject": f"s{codes[i]:08d}",
                    "embedding": little[i].tobytes(),
                    "model_id": model_id,
                },
            )
        pipe.sadd(store.model_faces_key(model_id), *ids)
        pipe.execute()
    store.revision_and_epoch()  # sets the gallery's epoch
    return time.perf_counter() - started


def memory_of(pid: int) -> dict[str, int]:
    """kB figures of /proc/<pid>/smaps_rollup, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        out[name] = int(value.split()[0]) * 1024
    return out


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid and b"python" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def serve_and_measure(redis_url: str, mode: str, data_dir: Path, faces: int) -> dict[str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "SPHEREFACE_API_KEY": KEY,
        "SPHEREFACE_INTRA_OP_THREADS": "1",
    }
    env["SPHEREFACE_WORKERS"] = "2"
    if mode == "off":
        env["SPHEREFACE_GALLERY_SNAPSHOTS"] = "off"
    log_path = data_dir / f"serve-{mode}.log"
    command = serve_command(port, "--data-dir", str(data_dir))
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": KEY}, timeout=30)
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not get ready: {log_path.read_text()[-2000:]}")
            try:
                ready = client.get("/readyz")
                if ready.status_code == 200 and ready.json().get("gallery_faces") == faces:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # Each worker loads the gallery in its startup, then uvicorn logs "startup complete".
        while log_path.read_text().count("Application startup complete") < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        ready_s = time.perf_counter() - started
        photo = REPO.parent / "shared" / "data" / "photos" / "people" / "obama" / "1.jpg"
        searches = []
        for _ in range(SEARCHES):  # spread over both workers by the kernel: each maps what it reads
            t = time.perf_counter()
            r = client.post(  # a new connection each: the kernel hands them to either worker
                "/v1/identify",
                files=[("photo", (photo.name, photo.read_bytes(), "image/jpeg"))],
                headers={"Connection": "close"},
            )
            r.raise_for_status()
            searches.append(time.perf_counter() - t)
        time.sleep(1)
        workers = [
            pid for pid in children(process.pid) if "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()
        ]
        per_worker = []
        for pid in workers:
            m = memory_of(pid)
            per_worker.append(
                {
                    "pid": pid,
                    "rss_bytes": m["Rss"],
                    "pss_bytes": m["Pss"],
                    "private_bytes": m["Private_Clean"] + m["Private_Dirty"],
                    "shared_bytes": m["Shared_Clean"] + m["Shared_Dirty"],
                }
            )
        shm = Path(f"/dev/shm/sphereface-gallery-{process.pid}")
        shm_bytes = sum(p.stat().st_size for p in shm.rglob("*") if p.is_file()) if shm.exists() else 0
        private = sum(w["private_bytes"] for w in per_worker)
        return {
            "mode": mode,
            "workers": per_worker,
            "ready_s": ready_s,
            "snapshot_bytes_in_dev_shm": shm_bytes,
            "total_bytes": private + shm_bytes + max((w["shared_bytes"] for w in per_worker), default=0),
            "identify_median_ms": float(np.median(searches)) * 1e3,
        }
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def search_latency(
    vectors: np.ndarray, codes: np.ndarray, rounds: int, seed: int, root: Path
) -> dict[str, Any]:
    """VectorIndex (private matrix) against LayeredIndex (mapped snapshot), same faces, same queries."""
    n, dim = vectors.shape
    plain = VectorIndex(dim, initial_capacity=n)
    plain.add([f"f{i:08x}" for i in range(n)], [f"s{c:08d}" for c in codes], vectors)
    folder = SnapshotFolder(root, "bench", "epoch")
    meta = folder.write(1, "0-0", n, dim, plain.chunks(), with_codes=True)
    layered = LayeredIndex(folder.open(meta))
    queries, _ = make_queries(vectors, codes, seed, 10, 10)
    paths = {"private matrix (VectorIndex)": plain, "mapped snapshot (LayeredIndex)": layered}
    for q in queries:  # same answers
        a, b = plain.search(q[None], 5)[0], layered.search(q[None], 5)[0]
        assert [h.face_id for h in a] == [h.face_id for h in b], (a, b)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for name in paths if r % 2 == 0 else reversed(paths):
            per = []
            for q in queries:
                t = time.perf_counter()
                paths[name].search(q[None], 5)
                per.append(time.perf_counter() - t)
            times[name].append(float(np.median(per)) * 1e3)
    return {
        name: {"median_ms": float(np.median(v)), "min_ms": min(v), "max_ms": max(v)}
        for name, v in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faces", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128, help="the served model's (default model: 128)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=20261125)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from models.manifest import load_manifest
    from models.registry import resolve_model

    manifest = load_manifest(resolve_model("default"))
    if manifest.output_size != args.dim:
        raise SystemExit(f"the default model makes {manifest.output_size} numbers, not {args.dim}")
    vectors, codes, _ = synthetic_gallery(args.faces, args.dim, args.seed)
    work = Path(tempfile.mkdtemp(prefix="sfgm"))
    redis = LocalRedis(work / "redis", binary=find_redis_server()).start()
    report: dict[str, Any] = {"command": "python bench/gallery_memory.py " + " ".join(sys.argv[1:])}
    try:
        import redis as redis_py

        store = GalleryStore(redis_py.Redis.from_url(redis.url), "sf:")
        report["load_s"] = load_gallery(store, manifest.model_id, vectors, codes)
        report.update(
            faces=args.faces, dim=args.dim, model_id=manifest.model_id, vectors_bytes=int(vectors.nbytes)
        )
        log(f"{args.faces:,} faces in Redis in {report['load_s']:.0f} s")
        report["serve"] = [serve_and_measure(redis.url, mode, work, args.faces) for mode in ("off", "shared")]
        for run in report["serve"]:
            gib = [f"{w['rss_bytes'] / 2**30:.2f}/{w['pss_bytes'] / 2**30:.2f}" for w in run["workers"]]
            total = run["total_bytes"] / 2**30
            ready = run["ready_s"]
            log(f"{run['mode']}: RSS/PSS GiB per worker {gib}, total {total:.2f} GiB, ready {ready:.0f} s")
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    shm = Path(
        tempfile.mkdtemp(prefix="sfgm-search", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    )
    try:
        report["search"] = search_latency(vectors, codes, args.rounds, args.seed, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    log(json.dumps(report["search"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
