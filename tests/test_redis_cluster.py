"""The test Redis Cluster itself (tests/redis_cluster.py): up, complete, and strict about slots."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.exceptions import ResponseError

from tests.redis_cluster import SLOTS, running


def test_cluster_has_three_primaries_three_replicas_and_every_slot(redis_cluster) -> None:
    nodes = redis_cluster.nodes()
    primaries = [n for n in nodes if "master" in n["flags"]]
    replicas = [n for n in nodes if "slave" in n["flags"]]
    assert len(primaries) == 3 and len(replicas) == 3
    assert {r["primary"] for r in replicas} == {p["id"] for p in primaries}  # one replica each
    covered = set()
    for primary in primaries:
        for span in primary["slots"].split():
            first, _, last = span.partition("-")
            covered |= set(range(int(first), int(last or first) + 1))
    assert covered == set(range(SLOTS))
    assert redis_cluster.startup_seconds < 15
    assert all(running(pid) for pid in redis_cluster.pids())


def test_cluster_refuses_a_cross_slot_multi_key_operation(redis_cluster) -> None:
    client = redis_cluster.client()
    try:
        assert client.keyslot("sf:a") != client.keyslot("sf:b")
        node = client.get_node_from_key("sf:a")
        direct = redis.Redis(host=node.host, port=node.port)
        with pytest.raises(ResponseError, match="same slot"):
            direct.mset({"sf:a": 1, "sf:b": 2})
        with pytest.raises(ResponseError, match="same slot"):
            direct.eval("return redis.call('MSET', KEYS[1], 1, KEYS[2], 2)", 2, "sf:a", "sf:b")
        # one hash tag, one slot: the same operation goes through
        assert client.keyslot("sf:{g01}:a") == client.keyslot("sf:{g01}:b")
        tagged = client.get_node_from_key("sf:{g01}:a")
        with redis.Redis(host=tagged.host, port=tagged.port) as same:
            assert same.mset({"sf:{g01}:a": 1, "sf:{g01}:b": 2})
        direct.close()
    finally:
        client.close()


def test_the_servers_die_with_the_process_that_started_them(redis_binary, tmp_path) -> None:
    """A test session killed outright (SIGKILL: no fixture teardown, no atexit) leaves no server."""
    script = (
        "import sys, time\n"
        "from tests.redis_cluster import LocalCluster\n"
        f"c = LocalCluster({redis_binary!r}).start()\n"
        "print(c.folder, ' '.join(map(str, c.pids())), flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent
    )
    try:
        folder, *pids = child.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 6 and all(running(pid) for pid in pids)
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(pid) for pid in pids)
    shutil.rmtree(folder, ignore_errors=True)  # what the killed process could not remove
