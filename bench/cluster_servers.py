"""The Redis layouts bench/cluster.py compares: one plain redis-server, or a Redis Cluster of
cluster-mode redis-servers (``primaries`` primaries, each with ``replicas`` replicas), all on loopback
TCP with the same settings (no persistence: no RDB snapshots, no append-only file). The cluster is a
:class:`service.redis_local_cluster.LocalCluster`, the plain server that module's :func:`spawn_redis`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from service.redis_local_cluster import LocalCluster, free_port, spawn_redis, stop_processes, wait_ping
from service.redis_server import find_redis_server

#: Redis's default cluster-node-timeout: a node busy for a second under the benchmark's load is no failure.
NODE_TIMEOUT_MS = 15000


@dataclass(frozen=True)
class LayoutSpec:
    """How to reach a layout from any process: its kind and its nodes' ports (picklable)."""

    name: str
    cluster: bool
    ports: tuple[int, ...]

    def client(self) -> redis.Redis | RedisCluster:
        if self.cluster:
            nodes = [ClusterNode("127.0.0.1", port) for port in self.ports]
            return RedisCluster(startup_nodes=nodes, socket_timeout=60)
        return redis.Redis(host="127.0.0.1", port=self.ports[0], socket_timeout=60)


@dataclass
class Layout:
    """Running redis-servers of one layout; :meth:`stop` ends every one of them."""

    name: str
    primaries: int  # 1 and not ``cluster``: a plain redis-server
    replicas: int = 0
    cluster: bool = False
    servers: LocalCluster | None = None  # the cluster, once started
    process: subprocess.Popen | None = None  # the plain redis-server, once started
    folder: Path | None = None  # the plain redis-server's
    ports: list[int] = field(default_factory=list)

    @property
    def spec(self) -> LayoutSpec:
        return LayoutSpec(self.name, self.cluster, tuple(self.ports))

    def describe(self) -> str:
        if not self.cluster:
            return "1 plain redis-server"
        replicas = f", {self.replicas} replica(s) each" if self.replicas else ", no replicas"
        return f"Redis Cluster: {self.primaries} primaries{replicas}"

    def start(self, timeout: float = 60.0) -> Layout:
        """Every server up; a cluster's with every slot served and every replica synced (the
        gallery's writes wait for a replica with ``WAIT``, :mod:`service.gallery.writes`)."""
        binary = find_redis_server()
        if self.cluster:
            self.servers = LocalCluster(
                binary,
                primaries=self.primaries,
                replicas=self.replicas,
                node_timeout_ms=NODE_TIMEOUT_MS,
                prefix="sf-bench-cluster-",
            ).start(timeout)
            self.ports = list(self.servers.ports)
            return self
        self.folder = Path(tempfile.mkdtemp(prefix="sf-bench-redis-"))
        self.ports = [free_port()]
        try:
            self.process = spawn_redis(binary, self.ports[0], self.folder / "redis")
            wait_ping(self.ports[0], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def pids(self) -> list[int]:
        if self.servers is not None:
            return self.servers.pids()
        return [self.process.pid] if self.process is not None else []

    def memory(self) -> list[dict[str, Any]]:
        """Per node: its port, role and INFO memory's used_memory and used_memory_rss (bytes)."""
        rows = []
        for port in self.ports:
            with redis.Redis(host="127.0.0.1", port=port) as client:
                mem, repl = client.info("memory"), client.info("replication")
                keys = client.dbsize()
            used, rss = int(mem["used_memory"]), int(mem["used_memory_rss"])
            rows.append(
                {
                    "port": port,
                    "role": repl["role"],
                    "keys": keys,
                    "used_memory": used,
                    "used_memory_rss": rss,
                }
            )
        return rows

    def cpu_seconds(self) -> float:
        """CPU time (user + system) its redis-servers have used so far, from /proc."""
        total = 0
        for pid in self.pids():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        return total / os.sysconf("SC_CLK_TCK")

    def wait_replicated(self, timeout: float = 600.0) -> None:
        """Until every replica has its primary's whole replication stream."""
        if self.servers is not None:
            self.servers.wait_replicated(timeout, poll=0.2)

    def stop(self) -> None:
        if self.servers is not None:
            self.servers.stop(timeout=30)
        if self.process is not None:
            stop_processes([self.process], timeout=30)
            self.process = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
