"""An ordered process pool that reports a dead worker instead of waiting for it forever.

``multiprocessing.Pool.imap`` waits forever for the result of a worker that died (killed by the
kernel's out-of-memory killer, a crash in a decoder's native code); :func:`ordered_results` runs
the tasks in a :class:`concurrent.futures.ProcessPoolExecutor`, which notices a dead worker, and
raises :class:`WorkerDied` naming the task that worker was on. Each worker writes the position of
the task it is running into a shared slot and clears it when done; the executor stops the other
workers with SIGTERM, on which they clear their slot, so after a break the slots still set are
those of the workers that died by something else.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from models.errors import SphereFaceError

#: A slot's value while its worker runs no task.
IDLE = -1


class WorkerDied(SphereFaceError):
    """A worker process died (killed, e.g. out of memory, or a crash in native code); ``tasks``
    are the tasks it was running (empty when it died between two tasks)."""

    code = "worker_died"

    def __init__(self, message: str, tasks: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.tasks = list(tasks)


def died_in_shards(
    died: WorkerDied, on: list[tuple[int, str]], ranges: list[tuple[int, int]], done: int
) -> WorkerDied:
    """``died`` told for a job written in shards (``sphereface prepare``): ``on`` is what the dead
    worker was on, as ``(first item, "photo 12 (a/1.jpg)")``, ``ranges`` the shards' items
    ``[a, b)``, ``done`` how many shards are written (they are kept: a rerun continues from them)."""
    shard = {i: next(k for k, (a, b) in enumerate(ranges) if a <= i < b) for i, _ in on}
    where = ", ".join(f"{what} of shard {shard[i]}" for i, what in on)
    return WorkerDied(
        f"a prepare worker process died {'while on ' + where if on else 'between two tasks'} (killed, "
        f"e.g. out of memory, or a crash in native code); {done} of {len(ranges)} shards are written "
        "and kept: run the same command again to continue from them",
        died.tasks,
    )


def pool_context() -> multiprocessing.context.BaseContext:
    """forkserver where there is one (never fork a parent that may hold ONNX Runtime threads)."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


# -- in the worker processes --

_SLOTS: Any = None
_SLOT = IDLE


def _init_worker(slots: Any, counter: Any, initializer: Callable | None, initargs: tuple) -> None:
    """Take a slot, clear it on the executor's SIGTERM, then run the caller's initializer."""
    global _SLOTS, _SLOT
    with counter.get_lock():
        _SLOT = counter.value
        counter.value += 1
    _SLOTS = slots if _SLOT < len(slots) else None
    signal.signal(signal.SIGTERM, _stopped_by_the_pool)
    if initializer is not None:
        initializer(*initargs)


def _stopped_by_the_pool(signum: int, frame: Any) -> None:
    _mark(IDLE)
    os._exit(128 + signum)


def _mark(position: int) -> None:
    if _SLOTS is not None:
        _SLOTS[_SLOT] = position


def _run_chunk(fn: Callable[[Any], Any], first: int, chunk: list[Any]) -> list[Any]:
    """``fn`` over ``chunk`` (tasks ``first``, ``first + 1``, ...), each one marked in the slot."""
    results = []
    for offset, task in enumerate(chunk):
        _mark(first + offset)
        results.append(fn(task))
    _mark(IDLE)
    return results


# -- in the calling process --


def ordered_results(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    workers: int,
    *,
    initializer: Callable | None = None,
    initargs: tuple = (),
    chunksize: int = 1,
) -> Iterator[Any]:
    """``fn(task)`` for every task, in task order, computed by ``workers`` processes (``<= 1``: in
    this process); ``fn`` and ``initializer`` must be importable module-level functions.

    At most ``4 * workers`` chunks of ``chunksize`` tasks are queued or running at a time.

    Raises:
        WorkerDied: a worker process died; its ``tasks`` are the ones that worker was running.
    """
    if not tasks:
        return
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from (fn(task) for task in tasks)
        return
    workers = min(workers, len(tasks))
    context = pool_context()
    slots = context.Array("q", [IDLE] * workers, lock=False)
    counter = context.Value("i", 0)
    setup = (slots, counter, initializer, initargs)
    executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=setup)
    try:
        yield from _in_order(executor, fn, tasks, chunksize, window=4 * workers)
    except BrokenProcessPool:
        executor.shutdown(wait=True, cancel_futures=True)  # every worker is gone: the slots are final
        dead = [tasks[position] for position in slots if position != IDLE]
        on = f"while running {len(dead)} task(s)" if dead else "between two tasks"
        raise WorkerDied(f"a worker process died {on}", dead) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _in_order(
    executor: ProcessPoolExecutor, fn: Callable, tasks: Sequence[Any], chunksize: int, window: int
) -> Iterator[Any]:
    """Submit chunks as results are taken, keeping ``window`` of them in flight."""
    starts: Iterable[int] = iter(range(0, len(tasks), max(1, chunksize)))
    pending: deque[Future] = deque()

    def submit_next() -> None:
        first = next(starts, None)
        if first is not None:
            chunk = list(tasks[first : first + max(1, chunksize)])
            pending.append(executor.submit(_run_chunk, fn, first, chunk))

    for _ in range(window):
        submit_next()
    while pending:
        results = pending.popleft().result()
        submit_next()
        yield from results
