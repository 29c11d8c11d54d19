"""Part (2) of the service benchmark: identification search on a synthetic gallery, in-process
numpy against the Redis Query Engine's FLAT index, both checked against a brute-force truth."""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.gallery_data import (
    NOISE,
    NOISY_QUERIES,
    RANDOM_QUERIES,
    exact_top_subjects,
    make_queries,
    synthetic_gallery,
)
from bench.machine import rss_bytes
from bench.paths import REPO
from bench.redis_info import ft_info, redis_search_config, redis_server_info, redis_wait_idle
from bench.timing import Contender, latency_summary, log, run_interleaved

DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000,)
DIM = 512
TOP_K = 5
LOAD_BATCH = 1000
SEARCH_MODEL_ID = "bench-synthetic-512"
GOAL_SEARCH_SIZE = 1_000_000
GOAL_SEARCH_MS = 50.0
REDIS_STACK_CACHE = REPO / ".cache" / "redis-stack"


def subject_name(code: int) -> str:
    return f"s{code:07d}"


def check_results(
    results: list[list[Any]], gt_codes: np.ndarray, gt_scores: np.ndarray, planted: np.ndarray, k: int
) -> dict[str, Any]:
    """Agreement of one path's answers with the brute-force truth and the planted subjects."""
    identical = 0
    overlap = []
    diffs = []
    top1_planted = []
    for q, hits in enumerate(results):
        got = [h.subject_id for h in hits]
        want = [subject_name(int(c)) for c in gt_codes[q]]
        identical += got == want
        overlap.append(len(set(got) & set(want)) / k)
        want_score = dict(zip(want, gt_scores[q].tolist(), strict=True))
        diffs += [abs(h.score - want_score[h.subject_id]) for h in hits if h.subject_id in want_score]
        if planted[q] >= 0:
            top1_planted.append(bool(hits) and hits[0].subject_id == subject_name(int(planted[q])))
    return {
        "queries": len(results),
        "topk_identical_to_brute_force": int(identical),
        "recall_at_k_vs_brute_force": float(np.mean(overlap)),
        "max_abs_score_diff_vs_brute_force": float(max(diffs)) if diffs else None,
        "recall_at_1_planted": float(np.mean(top1_planted)) if top1_planted else None,
        "exact": bool(identical == len(results)),
    }


def load_faces_into_redis(
    client, prefix: str, face_ids: list[str], subjects: list[str], vectors: np.ndarray
) -> float:
    """Write every face as the service's face hash, pipelined HSET in batches; returns seconds."""
    little = vectors.astype("<f4", copy=False)
    created = "2026-01-01T00:00:00.000Z"
    t0 = time.perf_counter()
    for s in range(0, len(face_ids), LOAD_BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(s, min(len(face_ids), s + LOAD_BATCH)):
            pipe.hset(
                f"{prefix}face:{face_ids[i]}",
                mapping={
                    "subject": subjects[i],
                    "embedding": little[i].tobytes(),
                    "model_id": SEARCH_MODEL_ID,
                    "photo_sha256": f"{i:064x}",
                    "created_at": created,
                },
            )
        pipe.execute()
    return time.perf_counter() - t0


@dataclass
class SearchData:
    """A synthetic gallery with its queries and their brute-force answers."""

    vectors: np.ndarray  # (faces, DIM) float32, unit rows
    face_ids: list[str]
    subjects: list[str]  # per face
    queries: np.ndarray  # (queries, DIM)
    planted: np.ndarray  # per query: the subject code it was copied from, or -1
    gt_codes: np.ndarray  # (queries, TOP_K) subject codes of the brute-force top-k
    gt_scores: np.ndarray  # (queries, TOP_K) their scores


def search_data(n: int, seed: int) -> tuple[SearchData, dict[str, Any]]:
    """``n`` seeded faces, the queries and the brute-force truth; with the size's first numbers."""
    t0 = time.perf_counter()
    vectors, codes, starts = synthetic_gallery(n, DIM, seed)
    face_ids = [f"f{i:07d}" for i in range(n)]
    names = [subject_name(c) for c in range(len(starts))]
    subjects = [names[c] for c in codes]
    queries, planted = make_queries(vectors, codes, seed)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gt_codes, gt_scores = exact_top_subjects(vectors, starts, queries, TOP_K)
    gt_s = time.perf_counter() - t0
    gt_planted = float(np.mean(gt_codes[planted >= 0, 0] == planted[planted >= 0]))
    entry: dict[str, Any] = {
        "faces": n,
        "subjects": len(starts),
        "dim": DIM,
        "k": TOP_K,
        "queries": {"random": RANDOM_QUERIES, "noisy_copies": NOISY_QUERIES, "noise": NOISE},
        "generate_s": gen_s,
        "brute_force_s": gt_s,
        "brute_force_recall_at_1_planted": gt_planted,
        "vectors_bytes": int(vectors.nbytes),
    }
    log(f"(2) search at {n} faces, {len(starts)} subjects: data in {gen_s:.1f} s, truth in {gt_s:.1f} s")
    return SearchData(vectors, face_ids, subjects, queries, planted, gt_codes, gt_scores), entry


def bench_search_size(n: int, args: argparse.Namespace, redis_ok: bool, repeats: int) -> dict[str, Any]:
    data, entry = search_data(n, args.seed + n)
    index = _numpy_index(data, entry)
    contenders = {"numpy": Contender(lambda q: index.search(q[None], TOP_K)[0])}
    with _redis_knn(data, args.appendfsync, entry, enabled=redis_ok) as knn:
        if knn is not None:
            contenders["redis"] = Contender(lambda q: knn.search(q[None], TOP_K)[0])
        _time_search(contenders, data, entry, repeats, args.time_budget)
        # All 100 queries in one call (throughput of a batch, per query).
        t0 = time.perf_counter()
        index.search(data.queries, TOP_K)
        entry["numpy"]["batch_of_100_ms_per_query"] = (time.perf_counter() - t0) / len(data.queries) * 1e3
    contenders.clear()
    return entry


def _numpy_index(data: SearchData, entry: dict[str, Any]):
    """The in-process index of every face; its build time and memory go in ``entry["numpy"]``."""
    from service.gallery.index import VectorIndex

    n = len(data.face_ids)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    index = VectorIndex(DIM)
    index.add(data.face_ids, data.subjects, data.vectors)
    build_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    entry["numpy"] = {
        "build_s": build_s,
        "build_faces_per_s": n / build_s,
        "rss_growth_bytes": rss1 - rss0,
        "index_nbytes": int(getattr(index, "nbytes", 0)) or None,
        "len": len(index),
    }
    return index


@contextmanager
def _redis_knn(data: SearchData, appendfsync: str, entry: dict[str, Any], enabled: bool) -> Iterator[Any]:
    """Redis Stack with every face loaded and the KNN index built (``entry["redis"]`` says how it
    went), stopped and removed afterwards; None when the Redis path is not available."""
    server = client = None
    data_dir = None
    try:
        if not enabled:
            yield None
            return
        from service.gallery.redis_search import RedisKnnSearch
        from service.redis_server import start_redis_stack

        data_dir = Path(tempfile.mkdtemp(prefix="sf-bench-stack-"))
        server = start_redis_stack(data_dir, cache_dir=REDIS_STACK_CACHE, appendfsync=appendfsync)
        client = server.client()
        knn = RedisKnnSearch(client, model_id=SEARCH_MODEL_ID, dim=DIM, prefix="sf:")
        knn.ensure_index()
        load = _load_redis(client, knn, data)
        entry["redis"] = _redis_entry(client, server, knn, appendfsync, len(data.face_ids), load)
        yield knn
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)


