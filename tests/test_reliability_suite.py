"""The short version of the fault and load suite (`bench/reliability.py --short`; the full one is
`make reliability`): real service processes and redis-servers, SIGKILL of Redis and of the API
during enrollment, a paused Redis, two workers under concurrent changes, SIGKILL of a serve's own
redis-server and of `serve --workers 2`, a paused Redis under enroll and identify load, a noisy key
beside a quiet one, hostile images and requests, and what the hostile set costs a worker.

The bounds are far from both outcomes on a busy 2-core machine; each says why where it is set."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(default_model_dir, photos_dir, redis_binary):
    spec = importlib.util.spec_from_file_location("reliability", REPO_ROOT / "bench" / "reliability.py")
    suite = importlib.util.module_from_spec(spec)
    sys.modules["reliability"] = suite  # dataclasses look their module up there
    spec.loader.exec_module(suite)
    return suite.run(short=True)


def test_load_gets_answers_and_no_server_error(results):
    for row in results["load"]:
        assert row["server errors"] == 0, row
        assert row["answered per s"] > 0, row


def test_no_acknowledged_write_is_lost_through_sigkills(results):
    durability = results["durability"]
    assert durability["writes acknowledged"] >= 200, durability
    assert durability["lost"] == 0 and durability["server errors"] == 0, durability
    assert len(durability["faults"]) == 2


def test_a_paused_redis_is_503_fast_and_then_fine(results):
    pause = results["pause"]
    assert pause["server errors"] == 0, pause
    assert pause["slowest answer while paused s"] < 2.0, pause
    assert pause["readyz while paused"].startswith("503 redis_unavailable"), pause
    assert set(pause["answers after resume"]) == {"200"}, pause


def test_two_workers_stay_consistent(results):
    workers = results["workers"]
    assert workers["consistency checks"] >= 20, workers
    assert workers["enrolled but not found"] == 0 and workers["deleted but found"] == 0, workers
    assert workers["server errors"] == 0, workers


def test_a_killed_serve_leaves_nothing_and_its_redis_server_comes_back(results):
    """Workers left behind would keep the port (a restart fails with `Address already in use`);
    a redis-server not restarted would leave keyed routes at 503 (20 s and more observed)."""
    supervision = results["supervision"]
    for kill in supervision["redis kills"]:
        # the restart waits 0.5 s: measured 0.55-0.8 s back in service
        assert kill["back in s"] is not None and kill["back in s"] < 10, kill
        assert kill["reaped"] and kill["new pid"] and kill["kept subject"] == 200, kill
        assert set(kill["reads meanwhile"]) <= {"200", "503"}, kill
    serve_kill = supervision["serve kill"]
    assert serve_kill["processes"] >= 3, serve_kill  # two workers and the redis-server
    # measured 0.17-0.30 s; before, the workers stayed with the port held
    assert serve_kill["gone in s"] is not None and serve_kill["port free"], serve_kill
    restart = supervision["restart"]
    assert restart.get("create after restart") == 201 and restart.get("kept subject") == 200, restart


def test_a_paused_redis_does_not_slow_health_checks_or_verify(results):
    """A Redis call on the event loop holds every request of the worker for up to the Redis
    timeout (1 s): liveness probes then wait about 0.5 s in the median, against a few ms when
    nothing blocks the loop (bound 0.15 s); verify is compared with the same load against a
    running Redis (measured ratios 0.4-0.6; 6.7-7.6 when turns were held across Redis calls)."""
    stall = results["stall"]
    paused = stall["paused"]
    assert set(paused["liveness"]["answers"]) == {"200"} and set(paused["verify"]["answers"]) == {"200"}
    assert set(paused["enroll"]["answers"]) == {"503"}, paused["enroll"]
    assert paused["liveness"]["p50 ms"] < 150 and paused["liveness"]["p90 ms"] < 500, paused["liveness"]
    assert stall["verify p50 paused / running"] < 2.0, stall


def test_a_noisy_key_gets_429_and_the_quiet_key_keeps_its_latency(results):
    """Without per-key limits the noisy key was served (47 x 200, no 429) and the quiet key's
    latency grew. One bucket for both workers: at most the burst and the rate."""
    limit = results["rate_limit"]
    answers = limit["noisy answers (status code Retry-After)"]
    assert set(answers) == {"200 None None", "429 rate_limited 1"}, answers
    assert answers["429 rate_limited 1"] > limit["noisy served"], limit
    assert limit["noisy served"] <= limit["noisy served at most"] + 1, limit
    assert set(limit["quiet answers"]) == {"200"}, limit
    # measured 70 -> 89 ms; the bound is the one of tests/test_rate_limit_api.py
    assert limit["quiet p50 ms beside the noisy key"] <= 2 * limit["quiet p50 ms alone"] + 100, limit


def test_hostile_images_and_requests_get_their_typed_answers(results):
    hostile = results["hostile"]
    wrong = [row for row in hostile["images"] + hostile["requests"] if not row["as expected"]]
    assert wrong == [] and hostile["server errors"] == 0


def test_the_jpeg_bomb_is_cheap_and_memory_comes_back_after_the_hostile_set(results):
    """Before: the bomb cost the worker 0.7-1.5 s of CPU, and its RSS stayed at 1.2-1.8x the start
    after the hostile set and normal photos. Measured now: 0.002 s and 1.03x (the worker's CPU is
    counted in 10 ms ticks)."""
    hostile = results["hostile"]
    assert hostile["bomb"]["answers"] == ["unreadable_image"], hostile["bomb"]
    assert hostile["bomb"]["worker CPU s"] < 0.2, hostile["bomb"]
    ratio = hostile["rss / start"]  # the short run sends no normal photos after the hostile set
    assert ratio["after hostile"] <= 1.5 and ratio.get("after normal", 1.0) <= 1.5, hostile["rss MiB"]
