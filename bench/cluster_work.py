"""The processes of bench/cluster.py: bulk writers (``add_faces_bulk`` of a range of synthetic
faces) and a pod (a process holding a ``LiveIndex`` of the whole gallery, answering probes).

Both run in processes started with ``spawn``: they import only numpy, redis-py and the service's
gallery code, so a pod's resident memory is the gallery's and not the benchmark's.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster_servers import LayoutSpec

MODEL_ID = "bench-cluster"
_STORES: dict[LayoutSpec, Any] = {}


def proc_memory() -> dict[str, int]:
    """This process's resident set size now and at its peak (bytes, from /proc/self/status)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        for name, key in (("VmRSS:", "rss"), ("VmHWM:", "peak_rss")):
            if line.startswith(name):
                out[key] = int(line.split()[1]) * 1024
    return out


def unit_vectors(seed: int, count: int, dim: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((count, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def _store(spec: LayoutSpec):
    from service.gallery.store import GalleryStore

    if spec not in _STORES:
        _STORES[spec] = GalleryStore(spec.client())
    return _STORES[spec]


def connect_writer(specs: list[LayoutSpec]) -> None:
    """A writer process's initializer: its store of every layout, connected (untimed)."""
    for spec in specs:
        _store(spec).revision()


def enroll_range(
    spec: LayoutSpec, start: int, count: int, dim: int, per_subject: int, batch: int
) -> tuple[int, float]:
    """Enroll faces ``start`` to ``start + count`` (face i of subject ``s{i // per_subject}``, its
    vector seeded by its range) in ``add_faces_bulk`` calls of ``batch``; the faces stored and the
    CPU seconds this process spent inside ``add_faces_bulk``."""
    from service.gallery.store import NewFace, embedding_sha256

    store = _store(spec)
    vectors = unit_vectors(start, count, dim)
    stored, cpu = 0, 0.0
    for s in range(0, count, batch):
        items = [
            (f"s{(start + i) // per_subject}", NewFace(v, embedding_sha256(v), source="embedding"))
            for i, v in zip(range(s, min(count, s + batch)), vectors[s : s + batch], strict=False)
        ]
        t0 = time.process_time()
        results = store.add_faces_bulk(items, MODEL_ID, create_subjects=True)
        cpu += time.process_time() - t0
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise RuntimeError(f"{len(failed)} faces not enrolled on {spec.name}: {failed[0]}")
        stored += len(results)
    return stored, cpu


def pod_main(conn: Connection, spec: LayoutSpec, dim: int, k: int) -> None:
    """A pod: load the gallery into a LiveIndex, report the load, then answer probe commands."""
    from service.gallery.index import LiveIndex
    from service.gallery.store import GalleryStore

    store = GalleryStore(spec.client())
    before = proc_memory()
    live = LiveIndex(store, MODEL_ID, dim)
    t0 = time.perf_counter()
    live.refresh()
    load_s = time.perf_counter() - t0
    loaded = proc_memory()
    t0 = time.perf_counter()
    live.search(unit_vectors(2**31, 1, dim), k)  # the first search builds the int8 copy (1M+ faces)
    first_search_s = time.perf_counter() - t0
    conn.send({"faces": len(live), "load_s": load_s, "first_search_s": first_search_s,
               "int8_scan": live.index._int8 is not None, "index_nbytes": live.index.nbytes,
               "matrix_nbytes": live.index._matrix.nbytes, "memory_before": before,
               "memory_loaded": loaded, "memory_searched": proc_memory()})  # fmt: skip
    while (message := conn.recv()) is not None:
        conn.send(_probe(live, k, dim, *message))
    conn.close()


def _probe(live, k: int, dim: int, probes: int, seed: int) -> dict[str, list[float]]:
    """``probes`` random probes, each timed three ways: the refresh alone (no change to catch
    up on), the top-k scan alone, and identification as the service runs it (refresh + top-k)."""
    queries = unit_vectors(seed, 2 * probes, dim)
    out: dict[str, list[float]] = {"refresh": [], "scan": [], "identify": []}
    for i in range(probes):
        t0 = time.perf_counter()
        live.refresh()
        t1 = time.perf_counter()
        live.index.search(queries[2 * i : 2 * i + 1], k)
        t2 = time.perf_counter()
        live.search(queries[2 * i + 1 : 2 * i + 2], k)
        t3 = time.perf_counter()
        out["refresh"].append(t1 - t0)
        out["scan"].append(t2 - t1)
        out["identify"].append(t3 - t2)
    return out
