"""Per-image work on a few threads, in order: reading, detecting and aligning photos while the
main thread embeds them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_END = object()


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int, window: int) -> Iterator[Any]:
    """``map(fn, items)`` on ``workers`` threads, results in order, at most ``window`` in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lfw")
    try:
        source = iter(items)
        pending = deque(pool.submit(fn, item) for _, item in zip(range(window), source, strict=False))
        while pending:
            result = pending.popleft().result()
            following = next(source, _END)
            if following is not _END:
                pending.append(pool.submit(fn, following))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def progress_bar(iterable: Iterable[Any], total: int, desc: str, enabled: bool) -> Iterable[Any]:
    """``iterable`` behind a tqdm bar counting images when ``enabled``, else unchanged."""
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="img", dynamic_ncols=True)
