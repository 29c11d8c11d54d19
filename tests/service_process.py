"""A `sphereface serve` process for tests: started on a free port, waited for, stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import REPO_ROOT

KEY = "process-test-admin-key"
HEADERS = {"X-API-Key": KEY}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One `sphereface serve` process."""

    def __init__(
        self,
        model: Path,
        data_dir: Path,
        redis_url: str | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPHEREFACE_REDIS_URL")}
        env.update(SPHEREFACE_API_KEY=KEY, SPHEREFACE_INTRA_OP_THREADS="1")
        if redis_url:
            env["REDIS_URL"] = redis_url
        env.update(extra_env or {})
        command = [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port)]
        command += ["--model", str(model), "--data-dir", str(data_dir)]
        self.log = data_dir.parent / f"service-{self.port}.log"
        self.process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )
        self.client = httpx.Client(base_url=self.url, headers=HEADERS, timeout=60)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"serve exited {self.process.returncode}: {self.log.read_text()[-3000:]}"
                )
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready in {timeout} s: {self.log.read_text()[-3000:]}")

    def rss_mib(self) -> float:
        """Resident memory of the service process (one worker: the app runs in it), in MiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum`` and wait (SIGKILL after 30 s); returns the exit status."""
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
