"""Giving a worker's freed memory back to the system once its face work goes quiet.

Decoding, detection and embedding allocate and free tens to hundreds of MB per request. glibc's
malloc keeps freed memory in its arenas (one per thread that allocated) for reuse instead of
returning it, so a worker's resident size grows to the most it ever needed at once and stays
there while idle. :class:`IdleTrim` calls glibc's ``malloc_trim(0)`` once the face work has
been idle for :data:`IDLE_S` seconds: not after every request, where giving the memory back and
faulting it in again costs CPU (measured 9 to 20 ms per trim and about 1.5x the CPU time per
photo), but once a burst is over.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: Seconds without face work after which freed memory is given back.
IDLE_S = 1.0
#: malloc arenas per worker. glibc makes up to 8 per core, one for each thread that allocates
#: while the others are busy (request threads, photo threads, the detector's and ONNX Runtime's),
#: and each keeps fragments a trim cannot free, so a worker's size stays well above its start
#: after many photos; with 2 it comes back near it, at the same CPU time per photo
#: (docs/results/face-path.md).
MALLOC_ARENAS = 2
#: ``mallopt`` parameter number of ``M_ARENA_MAX`` (glibc's malloc.h).
_M_ARENA_MAX = -8


def _load_libc():
    """glibc, or None elsewhere (musl has no ``malloc_trim``; macOS no ``mallopt``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        libc.mallopt  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()
_malloc_trim = _libc.malloc_trim if _libc is not None else None


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``count``, unless ``MALLOC_ARENA_MAX`` is set in the
    environment (the operator's choice wins). Takes effect only before other threads allocate:
    call it before the model is loaded. Returns whether the cap was set."""
    if _libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(_libc.mallopt(_M_ARENA_MAX, count))


def trim() -> bool:
    """Give freed heap memory of every malloc arena back to the system now; False where glibc's
    ``malloc_trim`` is not available."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class IdleTrim:
    """Calls :func:`trim` once the work it is told about (:meth:`working`) has been idle for
    ``idle_s`` seconds, on a daemon thread of its own started on first use; once per burst."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self.trims = 0
        self._busy = 0
        self._dirty = False
        self._last = 0.0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextmanager
    def working(self) -> Iterator[None]:
        """Wrap a piece of memory-hungry work (any thread)."""
        with self._cond:
            self._busy += 1
            if self._thread is None and _malloc_trim is not None:
                self._thread = threading.Thread(target=self._run, name="idle-trim", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._dirty = True
                self._last = time.monotonic()
                self._cond.notify_all()

    def _due_in(self) -> float | None:
        """Seconds until a trim is due (0: now), or None while nothing is to be trimmed."""
        if not self._dirty or self._busy:
            return None
        return max(0.0, self._last + self.idle_s - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._due_in()
                while due is None or due > 0:
                    self._cond.wait(due)
                    due = self._due_in()
                self._dirty = False
            started = time.perf_counter()
            trim()
            self.trims += 1
            log.debug("gave freed memory back in %.1f ms", 1e3 * (time.perf_counter() - started))


#: The worker's one trimmer (each worker is a process of its own).
IDLE_TRIM = IdleTrim()
