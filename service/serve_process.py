"""A real ``sphereface serve`` process on a free local port: started, waited for, stopped.

The tests and the benchmarks that need the service as users run it (uvicorn in a process of its
own, with an admin API key from the environment) start it through :class:`Service`. This module
needs nothing beyond the serving packages: the readiness probe uses the standard library, and
:attr:`Service.client` (an ``httpx.Client``, a development dependency) imports httpx on first use.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

#: The admin API key the process is started with, and the header that sends it.
KEY = "process-test-admin-key"
HEADERS = {"X-API-Key": KEY}

#: The folder holding the ``models`` and ``service`` packages: the process runs there, so that
#: ``python -m models.cli`` imports the same code as its parent.
PACKAGES_ROOT = Path(__file__).resolve().parents[1]


class ServeProcessError(RuntimeError):
    """The ``sphereface serve`` process exited, or did not get ready in time (with its log's tail)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, *options: str) -> list[str]:
    """The command line of ``sphereface serve --port PORT OPTIONS...`` in this Python."""
    return [sys.executable, "-m", "models.cli", "serve", "--port", str(port), *options]


def serve_env(redis_url: str | None = None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child ``serve``: the admin key :data:`KEY`, one ORT thread,
    ``REDIS_URL`` only when given (no Redis URL is inherited), then ``extra_env`` over it all."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPHEREFACE_REDIS_URL")}
    env.update(SPHEREFACE_API_KEY=KEY, SPHEREFACE_INTRA_OP_THREADS="1")
    if redis_url:
        env["REDIS_URL"] = redis_url
    env.update(extra_env or {})
    return env


class Service:
    """One ``sphereface serve`` process on a free port, ready (``/readyz`` answered 200) once built.

    ``options`` are more ``serve`` options; the log (stdout and stderr) goes to ``log``, by default
    ``service-<port>.log`` beside ``data_dir``. ``ready_s``: seconds to wait for ``/readyz``.
    ``port``: the port to listen on (default: a free one).
    """

    def __init__(
        self,
        model: Path,
        data_dir: Path,
        redis_url: str | None = None,
        extra_env: dict[str, str] | None = None,
        *,
        options: Sequence[str] = (),
        log: Path | None = None,
        ready_s: float = 90.0,
        port: int | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = serve_command(self.port, "--model", str(model), "--data-dir", str(data_dir), *options)
        self.log = log if log is not None else data_dir.parent / f"service-{self.port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log_file:
            self.process = subprocess.Popen(
                command,
                cwd=PACKAGES_ROOT,
                env=serve_env(redis_url, extra_env),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready(ready_s)

    @cached_property
    def client(self) -> httpx.Client:
        """An ``httpx.Client`` on the service with the admin key (httpx imported here, on first use)."""
        import httpx

        return httpx.Client(base_url=self.url, headers=HEADERS, timeout=60)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=10) as response:
                return response.status == 200
        except OSError:  # refused, reset, timed out, or an HTTP error status (503 while loading)
            return False

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServeProcessError(f"serve exited {self.process.returncode}: {self._log_tail()}")
            if self._ready():
                return
            time.sleep(0.2)
        self.stop()
        raise ServeProcessError(f"serve not ready in {timeout:g} s: {self._log_tail()}")

    def rss_mib(self) -> float:
        """Resident memory of the service process (one worker: the app runs in it), in MiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise ServeProcessError("no VmRSS")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` and wait (SIGKILL after 30 s); returns the exit status."""
        if "client" in self.__dict__:
            self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
