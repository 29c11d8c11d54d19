"""The machine a benchmark runs on: what it is, how busy others keep it, our own memory."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from bench.facenet_env import FNP_VERSION


def rss_bytes() -> int:
    """Resident set size of this process (from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class CpuWatch:
    """CPU time used on the machine by processes other than this one and its reaped children.

    Other work on a 2-core machine (tests of other sessions, say) slows every number; this says
    how much there was: core-seconds used by others over the wall time of a part.
    """

    def __init__(self) -> None:
        self.wall0 = time.perf_counter()
        self.busy0 = self._busy()
        self.own0 = self._own()

    @staticmethod
    def _busy() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def result(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall0
        others = max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0))
        return {"wall_s": wall, "other_processes_cpu_s": others, "other_processes_cores": others / wall}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    flags: list[str] = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "unknown":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16") if f in have]
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    import fastapi
    import redis

    return {
        "cpu_model": cpu,
        "cpu_flags": flags,
        "logical_cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": mem / 2**30,
        "threads": threads,
        "torch_num_threads": threads,
        "ort_intra_op_threads": threads,
        "numpy_blas_threads_env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
            if k in os.environ
        },
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "redis_py": redis.__version__,
        "fastapi": fastapi.__version__,
        "facenet_pytorch": FNP_VERSION,
        "loadavg_start": list(os.getloadavg()),
    }
