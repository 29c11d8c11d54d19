"""The test Redis Cluster: :class:`LocalCluster` of :mod:`service.redis_local_cluster` (3
primaries and 3 replicas of Debian's ``redis-server``, a 1 s node timeout; the benchmarks start
theirs through it too), and what tests do to one: move a slot by hand (:func:`migrate_slot`), ask
who owns a slot (:func:`owns`), see whether a server still runs (:func:`running`). The session's
cluster is the ``redis_cluster`` fixture of tests/conftest.py.
"""

from __future__ import annotations

import os

import redis

from service.redis_local_cluster import NODE_TIMEOUT_MS, SLOTS, LocalCluster, free_port

__all__ = ["NODE_TIMEOUT_MS", "SLOTS", "LocalCluster", "free_port", "migrate_slot", "owns", "running"]


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def migrate_slot(cluster: LocalCluster, slot: int, target: str, between_batches=None) -> None:
    """Move ``slot`` to the primary at ``target`` (``host:port``) the way ``redis-cli --cluster
    reshard`` does: mark it importing and migrating, MIGRATE its keys a few at a time (calling
    ``between_batches()`` after each batch), then give it to the target on every node."""
    nodes = cluster.nodes()
    by_address = {row["address"]: row for row in nodes}
    source = next(row for row in nodes if "master" in row["flags"] and owns(row["slots"], slot))
    dest = by_address[target]

    def node(row):
        host, port = row["address"].rsplit(":", 1)
        return redis.Redis(host=host, port=int(port))

    with node(source) as src, node(dest) as dst:
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source["id"])
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dest["id"])
        host, port = dest["address"].rsplit(":", 1)
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 3):
            src.execute_command("MIGRATE", host, int(port), "", 0, 5000, "KEYS", *keys)
            if between_batches is not None:
                between_batches()
        for row in nodes:
            if "master" in row["flags"]:
                with node(row) as each:
                    each.execute_command("CLUSTER SETSLOT", slot, "NODE", dest["id"])


def owns(slots: str, slot: int) -> bool:
    for span in slots.split():
        first, _, last = span.partition("-")
        if int(first) <= slot <= int(last or first):
            return True
    return False
