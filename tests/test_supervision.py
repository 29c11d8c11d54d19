"""`sphereface serve` supervises its processes: the workers die with it, whatever kills it; one
serve per data folder; a local redis-server that dies is restarted and reaped.

Real processes: `sphereface serve` through :class:`service.serve_process.Service`, Debian's
redis-server, and /proc (:mod:`bench.processes`) to see which processes are left and in what state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.processes import (
    descendants,
    kill_all,
    listening,
    process_state,
    running,
    wait_for,
    workers_started,
)
from service.serve_process import PACKAGES_ROOT, Service, free_port, serve_command, serve_env

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


def test_sigkill_of_serve_leaves_no_worker_and_a_restart_works_at_once(default_model_dir, workdir):
    """Workers left without their serve would keep the port (a restart fails with `Address
    already in use`) and answer 503 for want of their Redis."""
    data = workdir / "data"
    service = Service(default_model_dir, data, options=["--workers", "2"])
    family: set[int] = set()
    try:
        assert wait_for(lambda: workers_started(service) >= 2, 90, 0.2), service.log.read_text()[-3000:]
        family = descendants(service.process.pid)
        assert len(family) >= 3, family  # two workers and the redis-server (and multiprocessing's helper)
        service.process.kill()
        service.process.wait()
        gone = wait_for(lambda: not listening(service.port) and not any(map(running, family)), 5)
        left = {pid: process_state(pid) for pid in family if running(pid)}
        assert gone, f"left after 5 s: {left}, port {service.port} listening: {listening(service.port)}"
        again = Service(default_model_dir, data, options=["--workers", "2"], port=service.port, ready_s=120)
        try:
            assert again.client.post("/v1/subjects", json={"id": "after-crash"}).status_code == 201
            assert again.client.get("/readyz").json()["status"] == "ready"
        finally:
            assert again.stop() == 0
    finally:
        service.stop()
        kill_all(family)


def test_a_second_serve_on_a_running_data_dir_stops_at_once_naming_the_first(default_model_dir, workdir):
    """A second serve would share the first one's Redis (and wipe its metrics folder)."""
    data = workdir / "data"
    first = Service(default_model_dir, data)
    try:
        command = serve_command(free_port(), "--model", str(default_model_dir), "--data-dir", str(data))
        try:
            second = subprocess.run(
                command, cwd=PACKAGES_ROOT, env=serve_env(), capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            pytest.fail("a second serve on the same data folder ran instead of stopping")
        assert second.returncode != 0
        assert f"pid {first.process.pid}" in second.stderr, second.stderr
        assert str(data.absolute()) in second.stderr, second.stderr
        # the commands that use a running serve's local Redis still do
        keys_create = ["keys", "--data-dir", str(data), "create", "--scope", "read"]
        keys = subprocess.run(
            [sys.executable, "-m", "models.cli", *keys_create],
            cwd=PACKAGES_ROOT,
            env=serve_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert keys.returncode == 0, keys.stderr
        assert first.client.get("/readyz").status_code == 200
        read_key = keys.stdout.strip()
        r = first.client.get("/v1/subjects", headers={"X-API-Key": read_key})
        assert r.status_code == 200, r.text
    finally:
        assert first.stop() == 0
    # the lock goes with the process: the next serve of the folder starts
    Service(default_model_dir, data).stop()


def test_a_killed_local_redis_server_is_restarted_and_reaped(default_model_dir, workdir):
    """Without a restart, keyed routes and /readyz answer 503 until serve is restarted; without a
    wait, the dead redis-server stays a zombie child of serve."""
    data = workdir / "data"
    service = Service(default_model_dir, data)
    try:
        assert service.client.post("/v1/subjects", json={"id": "kept"}).status_code == 201
        old = int((data / "redis" / "redis.pid").read_text())
        assert old in descendants(service.process.pid)
        os.kill(old, signal.SIGKILL)
        ready = wait_for(lambda: service.client.get("/readyz").status_code == 200, 30, 0.1)
        assert ready, service.client.get("/readyz").text
        assert service.client.get("/v1/subjects/kept").status_code == 200  # fsync always: nothing lost
        assert process_state(old) is None, f"the old redis-server is {process_state(old)}"
        new = int((data / "redis" / "redis.pid").read_text())
        assert new != old and new in descendants(service.process.pid)
        assert "restarting" in service.log.read_text()
    finally:
        assert service.stop() == 0
