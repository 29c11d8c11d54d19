"""A stalled or dead Redis: the service answers 503 fast and recovers by itself.

A real redis-server is paused with SIGSTOP (it accepts connections but never answers: the worst
case for a client) and killed with SIGKILL. Before: `/readyz` took 30 s to answer and keyed
requests gave no answer within 30 s.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.auth import create_key
from service.redis_server import LocalRedis
from service.settings import Settings

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]

ENV_KEY = {"X-API-Key": "stall-test-admin-key"}


@contextmanager
def paused(server: LocalRedis):
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def timed(call):
    start = time.monotonic()
    response = call()
    return response, time.monotonic() - start


def test_a_paused_redis_gets_503_fast_and_the_service_recovers(default_model_dir, redis_binary, workdir):
    server = LocalRedis(workdir / "redis", binary=redis_binary).start()
    try:
        stored_key, _ = create_key(server.client(), "read", name="stall test")
        settings = Settings(model_dir=default_model_dir, redis_url=server.url, api_key=ENV_KEY["X-API-Key"])
        with TestClient(create_app(settings)) as client:
            assert client.post("/v1/subjects", json={"id": "ada"}, headers=ENV_KEY).status_code == 201
            with paused(server):
                ready, seconds = timed(lambda: client.get("/readyz"))
                assert ready.status_code == 503 and ready.json()["status"] == "redis_unavailable"
                assert seconds < 1.0, f"/readyz took {seconds:.2f} s"
                calls = {
                    "subjects, env key": lambda: client.get("/v1/subjects", headers=ENV_KEY),
                    "subject, stored key": lambda: client.get(
                        "/v1/subjects/ada", headers={"X-API-Key": stored_key}
                    ),
                    "create, env key": lambda: client.post(
                        "/v1/subjects", json={"id": "bob"}, headers=ENV_KEY
                    ),
                }
                for what, call in calls.items():
                    response, seconds = timed(call)
                    assert response.status_code == 503, (what, response.text)
                    assert response.json()["code"] == "redis_unavailable", what
                    assert seconds < 2.0, f"{what}: {seconds:.2f} s"
                    assert str(workdir) not in response.json()["message"]  # no server paths
            # resumed: the same client works again, nothing lost, nothing half-written
            assert client.get("/readyz").status_code == 200
            assert client.get("/v1/subjects/ada", headers={"X-API-Key": stored_key}).status_code == 200
            listed = client.get("/v1/subjects", headers=ENV_KEY).json()
            assert [s["id"] for s in listed["subjects"]] in (["ada"], ["ada", "bob"])
    finally:
        server.stop()


def test_a_killed_redis_gets_503_at_once_and_a_restarted_one_is_used_again(
    default_model_dir, redis_binary, workdir
):
    server = LocalRedis(workdir / "redis", binary=redis_binary).start()
    try:
        settings = Settings(model_dir=default_model_dir, redis_url=server.url, api_key=ENV_KEY["X-API-Key"])
        with TestClient(create_app(settings)) as client:
            assert client.post("/v1/subjects", json={"id": "ada"}, headers=ENV_KEY).status_code == 201
            server.kill()
            for path in ("/readyz", "/v1/subjects"):
                response, seconds = timed(lambda path=path: client.get(path, headers=ENV_KEY))
                assert response.status_code == 503 and seconds < 1.0, (path, seconds, response.text)
            server.start()  # same folder, same socket; the AOF holds "ada"
            assert client.get("/readyz").status_code == 200
            assert client.get("/v1/subjects/ada", headers=ENV_KEY).status_code == 200
    finally:
        server.stop()
