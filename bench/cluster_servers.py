"""The Redis layouts bench/cluster.py compares: one plain redis-server, or a Redis Cluster of
cluster-mode redis-servers (``primaries`` primaries, each with ``replicas`` replicas), all on loopback
TCP with the same settings (no persistence: no RDB snapshots, no append-only file)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from service.redis_server import find_redis_server

SLOTS = 16384


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


def _free_ports(count: int) -> list[int]:
    """``count`` loopback ports free now, each with its cluster bus port (port + 10000) free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class Layout:
    """Running redis-servers of one layout; :meth:`stop` ends every one of them."""

    name: str
    primaries: int  # 1 and not ``cluster``: a plain redis-server
    replicas: int = 0
    cluster: bool = False
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sf-bench-cluster-")))
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def spec(self) -> LayoutSpec:
        return LayoutSpec(self.name, self.cluster, tuple(self.ports))

    def describe(self) -> str:
        if not self.cluster:
            return "1 plain redis-server"
        replicas = f", {self.replicas} replica(s) each" if self.replicas else ", no replicas"
        return f"Redis Cluster: {self.primaries} primaries{replicas}"

    def start(self, timeout: float = 60.0) -> Layout:
        nodes = self.primaries * (1 + self.replicas) if self.cluster else 1
        binary = find_redis_server()
        try:
            self.ports = _free_ports(nodes)
            self.processes = [self._spawn(binary, port) for port in self.ports]
            for port in self.ports:
                _wait_ping(port, timeout)
            if self.cluster:
                self._create()
                self._wait_ok(timeout)
                self._wait_synced(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, binary: str, port: int) -> subprocess.Popen:
        folder = self.folder / str(port)
        folder.mkdir()
        # fmt: off
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                "--save", "", "--appendonly", "no", "--logfile", "redis.log", "--daemonize", "no",
                "--repl-diskless-sync-delay", "0"]
        # fmt: on
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL)

    def _create(self) -> None:
        cli = str(Path(find_redis_server()).with_name("redis-cli"))
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        args = [cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for port in self.ports:
                with redis.Redis(host="127.0.0.1", port=port) as client:
                    info = client.execute_command("CLUSTER INFO")
                states.append(
                    info.get("cluster_state") in ("ok", b"ok")
                    and int(info.get("cluster_slots_ok", 0)) == SLOTS
                    and int(info.get("cluster_known_nodes", 0)) == len(self.ports)
                )
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.describe()} did not reach cluster_state:ok")
            time.sleep(0.05)

    def _wait_synced(self, timeout: float) -> None:
        """Until every replica has finished its first sync: the gallery's writes wait for a replica
        (``WAIT``, :mod:`service.gallery.writes`), and WAIT counts only synced replicas."""
        deadline = time.monotonic() + timeout
        while self.replicas:
            synced = []
            for port in self.ports:
                with redis.Redis(host="127.0.0.1", port=port) as client:
                    info = client.info("replication")
                if info["role"] != "master":
                    up = info.get("master_link_status") == "up"
                    synced.append(up and not info.get("master_sync_in_progress"))
            if len(synced) == self.primaries * self.replicas and all(synced):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas of {self.describe()} did not finish their first sync")
            time.sleep(0.05)

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
        for process in self.processes:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        return total / os.sysconf("SC_CLK_TCK")

    def wait_replicated(self, timeout: float = 600.0) -> None:
        """Until every replica has its primary's whole replication stream."""
        deadline = time.monotonic() + timeout
        while self.replicas:
            behind = False
            for port in self.ports:
                with redis.Redis(host="127.0.0.1", port=port) as client:
                    info = client.info("replication")
                if info["role"] != "master":
                    continue
                offsets = [
                    int(v["offset"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                ]
                behind |= any(o < int(info["master_repl_offset"]) for o in offsets)
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas of {self.describe()} still behind after {timeout} s")
            time.sleep(0.2)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        shutil.rmtree(self.folder, ignore_errors=True)


def _wait_ping(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.02)
