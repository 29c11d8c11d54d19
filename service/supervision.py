"""How ``sphereface serve`` keeps its processes together: workers that die with it, one serve per
data folder, and a local redis-server that is restarted when it dies.

- **Parent-death signal.** On Linux a process can ask the kernel for a signal when the thread that
  created it ends (``prctl(PR_SET_PDEATHSIG)``), even when SIGKILL ends it and no Python code runs.
  The workers of ``serve --workers N`` and the local redis-server ask for SIGTERM: a worker finishes
  the requests in flight and exits, Redis fsyncs its append-only file and exits. Elsewhere there
  is no such call: a serve killed by SIGKILL leaves its workers running there (a serve stopped by
  SIGTERM or Ctrl-C still stops them).
- **Data folder lock.** ``DATA_DIR/serve.lock`` is held with ``flock`` (with the holder's PID in it)
  for the life of the serve process; the kernel drops it when the process dies, however it dies.
- **Redis watcher.** :class:`RedisWatcher` is a thread of the serve process that waits on the local
  redis-server child (reaping it) and starts it again on the same socket and data after a delay
  from :class:`Backoff`.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from service.errors import ServiceError

log = logging.getLogger(__name__)

#: prctl(2) option: the signal a process gets when its parent (the thread that created it) ends.
PR_SET_PDEATHSIG = 1
#: The lock file of a serve process in its data folder; it holds the PID of the serve holding it.
SERVE_LOCK_NAME = "serve.lock"
#: The environment variable that gives a worker of ``serve --workers N`` the PID of its serve.
SUPERVISOR_PID_ENV = "SPHEREFACE_SUPERVISOR_PID"


class ServeRunningError(ServiceError):
    """Another ``sphereface serve`` holds the data folder."""

    code = "serve_running"


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent ends; False (nothing done)
    where there is no ``prctl(PR_SET_PDEATHSIG)`` (every system but Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    return True


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Get ``signum`` when the process ``parent`` (this process's parent) ends; exit at once with
    status 1 when it has already ended (it died before the signal was asked for: no signal comes).
    False where the platform has no parent-death signal (see :func:`set_parent_death_signal`)."""
    if not set_parent_death_signal(signum):
        log.debug("no parent-death signal on %s: this process outlives a killed parent", sys.platform)
        return False
    if os.getppid() != parent:
        log.error("the supervising process %d is gone: exiting", parent)
        os._exit(1)
    return True


def die_with_supervisor() -> bool:
    """In a worker started by ``serve --workers N``: die with the serve process whose PID is in
    :data:`SUPERVISOR_PID_ENV` (see :func:`die_with_parent`). False when the variable is unset."""
    parent = os.environ.get(SUPERVISOR_PID_ENV)
    return die_with_parent(int(parent)) if parent else False


def _lock_holder(path: Path) -> str:
    try:
        return f"pid {int(path.read_text().strip())}"
    except (OSError, ValueError):
        return "pid unknown"


def lock_data_dir(data_dir: Path, *, required: bool = True) -> int | None:
    """Take ``data_dir/serve.lock`` for this process (exclusive ``flock``, this PID written in it)
    and return its descriptor, kept open for as long as the lock is held.

    Raises :class:`ServeRunningError` naming the holder's PID when another process holds it. When
    the folder cannot be created or written: ``required`` raises :class:`ServiceError`, otherwise
    None is returned (no lock).
    """
    folder = Path(data_dir).expanduser().absolute()
    path = folder / SERVE_LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if not required:
            log.info("data folder %s is not writable (%s): serve takes no lock on it", folder, exc.strerror)
            return None
        raise ServiceError(f"cannot lock data folder {folder}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ServeRunningError(
            f"sphereface serve ({_lock_holder(path)}) is already running on data folder {folder}: "
            "stop it first, or give this one another --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


class Backoff:
    """Delays between restarts, in seconds: ``first``, doubled after each restart up to ``cap``, and
    ``first`` again once the server ran ``healthy_s`` seconds before it died."""

    def __init__(self, first: float = 0.5, cap: float = 10.0, healthy_s: float = 30.0) -> None:
        self.first, self.cap, self.healthy_s = first, cap, healthy_s
        self._delay = first

    def next(self, ran_s: float) -> float:
        """The delay before the next restart of a server that ran ``ran_s`` seconds."""
        if ran_s >= self.healthy_s:
            self._delay = self.first
        delay = self._delay
        self._delay = min(self._delay * 2, self.cap)
        return delay


class Restartable(Protocol):
    """What :class:`RedisWatcher` needs of a server (:class:`service.redis_server.LocalRedis`)."""

    pid: int | None
    url: str
    stopped: bool

    def wait(self) -> int | None: ...

    def restart(self) -> bool: ...

    def stop(self) -> None: ...


def _ended(status: int) -> str:
    """How a process ended, from its ``Popen.returncode``."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class RedisWatcher:
    """A thread that restarts ``server`` whenever it exits on its own, and reaps it.

    The thread spawns the restarted servers, so it lives until :meth:`stop` (a parent-death signal
    follows the thread that created the child). :meth:`stop` stops the server and the thread.
    """

    def __init__(self, server: Restartable, backoff: Backoff | None = None) -> None:
        self.server = server
        self.backoff = backoff or Backoff()
        self.restarts = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-watcher", daemon=True)
        # LocalRedis asks for a parent-death signal from this thread too: it outlives its children.
        self._thread.outlives_children = True  # type: ignore[attr-defined]

    def start(self) -> RedisWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 15) -> None:
        """Stop the server (gracefully) and the watcher thread."""
        self._stopping.set()
        self.server.stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.is_set():
            started, pid = time.monotonic(), self.server.pid
            status = self.server.wait()  # reaps it
            if self._stopping.is_set() or status is None or self.server.stopped:
                return
            delay = self.backoff.next(time.monotonic() - started)
            log.warning("local redis-server (pid %s) %s; restarting it in %.1f s", pid, _ended(status), delay)
            if self._stopping.wait(delay):
                return
            self._restart()

    def _restart(self) -> None:
        try:
            if self.server.restart():
                self.restarts += 1
                log.info("local redis-server restarted (pid %s) on %s", self.server.pid, self.server.url)
        except Exception:  # keep watching: the next round waits longer and tries again
            log.exception("local redis-server did not restart")