def _load_redis(client, knn, data: SearchData) -> dict[str, float]:
    """Write every face, wait for the index and for AOF rewrites: seconds and memory before."""
    mem0 = int(client.info("memory")["used_memory"])
    load_s = load_faces_into_redis(client, "sf:", data.face_ids, data.subjects, data.vectors)
    t0 = time.perf_counter()
    knn.ensure_index()  # waits while the engine is still indexing
    index_wait_s = time.perf_counter() - t0
    idle_s = redis_wait_idle(client)
    return {"mem0": mem0, "load_s": load_s, "index_wait_s": index_wait_s, "idle_s": idle_s}


def _redis_entry(client, server, knn, appendfsync: str, n: int, load: dict[str, float]) -> dict[str, Any]:
    """The Redis path's numbers: server, load, memory, the index as FT.INFO reports it."""
    mem = client.info("memory")
    fi = ft_info(client, knn.index_name)
    entry = {
        "server": redis_server_info(client),
        "appendfsync": appendfsync,
        "transport": server.url.split(":", 1)[0],
        "load_s": load["load_s"],
        "load_faces_per_s": n / load["load_s"],
        "index_wait_after_load_s": load["index_wait_s"],
        "aof_rewrite_wait_s": load["idle_s"],
        "used_memory_before_bytes": load["mem0"],
        "used_memory_bytes": int(mem["used_memory"]),
        "used_memory_rss_bytes": int(mem.get("used_memory_rss", 0)),
        "ft_info": {
            k: fi[k]
            for k in (
                "num_docs",
                "vector_index_sz_mb",
                "total_index_memory_sz_mb",
                "hash_indexing_failures",
            )
            if k in fi
        },
        "search_config": redis_search_config(client),
    }
    if int(fi.get("num_docs", n)) != n:
        log(f"WARNING: the Redis index holds {fi.get('num_docs')} faces, not {n}")
    return entry


def _time_search(contenders, data: SearchData, entry: dict[str, Any], repeats: int, budget_s: float) -> None:
    """The paths interleaved query by query; latency and agreement with the truth into ``entry``."""
    n = len(data.face_ids)
    items = list(data.queries)
    log(f"(2) search at {n}: {len(items)} queries x {len(contenders)} paths, {repeats} passes")
    seconds, outputs = run_interleaved(
        contenders, items, repeats, min(5, len(items)), f"search/{n}", budget_s
    )
    for name in contenders:
        entry[name]["latency"] = latency_summary(seconds[name])
        entry[name]["check"] = check_results(
            outputs[name], data.gt_codes, data.gt_scores, data.planted, TOP_K
        )


def bench_search(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}}
    redis_ok = True
    try:
        import service.gallery.redis_search  # noqa: F401
        import service.redis_server  # noqa: F401
    except ImportError as exc:
        redis_ok = False
        out["redis_skipped"] = f"not available yet: {exc}"
        log(f"(2) Redis path skipped: {exc}")
    for n in args.sizes:
        out["sizes"][str(n)] = bench_search_size(n, args, redis_ok, args.search_repeats)
    goal = out["sizes"].get(str(GOAL_SEARCH_SIZE))
    out["goal"] = {"size": GOAL_SEARCH_SIZE, "ms": GOAL_SEARCH_MS}
    for path in ("numpy", "redis"):
        if goal and path in goal:
            out["goal"][path] = {
                "median_ms": goal[path]["latency"]["median_ms"],
                "p90_ms": goal[path]["latency"]["p90_ms"],
                "exact": goal[path]["check"]["exact"],
                "met": goal[path]["latency"]["median_ms"] < GOAL_SEARCH_MS and goal[path]["check"]["exact"],
                "met_p90": goal[path]["latency"]["p90_ms"] < GOAL_SEARCH_MS and goal[path]["check"]["exact"],
            }
    return out
