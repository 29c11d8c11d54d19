"""Back-pressure: a bounded number of face-path requests at work per worker, a bounded queue,
503 ``overloaded`` with ``Retry-After`` beyond it; and a bound on the pixels decoded at once.

Without them, latency grew without bound under load (8 clients on 2 cores: verify p50 1.46 s)
and 8 large photos decoded in parallel took 3.5-4.5 GiB.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from service.errors import ServiceError, error_response

log = logging.getLogger(__name__)

#: The routes that detect and embed faces: the expensive ones (POST only).
FACE_PATHS = re.compile(r"^/v1/(verify|embed|identify|enroll|subjects/[^/]+/faces)$")


class OverloadedError(ServiceError):
    code = "overloaded"


class Admission:
    """ASGI middleware: at most ``limit`` face-path requests at work, at most ``queue`` waiting
    (each for at most ``wait`` seconds); the others get 503 ``overloaded`` with ``Retry-After`` at
    once, before their body is read. Other routes (gallery reads, health) are never held back."""

    def __init__(self, app, *, limit: int, queue: int, wait: float, retry_after: int = 1) -> None:
        self.app = app
        self.limit, self.queue, self.wait, self.retry_after = limit, queue, wait, retry_after
        self.active = 0
        self.waiting = 0
        self.shed = 0
        self._slots: asyncio.Semaphore | None = None

    def _is_face_work(self, scope) -> bool:
        return scope["type"] == "http" and scope["method"] == "POST" and bool(FACE_PATHS.match(scope["path"]))

    async def _refuse(self, scope, receive, send, why: str) -> None:
        self.shed += 1
        error = OverloadedError(f"the service is busy ({why}); try again in {self.retry_after} s")
        response = error_response(error, headers={"Retry-After": str(self.retry_after)})
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if not self._is_face_work(scope):
            return await self.app(scope, receive, send)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        if self._slots.locked() and self.waiting >= self.queue:
            return await self._refuse(
                scope, receive, send, f"{self.limit} requests at work, {self.queue} waiting"
            )
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=self.wait)
        except TimeoutError:
            return await self._refuse(scope, receive, send, f"no turn within {self.wait:g} s")
        finally:
            self.waiting -= 1
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            self._slots.release()


class PixelBudget:
    """At most ``budget`` pixels being decoded (and held as full-size RGB) at once per process.

    A photo over the whole budget still gets it alone. Waiting longer than ``wait`` seconds is
    503 ``overloaded``. When the last large decode of a burst ends, freed memory is handed back to
    the system (glibc ``malloc_trim``), so the worker's size returns to where it was.
    """

    def __init__(self, budget: int, wait: float = 30.0) -> None:
        self.budget, self.wait = budget, wait
        self.in_use = 0
        self._large_since_trim = False
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        want = min(pixels, self.budget)
        deadline = time.monotonic() + self.wait
        with self._cond:
            while self.in_use and self.in_use + want > self.budget:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise OverloadedError(
                        f"the service is decoding {self.in_use:,} pixels of other photos; try again shortly"
                    )
            self.in_use += want
            self._large_since_trim |= pixels >= LARGE_PHOTO_PIXELS
        try:
            yield
        finally:
            with self._cond:
                self.in_use -= want
                trim = self.in_use == 0 and self._large_since_trim
                if trim:
                    self._large_since_trim = False
                self._cond.notify_all()
            if trim:
                release_free_memory()


#: Photos from this size up leave enough freed memory behind to be worth a trim.
LARGE_PHOTO_PIXELS = 4_000_000


def release_free_memory() -> None:
    """Give freed heap memory back to the system (glibc only; elsewhere a no-op)."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def default_face_limit() -> int:
    """Face-path requests at work at once: one per core (the detector and embedder keep a core
    busy each), at least 2 so that one slow photo does not hold every other client back."""
    return max(2, os.cpu_count() or 2)
