"""Back-pressure: a bounded number of face-path requests detecting and embedding at once per
worker (their *turns*), a bounded queue, 503 ``overloaded`` with ``Retry-After`` beyond it; and a
bound on the pixels decoded at once.

A request holds a turn for its detection and embedding only: never while its body is read, nor
while it waits on Redis (reading the subject, storing faces, searching the gallery). Otherwise a
stalled Redis would hold every turn and stall photo verification, which needs no Redis.

Without these bounds, latency grew without bound under load (8 clients on 2 cores: verify p50
1.46 s) and 8 large photos decoded in parallel took 3.5-4.5 GiB.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter

from service.errors import ServiceError, error_response

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The routes that detect and embed faces: the expensive ones (POST only).
FACE_PATHS = re.compile(r"^/v1/(verify|embed|identify|enroll|subjects/[^/]+/faces)$")


class OverloadedError(ServiceError):
    """The worker is busy; the answer carries ``Retry-After`` (seconds)."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after)}


class FaceSlots:
    """The face-path turns of one worker: at most ``limit`` requests detecting and embedding at
    once, and at most ``limit + queue`` admitted between the door (:class:`Admission`) and the end
    of their turn (those waiting on Redis meanwhile not counted). A request waits at most ``wait``
    seconds for its turn. The turns' work runs on threads of its own (one per turn), so requests
    that wait on Redis in the shared thread pool never hold it back."""

    def __init__(self, limit: int, queue: int, wait: float, retry_after: int = 1) -> None:
        self.limit, self.queue, self.wait, self.retry_after = limit, queue, wait, retry_after
        self.admitted = 0
        self.active = 0
        self.shed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turns: asyncio.Semaphore | None = None
        self._threads: CapacityLimiter | None = None

    def full(self) -> bool:
        """Every turn is taken and the queue is full: a new request is refused at the door."""
        return self.admitted >= self.limit + self.queue

    def overloaded(self, why: str) -> OverloadedError:
        self.shed += 1
        return OverloadedError(
            f"the service is busy ({why}); try again in {self.retry_after} s", self.retry_after
        )

    def _bind(self) -> tuple[asyncio.Semaphore, CapacityLimiter]:
        """The turns and their threads, made in the running event loop (a test may run several)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._turns = asyncio.Semaphore(self.limit)
            self._threads = CapacityLimiter(self.limit)
        return self._turns, self._threads


class Ticket:
    """One face-path request's place, from the door to the end of its turn (``slots`` None: a
    request that came in without :class:`Admission`, held back by nothing)."""

    def __init__(self, slots: FaceSlots | None) -> None:
        self.slots = slots
        self.held = False
        self._hold()

    def _hold(self) -> None:
        if self.slots is not None and not self.held:
            self.held = True
            self.slots.admitted += 1

    def release(self) -> None:
        """Leave the queue (idempotent): at the end of the turn, or of the request."""
        if self.slots is not None and self.held:
            self.held = False
            self.slots.admitted -= 1

    @asynccontextmanager
    async def aside(self) -> AsyncIterator[None]:
        """Not counted while waiting on Redis; back in the queue after, if it was in it before."""
        was_held = self.held
        self.release()
        try:
            yield
        finally:
            if was_held:
                self._hold()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[CapacityLimiter | None]:
        """One of the worker's turns (503 ``overloaded`` after waiting ``wait`` s); yields the
        threads to run the turn's work on. The request leaves the queue when its turn ends."""
        slots = self.slots
        if slots is None:
            yield None
            return
        self._hold()
        turns, threads = slots._bind()
        try:
            await asyncio.wait_for(turns.acquire(), timeout=slots.wait)
        except TimeoutError:
            self.release()
            raise slots.overloaded(f"no turn within {slots.wait:g} s") from None
        slots.active += 1
        try:
            yield threads
        finally:
            slots.active -= 1
            turns.release()
            self.release()

    async def run(self, work: Callable[..., T], *args: object) -> T:
        """``work(*args)`` on a face thread during a turn: decoding, detection, embedding."""
        async with self.turn() as threads:
            return await anyio.to_thread.run_sync(functools.partial(work, *args), limiter=threads)


class Admission:
    """ASGI middleware, the door of the face path: a face-path request is refused with 503
    ``overloaded`` and ``Retry-After`` at once, before its body is read, when every turn is taken
    and the queue is full (:class:`FaceSlots`); otherwise it gets a :class:`Ticket` (in
    ``request.state.face_ticket``) that the route uses for its turn. Other routes (gallery reads,
    health) are never held back."""

    def __init__(self, app, *, limit: int, queue: int, wait: float, retry_after: int = 1) -> None:
        self.app = app
        self.slots = FaceSlots(limit, queue, wait, retry_after)

    def _is_face_work(self, scope) -> bool:
        return scope["type"] == "http" and scope["method"] == "POST" and bool(FACE_PATHS.match(scope["path"]))

    async def __call__(self, scope, receive, send) -> None:
        if not self._is_face_work(scope):
            return await self.app(scope, receive, send)
        slots = self.slots
        if slots.full():
            error = slots.overloaded(f"{slots.limit} requests at work, {slots.queue} waiting")
            return await error_response(error, headers=error.headers)(scope, receive, send)
        ticket = Ticket(slots)
        scope.setdefault("state", {})["face_ticket"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.release()


class PixelBudget:
    """At most ``budget`` pixels being decoded (and held as RGB, a JPEG at the scale it is decoded
    at for detection) at once per process.

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
