"""The MegaFace protocol at 1,000,000 distractors on this machine: time and peak memory.

Embedding a million augmented faces takes about 2.8 hours per model on a 2-core CPU (about 100
faces/s, measured here), so this benchmark builds the million in three parts and says so in its
output:

1. the 10,318 real distractors of the local protocol (embedded photos);
2. ``--augmented`` embedded augmented copies of them (``--augment-to``; see aug-v1 in
   training/evaluation/megaface.py): real forward passes, timed, which gives the embedding rate;
3. the rest as *feature-space* variants: a random vector of parts 1-2 plus Gaussian noise, scaled
   so that its cosine to that vector is about ``--variant-cos``, L2-normalised. They exercise the
   search and its memory exactly like embeddings (same size, same distribution of norms), but they
   are not faces: identification numbers at 1M from this set say nothing about a model.

Then it runs ``sphereface evaluate megaface --protocol local`` with all of it in a fresh process
and records the wall time and the peak resident memory of that process (``/proc`` via
``resource``), next to the embedding rate.

    .venv/bin/python bench/megaface_1m.py --model models/sphereface_celeba \\
        --json docs/results/megaface_1m.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_variants(sources: list[np.ndarray], count: int, cos: float, seed: int, out: Path) -> float:
    """Write ``count`` feature-space variants of rows of ``sources`` to ``out`` (float32 .npy)."""
    rng = np.random.default_rng(seed)
    sizes = np.cumsum([0] + [len(s) for s in sources])
    dim = sources[0].shape[1]
    # For a unit vector a and noise e ~ N(0, s^2 I_D): cos(a, a + e) ~ 1 / sqrt(1 + s^2 D).
    sigma = float(np.sqrt((1.0 / cos**2 - 1.0) / dim))
    array = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(count, dim))
    started = time.perf_counter()
    for a in range(0, count, 65_536):
        b = min(count, a + 65_536)
        pick = np.sort(rng.integers(0, sizes[-1], b - a))
        part = np.searchsorted(sizes, pick, side="right") - 1
        base = np.empty((b - a, dim), np.float32)
        for p in np.unique(part):
            sel = part == p
            base[sel] = sources[p][pick[sel] - sizes[p]]
        noisy = base + rng.normal(0.0, sigma, size=base.shape).astype(np.float32)
        array[a:b] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
    array.flush()
    return time.perf_counter() - started


def run_timed(command: list[str]) -> dict[str, float]:
    """Run ``command`` in the repository; its wall time (s) and the children's peak RSS (KiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"wall_s": wall, "peak_rss_kib": max(before, peak)}


def summary(
    args: argparse.Namespace,
    real_photos: int,
    variants: int,
    embed_run: dict[str, Any],
    run: dict[str, Any],
    measured: dict[str, float],
) -> dict[str, Any]:
    """The benchmark's JSON: how the million was made, the run's time and memory, its results."""
    augment_seconds = embed_run["timing_s"]["faces_augmented"]
    if augment_seconds < 1.0:  # the augmented faces came from the cache: no rate measured here
        augment_seconds = 0.0
    return {
        "what": "sphereface evaluate megaface --protocol local at 1,000,000 distractors on this machine",
        "distractors": {
            "real_photos": real_photos,
            "augmented_embedded": args.augmented,
            "feature_space_variants": variants,
            "variant_rule": f"random embedded distractor + Gaussian noise, cos to it ~{args.variant_cos}, "
            "L2-normalised (not faces: for time and memory only)",
        },
        "model_id": run["model_id"],
        "probes": run["probes"]["images"],
        "sizes": run["sizes"],
        "chunk_mb": args.chunk_mb,
        "run_wall_s": measured["wall_s"],
        "run_timing_s": run["timing_s"],
        "run_peak_rss_gib": run["peak_rss_gib"],
        "children_peak_rss_gib": measured["peak_rss_kib"] / 2**20,
        "augmented_faces_per_s": args.augmented / augment_seconds if augment_seconds > 0 else None,
        "projected_hours_to_embed_1m_augmented": (
            args.distractors / (args.augmented / augment_seconds) / 3600 if augment_seconds > 0 else None
        ),
        "identification_raw": {k: v["rank1"] for k, v in run["results"]["raw"]["identification"].items()},
        "tar_at_far_1m": run["results"]["raw"]["verification"][str(run["sizes"][-1])]["tar_at_far"],
        "cpus": run["host"]["cpus"],
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/sphereface_celeba")
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--distractors", type=int, default=1_000_000)
    ap.add_argument(
        "--augmented", type=int, default=60_000, help="embedded augmented faces (real forward passes)"
    )
    ap.add_argument("--variant-cos", type=float, default=0.8)
    ap.add_argument("--chunk-mb", type=float, default=256.0)
    ap.add_argument("--work", default="runs/megaface_1m")
    ap.add_argument("--json", dest="json_out", default="docs/results/megaface_1m.json")
    return ap.parse_args()


def main() -> int:
    args = parse_args()

    from training.evaluation.cache import ModelKey, default_cache_dir
    from training.evaluation.megaface import local_protocol

    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "models.cli", "evaluate", "megaface", "--model", args.model]
    cli += ["--protocol", "local", "--data", args.data, "--no-progress"]

    # 1-2: real and augmented embeddings (cached; timed in their own process).
    _, distractors = local_protocol(args.data)
    real_total = len(distractors) + args.augmented
    started = time.perf_counter()
    embed_cmd = [*cli, "--augment-to", str(real_total), "--sizes", "10", "--json", str(work / "embed.json")]
    subprocess.run(embed_cmd, check=True, cwd=ROOT)
    embed_run = json.loads((work / "embed.json").read_text())
    print(f"real + augmented faces ready in {time.perf_counter() - started:.0f} s")

    # 3: feature-space variants from the cached embeddings.
    model = ModelKey.of(ROOT / args.model)
    features = default_cache_dir() / "features" / model.folder
    sources = [np.load(p, mmap_mode="r") for p in sorted(features.glob("local-distractors*/features.npy"))]
    variants = args.distractors - real_total
    extra = work / f"variants_{variants}.npy"
    variant_seconds = build_variants(sources, variants, args.variant_cos, 1, extra)
    print(f"{variants:,} feature-space variants from {sum(len(s) for s in sources):,} embeddings "
          f"in {variant_seconds:.0f} s")  # fmt: skip

    # The run at 1M, in a fresh process: wall time and peak RSS.
    run_cmd = [*cli, "--augment-to", str(real_total), "--extra-features", str(extra)]
    run_cmd += ["--chunk-mb", str(args.chunk_mb), "--json", str(work / "run_1m.json")]
    measured = run_timed(run_cmd)
    run = json.loads((work / "run_1m.json").read_text())
    result = summary(args, len(distractors), variants, embed_run, run, measured)
    out = ROOT / args.json_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("run_wall_s", "run_peak_rss_gib", "augmented_faces_per_s")}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
