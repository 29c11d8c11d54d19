"""Per-key rate limits on the real app and a real `sphereface serve`: a key beyond its rate is
answered 429 `rate_limited` with `Retry-After` by every app instance on the same Redis, while
other keys are served at their normal latency. Before: no limit at all, so one read key could
take every face-path slot."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bench.fault_load import paced_verifies, start_hammer
from service.app import create_app, load_pipeline
from service.auth import create_key
from service.settings import Settings

ENV_KEY = "rate-limit-test-admin-key"


# -- the real app ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(default_model_dir: Path):
    return load_pipeline(Settings(model_dir=default_model_dir))


def app_settings(url: str, **limits) -> Settings:
    return Settings(redis_url=url, api_key=ENV_KEY, **limits)


def test_two_app_instances_share_the_bucket_of_a_key(redis_server, redis_client, pipeline) -> None:
    """Two apps (two workers, or two pods) on one Redis: a read key may make 4 requests at once
    and 1 a second; its 5th, on either app, is 429 with Retry-After, while another read key and
    the admin key are served. After the stated wait, the key is served again."""
    noisy, noisy_info = create_key(redis_client, "read", "noisy")
    quiet, _ = create_key(redis_client, "read", "quiet")
    settings = app_settings(redis_server.url, rate_limit_read=1.0, rate_limit_read_burst=4)
    with (
        TestClient(create_app(settings, pipeline)) as first,
        TestClient(create_app(settings, pipeline)) as second,
    ):
        apps = [first, second]
        for i in range(4):
            assert apps[i % 2].get("/v1/subjects", headers={"X-API-Key": noisy}).status_code == 200
        vectors = np.eye(128)[:2].tolist()
        for refused in (
            first.get("/v1/subjects", headers={"X-API-Key": noisy}),
            second.post(
                "/v1/verify",
                json={"embedding1": vectors[0], "embedding2": vectors[1]},
                headers={"X-API-Key": noisy},
            ),
        ):
            assert refused.status_code == 429, refused.text
            assert refused.json()["code"] == "rate_limited"
            assert refused.headers["retry-after"] == "1"
            assert noisy_info.key_id in refused.json()["message"] and noisy not in refused.text
        for client in apps:
            assert client.get("/v1/subjects", headers={"X-API-Key": quiet}).status_code == 200
            admin = [client.get("/v1/subjects", headers={"X-API-Key": ENV_KEY}) for _ in range(10)]
            assert {r.status_code for r in admin} == {200}  # admin keys: no limit by default
        time.sleep(1.05)  # Retry-After said 1 s
        assert second.get("/v1/subjects", headers={"X-API-Key": noisy}).status_code == 200
        assert second.get("/v1/subjects", headers={"X-API-Key": noisy}).status_code == 429


def test_the_admin_scope_can_be_limited_too(redis_server, redis_client, pipeline) -> None:
    settings = app_settings(redis_server.url, rate_limit_admin=0.5, rate_limit_admin_burst=2)
    with TestClient(create_app(settings, pipeline)) as client:
        answers = [client.get("/v1/subjects", headers={"X-API-Key": ENV_KEY}) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429]
    assert answers[2].headers["retry-after"] == "2"  # one token every 2 s
    assert redis_client.exists("sf:ratelimit:env")


def test_auth_off_has_no_limits(redis_server, redis_client, pipeline) -> None:
    settings = app_settings(redis_server.url, auth="off", rate_limit_read=0.1, rate_limit_admin=0.1)
    with TestClient(create_app(settings, pipeline)) as client:
        assert all(client.get("/v1/subjects").status_code == 200 for _ in range(10))
    assert redis_client.keys("sf:ratelimit:*") == []


def test_every_keyed_operation_documents_429_with_retry_after() -> None:
    doc = create_app(Settings(api_key=ENV_KEY)).openapi()
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if not path.startswith("/v1/"):
                assert "429" not in operation["responses"], (method, path)
                continue
            answer = operation["responses"]["429"]
            assert "rate_limited" in answer["description"], (method, path)
            header = answer["headers"]["Retry-After"]
            assert header["required"] and header["schema"] == {"type": "integer", "minimum": 1}


# -- a real `sphereface serve` with two workers ---------------------------------------------------

RATE, BURST = 2, 2  # read keys in the next test: 2 requests a second, 2 at once
PAUSE = 0.6  # seconds the quiet key waits between its requests: always under its rate


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_noisy_key_gets_429_while_a_quiet_key_keeps_its_latency(
    default_model_dir, photos_dir, redis_binary, workdir
) -> None:
    """Two read keys on `sphereface serve --workers 2`: one hammers verify with two photos from
    two threads, never pausing; the other verifies the same photos, pausing 0.6 s. The noisy key
    gets 429 with Retry-After beyond its burst and rate (one bucket for both workers); the quiet
    key keeps its latency."""
    import httpx

    from service.redis_server import LocalRedis
    from service.serve_process import Service

    redis_server = LocalRedis(workdir / "redis", binary=redis_binary).start()
    noisy, _ = create_key(redis_server.client(), "read", "noisy")
    quiet, _ = create_key(redis_server.client(), "read", "quiet")
    env = {
        "SPHEREFACE_WORKERS": "2",
        "SPHEREFACE_RATE_LIMIT_READ": str(RATE),
        "SPHEREFACE_RATE_LIMIT_READ_BURST": str(BURST),
    }
    obama = photos_dir / "people" / "obama"
    files = {"photo1": (obama / "2.jpg").read_bytes(), "photo2": (obama / "4.jpg").read_bytes()}
    service = Service(default_model_dir, workdir / "api", redis_server.url, extra_env=env)
    try:
        with httpx.Client(base_url=service.url, headers={"X-API-Key": quiet}, timeout=60) as client:
            paced_verifies(client, files, 2, PAUSE)  # warm up
            quiet_alone = paced_verifies(client, files, 5, PAUSE)
            began = time.monotonic()
            hammer = start_hammer(service.url, noisy, files, workdir)
            quiet_during = paced_verifies(client, files, 5, PAUSE)
            out, _ = hammer.communicate("", timeout=60)
            seconds = time.monotonic() - began
    finally:
        service.stop()
        redis_server.stop()
    assert set(quiet_alone.statuses) == set(quiet_during.statuses) == {200}
    alone, during = quiet_alone.seconds, quiet_during.seconds
    answers = json.loads(out)
    served = answers.get("200 None None", 0)
    print(
        f"noisy key: {answers} in {seconds:.1f} s; quiet key latency ms: alone "
        f"{[round(1000 * s) for s in alone]}, during {[round(1000 * s) for s in during]}"
    )
    assert set(answers) == {"200 None None", "429 rate_limited 1"}, answers
    assert answers["429 rate_limited 1"] > served
    # one bucket for both workers: at most the burst and the rate (per-worker buckets: up to twice)
    assert served <= BURST + RATE * seconds + 1, (served, seconds)
    assert np.median(during) <= 2 * np.median(alone) + 0.1, (alone, during)
