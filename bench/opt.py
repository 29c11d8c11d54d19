"""What OPT and compressive MHE cost per training step against plain training (CoMHE Table E.5).

Each variant is a config of ``training/configs/opt/cifar`` (CNN-6 at 32 channels, batch 128, the
runs of docs/results/opt-claims.md), plus group CoMHE. One process builds every variant as its run would
(``training.cifar.build_training``) and times the run's own step (``training.cifar.optimiser_step``:
forward, regularisers, backward, OPT's and SGD's updates) on one fixed batch, interleaved: round r
times every variant in turn. Every figure is the median of ``--rounds`` rounds with the smallest
and largest round beside it, and its ratio to the baseline in the same round.

There is no cost at inference: the exported network is the plain one (docs/reference/opt.md §1).

Usage::

    .venv/bin/python bench/opt.py --json docs/results/bench_opt.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.evaluation.report import write_json  # noqa: E402

CONFIGS = REPO / "training" / "configs" / "opt" / "cifar"
#: (label, config, overrides): the baseline first.
VARIANTS: tuple[tuple[str, str, list[str]], ...] = (
    ("baseline", "cnn6_baseline", []),
    ("MHE", "cnn6_mhe", []),
    ("HS-MHE", "cnn6_hs_mhe", []),
    ("RP-CoMHE", "cnn6_rp_comhe", []),
    ("AP-CoMHE (alternating)", "cnn6_ap_comhe", []),
    ("G-CoMHE", "cnn6_rp_comhe", ['hidden_mhe_projection="group"', "hidden_mhe_options={}"]),
    ("OPT-GS", "cnn6_gs", []),
    ("OPT-HR", "cnn6_hr", []),
    ("OPT-LS", "cnn6_ls", []),
    ("OPT-CP", "cnn6_cp", []),
    ("OPT-OGD", "cnn6_ogd", []),
    ("OPT-OR", "cnn6_or", []),
    ("S-OPT-CP", "cnn6_sopt_cp", []),
)


def _variant(config_name: str, overrides: list[str]) -> tuple[Any, ...]:
    from training.cifar import build_training, load_cifar_config

    config = load_cifar_config(CONFIGS / f"{config_name}.toml", overrides)
    torch.manual_seed(config.seed)
    return (config, *build_training(config))


def _step_seconds(variant: tuple[Any, ...], step: int, x: torch.Tensor, y: torch.Tensor) -> float:
    from training.cifar import optimiser_step

    _, model, optimiser, hooks = variant
    start = time.perf_counter()
    optimiser_step(model, optimiser, step, x, y, hooks)
    return time.perf_counter() - start


def _summary(per_round: np.ndarray, base: np.ndarray) -> dict[str, Any]:
    ratio = per_round / base
    return {
        "median_ms": float(np.median(per_round)),
        "min_ms": float(per_round.min()),
        "max_ms": float(per_round.max()),
        "ratio_to_baseline": {
            "median": float(np.median(ratio)),
            "min": float(ratio.min()),
            "max": float(ratio.max()),
        },
    }


def bench(rounds: int, repeats: int) -> dict[str, Any]:
    variants = {label: _variant(name, overrides) for label, name, overrides in VARIANTS}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (128,), generator=generator)
    for variant in variants.values():  # warm-up (and the alternating AP fit's first draw)
        _step_seconds(variant, 0, x, y)
    times: dict[str, list[float]] = {label: [] for label in variants}
    for r in range(rounds):
        for label, variant in variants.items():
            samples = [_step_seconds(variant, 1 + r * repeats + i, x, y) for i in range(repeats)]
            times[label].append(1e3 * float(np.median(samples)))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    base = np.array(times["baseline"])
    return {label: _summary(np.array(t), base) for label, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = bench(args.rounds, args.repeats)
    print(f"\nCNN-6 training step, batch 128 (median of {args.rounds} interleaved rounds, ms; x baseline)")
    for label, s in results.items():
        r = s["ratio_to_baseline"]
        print(
            f"  {label:24s} {s['median_ms']:8.1f}  ({s['min_ms']:.1f}-{s['max_ms']:.1f})"
            f"   x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
        )
    if args.json:
        write_json(args.json, {"threads": args.threads, "rounds": args.rounds, "repeats": args.repeats,
                               "host": platform.node(), "processor": platform.processor(),
                               "results": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
