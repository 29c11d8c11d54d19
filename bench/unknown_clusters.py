"""Unknown-face clustering on LFW: our rule against an immich-style rule, and its cost per face.

    .venv/bin/python bench/unknown_clusters.py [--seeds 0 1 2] [--json OUT] [--write-model]

1. Every one of LFW's 13,233 photos through the service's face path (our MTCNN, the face nearest
   the centre, the model's template, ONNX Runtime; cached under ``.cache/megaface`` like
   ``sphereface calibrate``), fed to the clustering in a shuffled order (per seed), nobody
   enrolled. Scored against LFW's identities: pairwise precision and recall, BCubed precision,
   recall and F, clusters per identity (of the people with two or more photos), clusters.
2. Our rule (:mod:`service.unknowns.clustering`) at each calibrated threshold of the model, and
   an immich-style rule: incremental, DBSCAN-like, a face is a core face when at least
   ``min_faces`` faces seen so far (itself included) lie within the cosine distance ``max_distance``;
   a core face joins the cluster of its nearest clustered neighbour or starts one; other faces
   wait and, after the stream, join the cluster of their nearest clustered neighbour within the
   distance (one deferred pass) or stay alone. Run with immich's defaults (min 3 faces, distance
   0.5) and with the distance set to our far_1e-05 threshold.
3. The assignment cost per face at growing pool sizes, up to 1M pooled faces (synthetic unit
   vectors of the model's size: the cost depends on the size, not on who is in the pool).

It prints the tables; ``--write-model`` also writes the false-merge rates to the model folder
(``unknown_clusters.json``, which the service reports with each cluster listing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/, whose service.py would hide the package

from bench.machine import cpu_model  # noqa: E402
from service.unknowns.clustering import PoolView  # noqa: E402
from service.unknowns.pool import MEASURED_FILE  # noqa: E402

THRESHOLDS = ("far_1e-03", "far_1e-04", "far_1e-05", "far_1e-06")
POOL_SIZES = (1_000, 10_000, 100_000, 1_000_000)


def lfw_embeddings(model_dir: Path, lfw_dir: Path, cache: Path) -> tuple[np.ndarray, list[str]]:
    """Every LFW photo's embedding through the service's face path, and its identity."""
    from models.embedder import Embedder
    from training.evaluation.cache import ModelKey, detect_landmarks, embed_faces
    from training.evaluation.faces import load_face_set
    from training.evaluation.lfw_files import IMAGES_DIR

    faces = load_face_set(lfw_dir / IMAGES_DIR, "lfw-all", probes=True)
    points, _ = detect_landmarks(faces, cache, workers=2, progress=False)
    embedder = Embedder(model_dir, "cpu", batch_size=64, intra_op_threads=1)
    features = embed_faces(faces, points, ModelKey.of(model_dir), embedder, cache, workers=2, progress=False)
    return np.asarray(features, np.float32), list(faces.identities or [])


def our_clusters(vectors: np.ndarray, threshold: float) -> np.ndarray:
    """Cluster labels of our incremental rule, faces fed in the given order."""
    view = PoolView(vectors.shape[1], capacity=len(vectors))
    labels = np.empty(len(vectors), np.int64)
    for i, vector in enumerate(vectors):
        joined = view.assign(vector, threshold)
        label = int(joined) if joined is not None else i
        view.add(str(i), vector, str(label), float(i))
        labels[i] = label
    return labels


def immich_style_clusters(vectors: np.ndarray, max_distance: float, min_faces: int = 3) -> np.ndarray:
    """Cluster labels of the immich-style rule of the module docstring (-1: never clustered is
    given its own label at the end)."""
    threshold = 1.0 - max_distance
    labels = np.full(len(vectors), -1, np.int64)
    deferred = []
    for i in range(len(vectors)):
        scores = vectors[: i + 1] @ vectors[i]
        near = np.flatnonzero(scores >= threshold)
        if len(near) < min_faces:
            deferred.append(i)
            continue
        labels[i] = _nearest_label(scores, near, labels, default=i)
    for i in deferred:
        scores = vectors @ vectors[i]
        near = np.flatnonzero(scores >= threshold)
        labels[i] = _nearest_label(scores, near, labels, default=-1)
    alone = np.flatnonzero(labels < 0)
    labels[alone] = len(vectors) + alone
    return labels


def _nearest_label(scores: np.ndarray, near: np.ndarray, labels: np.ndarray, default: int) -> int:
    clustered = near[labels[near] >= 0]
    if clustered.size == 0:
        return default
    return int(labels[clustered[np.argmax(scores[clustered])]])


def cluster_scores(labels: np.ndarray, identities: np.ndarray) -> dict[str, float]:
    """Pairwise precision/recall, BCubed precision/recall/F, clusters per identity."""
    _, cluster = np.unique(labels, return_inverse=True)
    _, person = np.unique(identities, return_inverse=True)
    joint = np.zeros((cluster.max() + 1, person.max() + 1), np.int64)
    np.add.at(joint, (cluster, person), 1)
    cluster_size, person_size = joint.sum(axis=1), joint.sum(axis=0)

    def pairs(counts: np.ndarray) -> float:
        counts = counts.astype(np.float64)
        return float((counts * (counts - 1) / 2).sum())

    together, same_cluster, same_person = pairs(joint.ravel()), pairs(cluster_size), pairs(person_size)
    cell = joint[cluster, person].astype(np.float64)
    b_precision = float(np.mean(cell / cluster_size[cluster]))
    b_recall = float(np.mean(cell / person_size[person]))
    several = person_size >= 2
    grouped = cluster_size >= 2
    mixed = (joint[grouped] > 0).sum(axis=1) > 1
    return {
        "pairwise_precision": together / same_cluster if same_cluster else 1.0,
        "pairwise_recall": together / same_person,
        "bcubed_precision": b_precision,
        "bcubed_recall": b_recall,
        "bcubed_f": 2 * b_precision * b_recall / (b_precision + b_recall),
        "clusters_per_identity": float((joint[:, several] > 0).sum(axis=0).mean()),
        "clusters": int(len(cluster_size)),
        "clusters_of_2_or_more": int(grouped.sum()),
        "mixed_clusters": float(mixed.mean()) if mixed.size else 0.0,
    }


def rules(thresholds: dict[str, float]) -> dict[str, tuple]:
    """Every rule measured: name -> (function, argument)."""
    chosen = {
        f"ours, {name} (cos >= {value:.4f})": (our_clusters, value) for name, value in thresholds.items()
    }
    chosen["immich-style, min 3, distance 0.5 (cos >= 0.5)"] = (immich_style_clusters, 0.5)
    same = 1.0 - thresholds["far_1e-05"]
    chosen[f"immich-style, min 3, distance {same:.4f} (our far_1e-05)"] = (immich_style_clusters, same)
    return chosen


def quality_table(vectors: np.ndarray, identities: list[str], thresholds: dict[str, float], seeds) -> dict:
    """Every rule on every shuffled order: per rule, per metric, the values over seeds."""
    truth = np.asarray(identities)
    results: dict[str, dict[str, list[float]]] = {}
    for name, (cluster, argument) in rules(thresholds).items():
        for seed in seeds:
            order = np.random.default_rng(seed).permutation(len(vectors))
            started = time.perf_counter()
            labels = cluster(vectors[order], argument)
            scores = cluster_scores(labels, truth[order])
            scores["seconds"] = time.perf_counter() - started
            for metric, value in scores.items():
                results.setdefault(name, {}).setdefault(metric, []).append(value)
            print(f"  {name} seed {seed}: {scores}", file=sys.stderr, flush=True)
    return results


def assignment_cost(dim: int, threshold: float, repeats: int, sizes=POOL_SIZES) -> dict[int, list[float]]:
    """Milliseconds of one assignment at each pool size (synthetic unit vectors in clusters of
    ten; each query is one of the pooled faces, so its cluster is scored too). One untimed
    assignment first."""
    rng = np.random.default_rng(0)
    cost = {}
    for size in sizes:
        view = PoolView(dim, capacity=size)
        block = rng.standard_normal((size, dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        for i in range(size):
            view.add(f"f{i}", block[i], f"c{i // 10}", float(i))
        del block
        view.assign(view.vectors[0].copy(), threshold)
        times = []
        for _ in range(repeats):
            query = view.vectors[rng.integers(size)].copy()
            started = time.perf_counter()
            view.assign(query, threshold)
            times.append(1000 * (time.perf_counter() - started))
        cost[size] = times
        print(f"  pool {size:,}: median {np.median(times):.2f} ms", file=sys.stderr, flush=True)
        del view
    return cost


def spread(values: list[float], scale: float = 1.0, digits: int = 4) -> str:
    """min / median / max (one value when they agree to the digits shown)."""
    low, mid, high = (scale * v for v in (min(values), float(np.median(values)), max(values)))
    if f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def print_tables(quality: dict, cost: dict, seeds, dim: int) -> None:
    columns = ("pairwise_precision", "pairwise_recall", "bcubed_f", "mixed_clusters")
    columns += ("clusters_per_identity", "clusters")
    print(f"\nLFW, 13,233 photos, 5,749 people, shuffled orders (seeds {', '.join(map(str, seeds))}): ")
    print("median (min-max) over the orders\n")
    print(
        "| rule | pairwise precision | pairwise recall | BCubed F | clusters of 2+ faces holding 2+ people "
        "| clusters per identity | clusters |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, metrics in quality.items():
        cells = [spread(metrics[c], digits=0 if c == "clusters" else 4) for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print_cost(cost, dim)


def print_cost(cost: dict, dim: int) -> None:
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or f"default ({os.cpu_count()})"
    print(f"\nAssignment cost per face ({dim}-d float32, {cpu_model()}, BLAS threads {threads}):")
    print("median (min-max) ms\n")
    print("| pooled faces | ms per face | pool memory (vectors) |")
    print("|---|---|---|")
    for size, times in cost.items():
        print(f"| {size:,} | {spread(times, digits=2)} | {size * dim * 4 / 2**20:,.0f} MiB |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "dlib_resnet_v1")
    parser.add_argument("--lfw", type=Path, default=ROOT.parent / "shared" / "data" / "lfw")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "megaface")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=15, help="assignments timed per pool size")
    parser.add_argument("--max-pool", type=int, default=POOL_SIZES[-1])
    parser.add_argument("--cost-only", action="store_true", help="only the assignment cost (no LFW)")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument(
        "--write-model", action="store_true", help=f"write {MEASURED_FILE} to the model folder"
    )
    args = parser.parse_args(argv)
    from models.manifest import load_manifest

    manifest = load_manifest(args.model)
    thresholds = {name: manifest.thresholds[name].value for name in THRESHOLDS if name in manifest.thresholds}
    sizes = [s for s in POOL_SIZES if s <= args.max_pool]
    if args.cost_only:
        cost = assignment_cost(manifest.output_size, thresholds["far_1e-05"], args.repeats, sizes)
        print_cost(cost, manifest.output_size)
        return 0
    vectors, identities = lfw_embeddings(args.model, args.lfw, args.cache)
    quality = quality_table(vectors, identities, thresholds, args.seeds)
    cost = assignment_cost(vectors.shape[1], thresholds["far_1e-05"], args.repeats, sizes)
    print_tables(quality, cost, args.seeds, vectors.shape[1])
    result = {
        "model": manifest.model_id,
        "photos": len(vectors),
        "seeds": args.seeds,
        "cpu": cpu_model(),
        "thresholds": thresholds,
        "quality": quality,
        "assignment_ms": {str(k): v for k, v in cost.items()},
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.write_model:
        write_model_file(args.model, manifest.model_id, thresholds, quality, len(vectors), args.seeds)
    return 0


def write_model_file(
    model_dir: Path, model_id: str, thresholds: dict, quality: dict, photos: int, seeds
) -> None:
    """The false-merge rate (1 - pairwise precision, median over the orders) of each threshold."""
    rates, mixed = {}, {}
    for name, value in thresholds.items():
        metrics = quality[f"ours, {name} (cos >= {value:.4f})"]
        rates[name] = round(1.0 - float(np.median(metrics["pairwise_precision"])), 6)
        mixed[name] = round(float(np.median(metrics["mixed_clusters"])), 6)
    (model_dir / MEASURED_FILE).write_text(
        json.dumps(
            {
                "model": model_id,
                "measured_on": f"LFW, all {photos} photos, nobody enrolled, shuffled orders (seeds {seeds})",
                "command": "python bench/unknown_clusters.py --write-model",
                "false_merge_rate": rates,
                "mixed_cluster_rate": mixed,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
