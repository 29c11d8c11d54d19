"""The processes of a running ``sphereface serve`` as /proc shows them: which are left after a
kill, in what state, and whether anything still listens on a port (Linux only).

Used by the fault suite (``bench/reliability_faults.py``) and ``tests/test_supervision.py``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from service.serve_process import Service


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``Z`` for a zombie), None when there is no such process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        pass
    return None


def running(pid: int) -> bool:
    """True while ``pid`` runs code (a zombie has exited: it holds no socket and runs nothing)."""
    return process_state(pid) not in (None, "Z")


def descendants(root: int) -> set[int]:
    """Every process below ``root`` in the process tree (children, their children, ...)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found


def listening(port: int) -> bool:
    """True when a TCP socket listens on ``port`` (IPv4, this network namespace)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            return True
    return False


def wait_for(condition: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    """Poll ``condition()`` until it is true or ``timeout`` seconds have passed; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def kill_all(pids: set[int]) -> None:
    """SIGKILL whatever of ``pids`` still runs (cleanup after a failed run)."""
    for pid in pids:
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def workers_started(service: Service) -> int:
    """How many workers have logged the end of their startup (model loaded, gallery connected)."""
    return service.log.read_text(errors="replace").count("Application startup complete")


def worker_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settled_rss(service: Service, idle_s: float = 1.5, within_s: float = 4.5) -> float:
    """The service's RSS in MiB once it has been idle ``idle_s`` seconds (a worker gives memory
    back after 1 s without face work) and holds within 2 MiB over 0.3 s (waiting ``within_s`` at
    most)."""
    time.sleep(idle_s)
    deadline, rss = time.monotonic() + within_s, service.rss_mib()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        rss, before = service.rss_mib(), rss
        if abs(rss - before) < 2:
            break
    return rss
