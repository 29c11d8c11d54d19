"""What the trainer's own step costs on CPU against a bare PyTorch loop: same network, batch and data.

One process builds the run as ``sphereface train`` would (``training.trainer._set_up_run`` on the
config, default the loss table's A-Softmax m = 4 run: SphereFace-4, batch 64, celeba_faces +
celeba_small; LFW check off, run folder in a temporary directory) and a copy of its network and
head with the same weights. Three ways to train one step are timed, interleaved (round r runs
each in turn for ``--steps`` steps), on images/s:

* ``bare``: ``head(net(x), y, step).loss``, ``zero_grad``, ``backward``, ``SGD.step`` (lr,
  momentum and weight decay of the config, one parameter group), nothing else;
* ``trainer step``: the trainer's ``_train_step`` (autocast context, step hooks with the
  classifier renormalisation, the optimiser's parameter groups, the lr schedule, the logged
  values) and ``IntervalStats.add``, as its loop runs them;
* ``trainer step + loader``: the same, with each batch drawn from the run's own loader
  (``DeviceResidentLoader`` on CPU: index, flip, normalise) instead of given.

``bare`` and ``trainer step`` get the same batches (drawn once from the run's loader before
timing). Every figure is the median of ``--rounds`` rounds with the smallest and largest round
beside it, and its ratio to ``bare`` in the same round. Usage (``make bench-train-overhead``)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/train_overhead.py --json docs/results/bench_train_overhead.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.machine import CpuWatch, machine_info  # noqa: E402
from training.evaluation.report import write_json  # noqa: E402

DEFAULT_CONFIG = REPO / "training" / "configs" / "celeba_more" / "sf4_asoftmax_m4.toml"
VARIANTS = ("bare", "trainer step", "trainer step + loader")


class _Bare:
    """The bare loop: a copy of the run's network and head with plain SGD."""

    def __init__(self, run: Any) -> None:
        config = run.config
        self.model = copy.deepcopy(run.model)
        self.model.train()
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )

    def step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> None:
        loss = self.model.head(self.model.net(images), labels, step=step).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


class _Trainer:
    """The trainer's own step on given batches, or on the batches of its own loader."""

    def __init__(self, run: Any, own_loader: bool) -> None:
        from training.distributed import IntervalStats

        self.run = run
        self.stats = IntervalStats()
        self.batches = iter(run.loader) if own_loader else None
        run.trained.train()

    def step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> None:
        from training.trainer import _train_step

        if self.batches is not None:
            images, labels = next(self.batches)
        self.stats.add(_train_step(self.run, step, images, labels), len(labels))


def _set_up(config_path: Path, overrides: list[str], out_dir: Path) -> Any:
    from training.config import load_config
    from training.distributed import DistributedContext
    from training.trainer import _set_up_run

    config = load_config(config_path, [*overrides, 'lfw=""', f"out_dir={out_dir}", "device=cpu"])
    return _set_up_run(config, DistributedContext(device=torch.device("cpu")), resume=False)


def _time_round(contender: Any, first_step: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for i, (images, labels) in enumerate(batches):
        contender.step(first_step + i, images, labels)
    return time.perf_counter() - start


def _spread(values: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max())}


def _summary(images_per_s: np.ndarray, bare: np.ndarray) -> dict[str, Any]:
    return {
        "images_per_s": _spread(images_per_s),
        "per_round_images_per_s": [round(float(v), 2) for v in images_per_s],
        "ratio_to_bare": _spread(images_per_s / bare),
    }


def bench(run: Any, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Images/s of each variant over ``rounds`` interleaved rounds of ``steps`` steps."""
    batch_iter = iter(run.loader)
    batches = [next(batch_iter) for _ in range(steps)]
    contenders = {
        "bare": _Bare(run),
        "trainer step": _Trainer(run, own_loader=False),
        "trainer step + loader": _Trainer(run, own_loader=True),
    }
    for contender in contenders.values():
        _time_round(contender, 0, batches[:warmup])
    images = sum(len(labels) for _, labels in batches)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # who goes first rotates
        for name in order:
            seconds = _time_round(contenders[name], warmup + r * steps, batches)
            rates[name].append(images / seconds)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in VARIANTS),
              file=sys.stderr)  # fmt: skip
    bare = np.array(rates["bare"])
    return {name: _summary(np.array(rates[name]), bare) for name in VARIANTS}


def _print(results: dict[str, Any], run: Any, args: argparse.Namespace) -> None:
    config = run.config
    print(f"\n{config.network} + {config.head} {config.head_options}, batch {config.batch_size}, "
          f"{args.threads} thread(s): images/s, median of {args.rounds} interleaved rounds "
          f"of {args.steps} steps (min-max); x bare")  # fmt: skip
    for name, s in results.items():
        ips, ratio = s["images_per_s"], s["ratio_to_bare"]
        print(f"  {name:24s} {ips['median']:7.1f} ({ips['min']:.1f}-{ips['max']:.1f})"
              f"   x{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")  # fmt: skip


def _report(
    run: Any, args: argparse.Namespace, argv: list[str] | None, load: dict[str, float],
    results: dict[str, Any],
) -> dict[str, Any]:
    config, data = run.config, run.data
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    return {
        "command": f"OMP_NUM_THREADS=1 .venv/bin/python bench/train_overhead.py {arguments}".strip(),
        "config": str(args.config.resolve().relative_to(REPO)),
        "network": config.network,
        "head": config.head,
        "head_options": config.head_options,
        "batch_size": config.batch_size,
        "num_images": data.num_images,
        "num_classes": data.num_classes,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup_steps": args.warmup,
        "machine": machine_info(args.threads),
        "load": load,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = _set_up(args.config, args.overrides, Path(tmp))
        watch = CpuWatch()
        results = bench(run, args.rounds, args.steps, args.warmup)
        load = watch.result()
    _print(results, run, args)
    if args.json:
        write_json(args.json, _report(run, args, argv, load, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
