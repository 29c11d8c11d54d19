"""An exclusive lock on a file, so that two jobs filling the same cache take turns."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def acquire(path: Path, what: str) -> int:
    """Lock ``path`` (created if missing) for this process; returns the descriptor to :func:`release`.

    Waits while another process holds it, saying so in the log (``what`` names the work waited for).
    The lock goes with the descriptor, also when the process dies.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is %s", what)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """:func:`acquire` for the duration of a ``with`` block."""
    fd = acquire(path, what)
    try:
        yield
    finally:
        release(fd)
