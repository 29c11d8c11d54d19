"""What the GPU check's sections share: the run's sizes, its state, a table row, and timing helpers."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu_pack import Pack


@dataclass(frozen=True)
class Sizes:
    """How big each part of the check is: ``FULL`` for a GPU, ``TINY`` for the CPU (tests)."""

    network: str
    #: FC1's size (None: the network's own, 512 for SphereFace); small on the CPU to keep checkpoints small.
    embedding_size: int | None
    train_batch: int
    train_steps: int
    throughput_batches: tuple[int, ...]
    rounds: int
    round_steps: int
    warmup: int
    loader_workers: int
    inference_batch: int
    ort_cpu_batch: int
    megaface_distractors: int
    megaface_probes: int
    megaface_dim: int
    matmul_size: int
    #: Seconds each section may take at most (it is skipped when less than this is left).
    budgets: dict[str, float]
    #: Steps of the opt-in ``long`` section (the papers' recipe to convergence).
    long_steps: int = 0


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


FULL = Sizes(
    network="sphereface20", embedding_size=None, train_batch=256, train_steps=160,
    throughput_batches=(256, 512), rounds=3, round_steps=30, warmup=5, loader_workers=min(16, _usable_cpus()),
    inference_batch=256, ort_cpu_batch=64, megaface_distractors=1_000_000, megaface_probes=7381,
    megaface_dim=512, matmul_size=8192,
    budgets={
        "environment": 20, "train": 110, "export": 60, "throughput": 100, "floor": 10, "inference": 30,
        "megaface": 100, "compile": 90, "long": 240,
    },
    long_steps=8000,
)  # fmt: skip

TINY = Sizes(
    network="sphereface4", embedding_size=64, train_batch=8, train_steps=2, throughput_batches=(8,),
    rounds=1, round_steps=1, warmup=0, loader_workers=1, inference_batch=8, ort_cpu_batch=8,
    megaface_distractors=20_000, megaface_probes=200, megaface_dim=512, matmul_size=512,
    budgets={
        "environment": 10, "train": 40, "export": 40, "throughput": 30, "floor": 5, "inference": 10,
        "megaface": 20, "compile": 60, "long": 60,
    },
    long_steps=4,
)  # fmt: skip


@dataclass
class Row:
    """One line of the final table: what was checked, ``ok``/``FAIL``/``n/a``/``skipped``, the numbers."""

    label: str
    status: str
    result: str


class Skip(Exception):
    """A section that cannot run here (a section it needs did not run, or the machine lacks a part)."""


@dataclass
class Check:
    """The state of one run of the check, handed from section to section."""

    device: torch.device
    sizes: Sizes
    pack: Pack
    work: Path
    deadline: float  #: ``time.perf_counter()`` by which every section must have ended
    #: Where files that come back go (``--out``), beside the JSON and the table.
    out: Path | None = None
    prepared: Path | None = None
    #: ``key=value`` overrides of the ``long`` section's config (``--long-set``).
    long_set: list[str] = field(default_factory=list)
    #: What later sections read from earlier ones (checkpoint, model folder, measured rates).
    found: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        """Seconds left of the whole check."""
        return self.deadline - time.perf_counter()

    def need(self, key: str, section: str) -> Any:
        """``found[key]``, or :class:`Skip` naming the section that should have made it."""
        if key not in self.found:
            raise Skip(f"needs the {section} section, which did not finish")
        return self.found[key]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(values: list[float]) -> dict[str, float | int]:
    """Median, min and max of ``values`` (rates of interleaved rounds) and how many there were."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": len(values),
    }


def rate_text(summary: dict[str, float | int] | None) -> str:
    """``"12,345 (12,001-12,500)"`` images/s, or ``"-"``."""
    if not summary:
        return "-"
    if summary["rounds"] == 1:
        return f"{summary['median']:,.0f}"
    return f"{summary['median']:,.0f} ({summary['min']:,.0f}-{summary['max']:,.0f})"


def images_per_s(
    fn: Callable[[], Any], batch: int, device: torch.device, calls: int, rounds: int, until: float
) -> dict[str, float | int]:
    """Images/s of ``fn`` (one batch of ``batch`` per call): ``rounds`` timed rounds of ``calls``
    calls after one untimed call; rounds stop early at ``until`` (after the first)."""
    fn()
    synchronize(device)
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        rates.append(calls * batch / (time.perf_counter() - started))
        if time.perf_counter() > until:
            break
    return spread(rates)
