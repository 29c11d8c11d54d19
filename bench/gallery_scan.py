"""Exact identification search at 1M and 10M faces: float32 scoring of every face against the int8
scan with exact re-rank (service/gallery/int8_scan.py), in the same process on the same gallery.

For each size: a seeded synthetic gallery (bench/gallery_data.py: random unit vectors, subjects
of 1 to 5 faces), ``--queries`` queries (half random, half noisy copies of stored faces), top-k
subjects. Both paths run through ``service.gallery.index.VectorIndex.search``; only its
``int8_scan_min_faces`` differs. Rounds are interleaved (float, int8, float, int8, ...; the order
alternates); each round times every query once. Reported: the median per-query latency over all
rounds with the min and max of the round medians, the ratio float / int8, the memory of each copy,
and a check of every answer against brute force (same subjects, same faces, same scores).

    .venv/bin/python bench/gallery_scan.py --json docs/results/bench_gallery_scan.json
    .venv/bin/python bench/gallery_scan.py --sizes 200000 --rounds 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gallery_data import exact_top_subjects, make_queries, synthetic_gallery  # noqa: E402
from service.gallery.index import VectorIndex  # noqa: E402

GOAL_MS = {10_000_000: 150.0, 1_000_000: 50.0}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_index(n: int, dim: int, seed: int) -> tuple[VectorIndex, np.ndarray, np.ndarray, dict[str, float]]:
    started = time.perf_counter()
    vectors, codes, starts = synthetic_gallery(n, dim, seed)
    generated = time.perf_counter() - started
    index = VectorIndex(dim, initial_capacity=n, int8_scan_min_faces=None)
    index.int8_allowed = True  # measured at every dim (the service uses it up to INT8_SCAN_MAX_DIM)
    started = time.perf_counter()
    for a in range(0, n, 1 << 20):
        b = min(n, a + (1 << 20))
        index.add([f"f{i:08d}" for i in range(a, b)], [f"s{c:08d}" for c in codes[a:b]], vectors[a:b])
    built = time.perf_counter() - started
    return index, vectors, starts, {"generate_s": generated, "build_s": built}


def check(
    index: VectorIndex, queries: np.ndarray, truth: tuple[np.ndarray, np.ndarray], k: int
) -> dict[str, Any]:
    """Every answer against brute force: same subjects in the same order, scores within 1e-5."""
    codes, scores = truth
    identical = 0
    worst = 0.0
    for q, want_codes, want_scores in zip(queries, codes, scores, strict=True):
        hits = index.search(q[None], k)[0]
        got = [int(h.subject_id[1:]) for h in hits]
        diff = float(np.max(np.abs(np.array([h.score for h in hits]) - want_scores)))
        worst = max(worst, diff)
        identical += got == [int(c) for c in want_codes] and diff < 1e-5
    return {"queries": len(queries), "identical_to_brute_force": identical, "max_abs_score_diff": worst}


def time_rounds(index: VectorIndex, queries: np.ndarray, k: int, rounds: int) -> dict[str, dict[str, Any]]:
    paths = {"float32": None, "int8": 1}
    times: dict[str, list[list[float]]] = {name: [] for name in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            index.int8_scan_min_faces = paths[name]
            per_query = []
            for q in queries:
                started = time.perf_counter()
                index.search(q[None], k)
                per_query.append(time.perf_counter() - started)
            times[name].append(per_query)
        log(f"  round {r + 1}: " + ", ".join(f"{n} {np.median(times[n][-1]) * 1e3:.1f} ms" for n in paths))
    out = {}
    for name, per_round in times.items():
        medians = [float(np.median(x)) * 1e3 for x in per_round]
        out[name] = {
            "median_ms": float(np.median(np.concatenate(per_round))) * 1e3,
            "round_median_ms": {
                "min": min(medians),
                "median": float(np.median(medians)),
                "max": max(medians),
            },
            "p90_ms": float(np.percentile(np.concatenate(per_round), 90)) * 1e3,
        }
    return out


def bench_size(n: int, dim: int, args: argparse.Namespace) -> dict[str, Any]:
    log(f"{n:,} faces of {dim} numbers: building")
    index, vectors, starts, entry = build_index(n, dim, args.seed + n)
    half = args.queries // 2
    queries, _ = make_queries(
        vectors, np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n))), args.seed, half, half
    )
    truth = exact_top_subjects(vectors, starts, queries, args.k)
    del vectors
    index.int8_scan_min_faces = 1
    started = time.perf_counter()
    index.search(queries[:1], args.k)  # builds the int8 copy
    entry["int8_build_s"] = time.perf_counter() - started
    entry.update(
        {
            "faces": n,
            "subjects": len(starts),
            "dim": dim,
            "float32_bytes": int(index._matrix[:n].nbytes),
            "int8_bytes": int(index._int8.codes[:n].nbytes),
            "candidates_per_query": float(
                np.mean(
                    [len(index._int8.candidates(q, n, index._subject_codes[:n], args.k)) for q in queries]
                )
            ),
        }
    )
    for name, limit in (("float32", None), ("int8", 1)):
        index.int8_scan_min_faces = limit
        entry.setdefault("check", {})[name] = check(index, queries, truth, args.k)
    entry["latency"] = time_rounds(index, queries, args.k, args.rounds)
    f, i = entry["latency"]["float32"], entry["latency"]["int8"]
    entry["ratio_float_over_int8"] = f["median_ms"] / i["median_ms"]
    goal = GOAL_MS.get(n)
    entry["goal_ms"] = goal
    entry["goal_met"] = None if goal is None else i["median_ms"] <= goal
    ratio = entry["ratio_float_over_int8"]
    log(f"  float32 {f['median_ms']:.1f} ms, int8 {i['median_ms']:.1f} ms ({ratio:.2f}x)")
    return entry


def render(report: dict[str, Any]) -> str:
    lines = [
        "| faces | dim | float32 ms (round range) | int8 + re-rank ms (round range) | float / int8 | "
        "memory float32 / int8 | candidates re-ranked | exact answers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in report["sizes"]:
        f, i = e["latency"]["float32"], e["latency"]["int8"]
        exact = f"{e['check']['int8']['identical_to_brute_force']}/{e['check']['int8']['queries']}"

        def rng(x: dict[str, Any]) -> str:
            r = x["round_median_ms"]
            return f"{x['median_ms']:.1f} ({r['min']:.1f}-{r['max']:.1f})"

        lines.append(
            f"| {e['faces']:,} | {e['dim']} | {rng(f)} | {rng(i)} | {e['ratio_float_over_int8']:.2f}x | "
            f"{e['float32_bytes'] / 2**30:.2f} / {e['int8_bytes'] / 2**30:.2f} GiB | "
            f"{e['candidates_per_query']:.0f} | {exact} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="1000000x512,1000000x128,10000000x128", help="FACESxDIM, comma separated"
    )
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--seed", type=int, default=20261125)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = []
    for item in args.sizes.split(","):
        n, _, dim = item.partition("x")
        sizes.append((int(n), int(dim or 128)))
    report: dict[str, Any] = {
        "command": "python bench/gallery_scan.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": os.getloadavg(),
        },
        "queries": args.queries,
        "rounds": args.rounds,
        "k": args.k,
        "sizes": [bench_size(n, dim, args) for n, dim in sizes],
    }
    report["machine"]["loadavg_end"] = os.getloadavg()
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
