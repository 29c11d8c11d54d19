"""The trainer's processes: torchrun's context, every process's random state, and the sums of a
log interval averaged over the processes.

Under ``torchrun`` each process trains on its share of every batch (DistributedDataParallel; NCCL
on GPUs, Gloo on CPU); the functions here are collective where they say so (every rank must
call them). In a single process they do no communication.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.config import ConfigError


@dataclass
class DistributedContext:
    """This process's place among the torchrun processes (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str) -> DistributedContext:
    """The context of this process, joining torchrun's process group when ``WORLD_SIZE`` > 1.

    ``device_choice`` is the config's ``device`` (``auto``, ``cpu`` or ``cuda``).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but torch sees no CUDA device")
    if world_size == 1:
        return DistributedContext(device=torch.device("cuda" if use_cuda else "cpu"))
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return DistributedContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def seed_everything(seed: int) -> None:
    """Seed python's and torch's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)


def all_ranks(flag: bool, ctx: DistributedContext) -> bool:
    """True only when ``flag`` is true on every process (each rank must take the same decision)."""
    if ctx.world_size == 1:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def gather_objects(value: Any, ctx: DistributedContext) -> list[Any]:
    if ctx.world_size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def process_state(loader: Any, device: torch.device) -> dict[str, Any]:
    """This process's RNGs (torch, CUDA, python) and loader position, checkpointable.

    (numpy's global RNG is not used anywhere in training: every numpy draw has its own seeded
    generator.)
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "loader": loader.state_dict(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_process_state(state: dict[str, Any], loader: Any, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    loader.load_state_dict(state["loader"])


def gather_process_states(loader: Any, ctx: DistributedContext) -> list[dict[str, Any]]:
    """Every rank's :func:`process_state`, in rank order (collective: every rank must call it)."""
    return gather_objects(process_state(loader, ctx.device), ctx)


def weights_checksum(module: nn.Module) -> str:
    """A hash of every parameter's bytes (equal on every rank when DDP keeps them in step)."""
    digest = hashlib.sha256()
    for name, param in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class IntervalStats:
    """Per-step values summed on the device between two log lines (one sync per interval).

    ``lambda`` is a python float of the schedule and is summed on the host: no host-to-device
    copy per step.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.host_sums: dict[str, float] = {}
        self.steps = 0
        self.images = 0
        self.started = time.perf_counter()

    def add(self, values: dict[str, Any], images: int) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float()
                self.sums[key] = self.sums[key] + value if key in self.sums else value.clone()
            else:
                self.host_sums[key] = self.host_sums.get(key, 0.0) + float(value)
        self.steps += 1
        self.images += images

    def means(self, ctx: DistributedContext) -> dict[str, float]:
        """Interval means; under torchrun the device sums are averaged over all processes."""
        keys = sorted(self.sums)
        out = {k: v / self.steps for k, v in self.host_sums.items()}
        if not keys:
            return out
        stacked = torch.stack([self.sums[k] for k in keys])
        if ctx.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(stacked)
            stacked = stacked / ctx.world_size
        values = (stacked / self.steps).tolist()  # the one device sync of the interval
        out.update(zip(keys, values, strict=True))
        return out
