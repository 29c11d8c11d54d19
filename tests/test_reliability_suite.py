"""The short version of the fault and load suite (`bench/reliability.py --short`; the full one is
`make reliability`): real service processes and redis-servers, SIGKILL of Redis and of the API
during enrollment, a paused Redis, two workers under concurrent changes, hostile images."""

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


def test_hostile_images_get_their_typed_answers_and_leave_no_memory_behind(results):
    hostile = results["hostile"]
    wrong = [row for row in hostile["images"] if not row["as expected"]]
    assert wrong == [] and hostile["server errors"] == 0
    assert hostile["rss after MiB"] <= 1.2 * hostile["rss before MiB"], hostile
