"""The gallery on one Redis against a Redis Cluster, through the service's GalleryStore and LiveIndex.

One run starts every layout asked for (``--layouts``; default ``single``: one plain redis-server,
and ``cluster``: a Redis Cluster of 3 primaries without replicas; ``cluster-replicas`` adds one
replica per primary), all on loopback TCP, none persisting, and measures on each:

* enrollment: ``--faces`` synthetic 128-d unit vectors (no stored face images), ``--per-subject``
  faces per subject, written by ``--writers`` processes through ``GalleryStore.add_faces_bulk``
  (``--batch`` faces per call, subjects created with their first face) in ``--enroll-rounds``
  rounds: round r enrolls the next share of the faces into every layout in turn (who goes first
  rotates), so each round gives one faces/s per layout at the same gallery size, and the CPU time
  per 1,000 faces of the writers (inside ``add_faces_bulk``) and of the layout's redis-servers;
* memory: INFO memory ``used_memory`` of every node, and their sum over the primaries;
* a pod: a process of its own per layout holding a ``LiveIndex`` of the whole gallery; the time
  of its initial load, its resident memory and the vectors' share of it;
* identification: ``--probe-rounds`` rounds of ``--probes`` random probes per pod (pods in turn,
  the order rotated), each timed as the refresh alone (which on a cluster reads every partition's
  revision), the top-k scan alone, and refresh + top-k (``LiveIndex.search``, as the service runs it).

Figures are medians over rounds with the smallest and largest round, ratios against the first
layout in the same round. Usage (``make bench-cluster``; ``--faces 20000`` for a quick run)::

    .venv/bin/python bench/cluster.py --faces 1000000 --json docs/results/bench_cluster.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.cluster_servers import Layout  # noqa: E402
from bench.cluster_work import connect_writer, enroll_range, pod_main  # noqa: E402

#: The pod's numpy threads are set through these (read when a process imports numpy).
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
LAYOUTS = {
    "single": lambda: Layout("single", 1),
    "cluster": lambda: Layout("cluster", 3, 0, cluster=True),
    "cluster-replicas": lambda: Layout("cluster-replicas", 3, 1, cluster=True),
}


def _spread(values) -> dict[str, float]:
    values = np.asarray(values, dtype=float)
    return {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max())}


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names) :] + names[: r % len(names)]


def _bounds(faces: int, parts: int, unit: int) -> list[int]:
    """``parts + 1`` increasing bounds from 0 to ``faces``, inner ones multiples of ``unit``."""
    inner = [int(round(faces * i / parts / unit)) * unit for i in range(1, parts)]
    return sorted({0, *[min(b, faces) for b in inner], faces})


def enroll(pool, layouts: dict[str, Layout], args: argparse.Namespace) -> dict[str, Any]:
    """Every layout gets the same faces, round by round; faces/s per layout and round."""
    rounds = _bounds(args.faces, args.enroll_rounds, args.per_subject)
    names = list(layouts)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu = {name: {"writers": 0.0, "redis": 0.0, "faces": 0} for name in names}
    for r, (lo, hi) in enumerate(zip(rounds, rounds[1:], strict=False)):
        cuts = _bounds(hi - lo, args.writers, args.per_subject)
        for name in _rotated(names, r):
            tasks = [(layouts[name].spec, lo + a, b - a, args.dim, args.per_subject, args.batch)
                     for a, b in zip(cuts, cuts[1:], strict=False)]  # fmt: skip
            redis_cpu = layouts[name].cpu_seconds()
            t0 = time.perf_counter()
            done = pool.starmap(enroll_range, tasks)
            rates[name].append(sum(n for n, _ in done) / (time.perf_counter() - t0))
            layouts[name].wait_replicated()
            cpu[name]["redis"] += layouts[name].cpu_seconds() - redis_cpu
            cpu[name]["writers"] += sum(c for _, c in done)
            cpu[name]["faces"] += sum(n for n, _ in done)
        _log(f"enroll round {r + 1}/{len(rounds) - 1} ({hi:,} faces): "
             + ", ".join(f"{n} {rates[n][-1]:,.0f} faces/s" for n in names))  # fmt: skip
    base = np.array(rates[names[0]])
    return {name: {"faces_per_s": _spread(v), "per_round_faces_per_s": [round(x, 1) for x in v],
                   "ratio_to_first": _spread(np.array(v) / base),
                   "cpu_ms_per_1000_faces": {side: cpu[name][side] / cpu[name]["faces"] * 1e6
                                             for side in ("writers", "redis")}}
            for name, v in rates.items()}  # fmt: skip


def memory(layout: Layout, empty: list[dict[str, Any]], faces: int) -> dict[str, Any]:
    nodes = layout.memory()
    primaries = [n for n in nodes if n["role"] == "master"]
    used = sum(n["used_memory"] for n in primaries)
    empty_used = sum(n["used_memory"] for n in empty if n["role"] == "master")
    return {
        "nodes": nodes,
        "empty_nodes": empty,
        "primaries_used_memory": used,
        "replicas_used_memory": sum(n["used_memory"] for n in nodes if n["role"] != "master"),
        "bytes_per_face": (used - empty_used) / faces,
    }


def start_pod(ctx, layout: Layout, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """A pod process for ``layout``; waits for its initial load and returns what it reported."""
    here, there = ctx.Pipe()
    process = ctx.Process(target=pod_main, args=(there, layout.spec, args.dim, args.k), daemon=True)
    saved = {name: os.environ.get(name) for name in BLAS_THREADS}
    os.environ.update(dict.fromkeys(BLAS_THREADS, str(args.blas_threads)))
    t0 = time.perf_counter()
    try:
        process.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    loaded = here.recv()
    loaded["start_to_ready_s"] = time.perf_counter() - t0
    _log(f"pod on {layout.name}: {loaded['faces']:,} faces loaded in {loaded['load_s']:.1f} s")
    return process, here, loaded


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95))}


def identify(pipes: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Probe rounds, pods in turn: per round and kind (refresh, scan, identify) p50 and p95 in ms."""
    names = list(pipes)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(args.probe_rounds):
        for name in _rotated(names, r):
            pipes[name].send((args.probes, 1_000_000_007 + r))
            rounds[name].append({kind: _percentiles(s) for kind, s in pipes[name].recv().items()})
        _log(f"probe round {r + 1}/{args.probe_rounds}: "
             + ", ".join(f"{n} {rounds[n][-1]['identify']['p50']:.2f} ms" for n in names))  # fmt: skip
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {}
        for kind in ("refresh", "scan", "identify"):
            out[name][kind] = {q: _spread([row[kind][q] for row in rounds[name]]) for q in ("p50", "p95")}
            ratio = [row[kind]["p50"] / base[kind]["p50"] for row, base in zip(rounds[name], rounds[names[0]],
                                                                                 strict=True)]  # fmt: skip
            out[name][kind]["p50_ratio_to_first"] = _spread(ratio)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    layouts = {name: LAYOUTS[name]() for name in args.layouts}
    results: dict[str, Any] = {name: {"layout": layout.describe()} for name, layout in layouts.items()}
    pods: dict[str, tuple[Any, Any]] = {}
    try:
        for layout in layouts.values():
            layout.start()
        empty = {name: layout.memory() for name, layout in layouts.items()}
        t0 = time.perf_counter()
        specs = [layout.spec for layout in layouts.values()]
        with ctx.Pool(args.writers, initializer=connect_writer, initargs=(specs,)) as pool:
            pool.map(time.sleep, [0.3] * 2 * args.writers, chunksize=1)  # every writer started and connected
            enrolled = enroll(pool, layouts, args)
        enroll_s = time.perf_counter() - t0
        for name, layout in layouts.items():
            results[name].update(enroll=enrolled[name], redis_memory=memory(layout, empty[name], args.faces))
        for name, layout in layouts.items():
            process, pipe, loaded = start_pod(ctx, layout, args)
            pods[name] = (process, pipe)
            results[name]["pod"] = loaded
        t1 = time.perf_counter()
        probed = identify({name: pipe for name, (_, pipe) in pods.items()}, args)
        for name in layouts:
            results[name]["identify_ms"] = probed[name]
        phases = {"enroll_s": enroll_s, "probe_s": time.perf_counter() - t1}
    finally:
        for process, pipe in pods.values():
            pipe.send(None)
            process.join(timeout=30)
        for layout in layouts.values():
            layout.stop()
    return {"layouts": results, "phases": phases}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def _print(report: dict[str, Any]) -> None:
    print(f"\n{report['faces']:,} faces of {report['dim']} numbers, {report['per_subject']} per subject; "
          f"{report['writers']} writer processes, batches of {report['batch']}; "
          "median (min-max) over rounds")  # fmt: skip
    for name, r in report["layouts"].items():
        e, m, pod, ident = r["enroll"], r["redis_memory"], r["pod"], r["identify_ms"]
        f, cpu = e["faces_per_s"], e["cpu_ms_per_1000_faces"]
        print(f"\n{name}: {r['layout']}")
        print(f"  enroll      {f['median']:9,.0f} faces/s ({f['min']:,.0f}-{f['max']:,.0f})"
              f"  x{e['ratio_to_first']['median']:.2f}; CPU ms per 1,000 faces: writers "
              f"{cpu['writers']:,.0f}, Redis {cpu['redis']:,.0f}")  # fmt: skip
        per_node = ", ".join(_mb(n["used_memory"]) for n in m["nodes"] if n["role"] == "master")
        print(
            f"  Redis       {_mb(m['primaries_used_memory'])} on the primaries ({per_node}),"
            f" {m['bytes_per_face']:,.0f} bytes per face; replicas {_mb(m['replicas_used_memory'])}"
        )
        grown = pod["memory_loaded"]["rss"] - pod["memory_before"]["rss"]
        print(
            f"  pod         load {pod['load_s']:.1f} s, first search {pod['first_search_s']:.2f} s, RSS "
            f"{_mb(pod['memory_searched']['rss'])} (+{_mb(grown)} loading; index {_mb(pod['index_nbytes'])})"
        )
        for kind in ("identify", "refresh", "scan"):
            p50, p95 = ident[kind]["p50"], ident[kind]["p95"]
            print(f"  {kind:10s}  p50 {p50['median']:7.2f} ms ({p50['min']:.2f}-{p50['max']:.2f})"
                  f"  p95 {p95['median']:7.2f} ms ({p95['min']:.2f}-{p95['max']:.2f})"
                  f"  x{ident[kind]['p50_ratio_to_first']['median']:.2f}")  # fmt: skip
    print(f"\nthe whole run: {report['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faces", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--per-subject", type=int, default=10, help="faces per subject")
    p.add_argument("--writers", type=int, default=2, help="writer processes")
    p.add_argument("--batch", type=int, default=256, help="faces per add_faces_bulk call")
    p.add_argument("--enroll-rounds", type=int, default=5)
    p.add_argument("--probe-rounds", type=int, default=7)
    p.add_argument("--probes", type=int, default=30, help="probes per pod and round")
    p.add_argument("--k", type=int, default=5, help="subjects per identification (the service's default)")
    p.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="numpy threads of a pod (float scan, re-rank); the int8 scan's ONNX Runtime keeps its own",
    )
    p.add_argument("--layouts", default="single,cluster", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.layouts = args.layouts.split(",")
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown or len(set(args.layouts)) != len(args.layouts):
        p.error(f"--layouts: each of {', '.join(LAYOUTS)} at most once, not {unknown or args.layouts}")
    if args.faces < args.per_subject * args.writers * args.enroll_rounds:
        p.error("--faces must be at least --per-subject x --writers x --enroll-rounds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.machine import CpuWatch, machine_info

    watch = CpuWatch()
    measured = run(args)
    load = watch.result()
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    report = {
        "command": f".venv/bin/python bench/cluster.py {arguments}".strip(),
        "faces": args.faces, "dim": args.dim, "per_subject": args.per_subject, "writers": args.writers,
        "batch": args.batch, "enroll_rounds": args.enroll_rounds, "probe_rounds": args.probe_rounds,
        "probes": args.probes, "k": args.k, "blas_threads": args.blas_threads, "wall_s": load["wall_s"],
        "machine": machine_info(1), "load": load, **measured,
    }  # fmt: skip
    _print(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
