"""Local Redis Clusters of ``redis-server`` processes: the tests and the benchmarks start their
local clusters through :class:`LocalCluster`, and nothing else starts one.

:class:`LocalCluster` starts ``primaries x (1 + replicas)`` servers (3 primaries with a replica
each by default) on free loopback ports, in cluster mode with a short node timeout and no
persistence, in a temporary folder of its own; joins them with ``redis-cli --cluster create``;
waits until every node reports ``cluster_state:ok`` with all 16384 slots covered and sees every
node, and until every replica has finished its first sync (the gallery's writes wait for a replica
with ``WAIT``, which counts only synced replicas). It stops every server it started, also at
interpreter exit and when Linux sees this process die (each server gets a parent-death signal).
:meth:`LocalCluster.kill_node`, :meth:`LocalCluster.add_node` and :meth:`LocalCluster.rebalance`
crash, grow and reshard it. :func:`spawn_redis` starts one such server outside a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from service.redis_server import find_redis_server
from service.supervision import set_parent_death_signal

SLOTS = 16384
#: The cluster-node-timeout of a test cluster: a killed primary's replica takes over within ~1 s.
NODE_TIMEOUT_MS = 1000
HOST = "127.0.0.1"


def free_port(taken: Iterable[int] = ()) -> int:
    """A loopback port free now whose cluster bus port (port + 10000) is free too, neither in ``taken``."""
    taken = set(taken)
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as bus:
            try:
                bus.bind((HOST, port + 10000))
            except OSError:
                continue
        return port


def _die_with_parent() -> None:
    set_parent_death_signal(signal.SIGTERM)


def spawn_redis(binary: str, port: int, folder: Path, *options: str) -> subprocess.Popen:
    """One ``redis-server`` on ``HOST:port`` with its files in ``folder`` (created), no persistence
    (no RDB snapshots, no append-only file), ``options`` added; it gets SIGTERM when this process dies."""
    folder.mkdir(parents=True)
    # fmt: off
    args = [
        binary, "--port", str(port), "--bind", HOST, "--dir", str(folder),
        "--save", "", "--appendonly", "no", "--logfile", "redis.log", "--daemonize", "no",
        "--repl-diskless-sync-delay", "0", *options,
    ]
    # fmt: on
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def wait_ping(port: int, timeout: float) -> None:
    """Until the server on ``HOST:port`` answers PING; RuntimeError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with redis.Redis(host=HOST, port=port, socket_connect_timeout=0.2) as client:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.02)


def stop_processes(processes: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every one still running, then wait for each (SIGKILL after ``timeout`` seconds)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class LocalCluster:
    """Cluster-mode redis-servers on loopback (3 primaries, 1 replica each by default); see the
    module docstring. ``server`` defaults to the ``redis-server`` on PATH, ``cli`` to the
    ``redis-cli`` beside it."""

    def __init__(
        self,
        server: str | None = None,
        cli: str | None = None,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        prefix: str = "sfc",
    ) -> None:
        self.server = server or find_redis_server()
        self.cli = cli or str(Path(self.server).with_name("redis-cli"))
        self.primaries, self.replicas, self.node_timeout_ms = primaries, replicas, node_timeout_ms
        self.folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen] = []
        self.startup_seconds = 0.0

    @property
    def startup_nodes(self) -> str:
        """The nodes as ``--redis-cluster`` takes them: ``HOST:PORT,HOST:PORT,...``."""
        return ",".join(f"{HOST}:{port}" for port in self.ports)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        started = time.perf_counter()
        atexit.register(self.stop)
        try:
            for _ in range(self.primaries * (1 + self.replicas)):
                port = free_port([*self.ports, *(p + 10000 for p in self.ports)])
                self.ports.append(port)
                self.processes.append(self._spawn(port))
            for port in self.ports:
                wait_ping(port, timeout)
            self._create()
            self._wait_ok(timeout)
            self._wait_synced(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started
        return self

    def _spawn(self, port: int) -> subprocess.Popen:
        # fmt: off
        cluster = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", str(self.node_timeout_ms))
        # fmt: on
        return spawn_redis(self.server, port, self.folder / str(port), *cluster)

    def _create(self) -> None:
        nodes = [f"{HOST}:{port}" for port in self.ports]
        replicas = ("--cluster-replicas", str(self.replicas), "--cluster-yes")
        self._cli([self.cli, "--cluster", "create", *nodes, *replicas])

    def _node_ok(self, port: int) -> bool:
        with redis.Redis(host=HOST, port=port, socket_timeout=1) as client:
            info = client.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
        state = info.get("cluster_state")
        state = state.decode() if isinstance(state, bytes) else state
        return state == "ok" and int(info.get("cluster_slots_ok", 0)) == SLOTS

    def _wait_ok(self, timeout: float) -> None:
        """Until every node says the cluster is ok with every slot served, and sees every node."""
        deadline = time.monotonic() + timeout
        count = len(self.ports)
        while not all(self._node_ok(port) and len(self.nodes(port)) == count for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def _wait_synced(self, timeout: float) -> None:
        """Until every replica is known to every node's view and acknowledges a write of its
        primary (the gallery's writes wait for one with WAIT, which counts only replicas past their
        first sync; and the first WAIT after that sync may still time out)."""
        deadline = time.monotonic() + timeout
        while not self._replicas_acknowledge():
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not finish their first sync")
            time.sleep(0.05)

    def _replicas_acknowledge(self) -> bool:
        """Each primary empties itself (a new cluster holds nothing) and WAITs for its replicas."""
        rows = self.nodes()
        if sum("slave" in row["flags"] for row in rows) < self.primaries * self.replicas:
            return False  # the first node does not know every replica as one yet
        for row in rows:
            count = sum(other["primary"] == row["id"] for other in rows)
            if "master" not in row["flags"] or not count:
                continue
            with redis.Redis(host=HOST, port=_port_of(row["address"]), socket_timeout=2) as client:
                client.flushall()
                if int(client.execute_command("WAIT", count, 200)) < count:
                    return False
        return True

    def _replica_ready(self, port: int, primary: int) -> bool:
        with redis.Redis(host=HOST, port=port, socket_timeout=1) as client:
            info = client.info("replication")
        if info.get("master_link_status") != "up" or info.get("master_sync_in_progress"):
            return False
        with redis.Redis(host=HOST, port=primary, socket_timeout=1) as client:
            seen = client.info("replication")
        replicas = [v for k, v in seen.items() if k.startswith("slave") and isinstance(v, dict)]
        return any(int(r["port"]) == port and r["state"] == "online" for r in replicas)

    def nodes(self, port: int | None = None) -> list[dict[str, str]]:
        """``CLUSTER NODES`` of one node: address, id, flags, primary (a replica's), slots ("a-b ...")."""
        port = port or (self.alive_ports() or self.ports)[0]
        with redis.Redis(host=HOST, port=port, socket_timeout=1) as client:
            parsed = client.execute_command("CLUSTER NODES")  # redis-py: {address: {node_id, flags, ...}}
        return [
            {
                "address": address.split("@")[0],
                "id": node["node_id"],
                "flags": node["flags"],
                "primary": node["master_id"],
                "slots": " ".join("-".join(span) for span in node["slots"]),
            }
            for address, node in parsed.items()
        ]

    def client(self, **kwargs) -> RedisCluster:
        nodes = [ClusterNode(HOST, port) for port in self.ports]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def flush(self) -> None:
        """Empty every primary (the replicas follow)."""
        for row in self.nodes():
            if "master" in row["flags"]:
                with redis.Redis(host=HOST, port=_port_of(row["address"])) as client:
                    client.flushall()

    def kill_node(self, address: str) -> None:
        """SIGKILL the server at ``host:port`` (a crash: its replica takes over after the node timeout)."""
        index = self.ports.index(_port_of(address))
        self.processes[index].kill()
        self.processes[index].wait()

    def alive_ports(self) -> list[int]:
        pairs = zip(self.ports, self.processes, strict=True)
        return [port for port, process in pairs if process.poll() is None]

    def wait_replicated(self, timeout: float = 10.0, poll: float = 0.02) -> None:
        """Until every replica has every write its primary has (replication is asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            behind = []
            for row in self.nodes():
                if "master" not in row["flags"] or "fail" in row["flags"]:
                    continue
                with redis.Redis(host=HOST, port=_port_of(row["address"])) as client:
                    info = client.info("replication")
                offset = info["master_repl_offset"]
                replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                behind += [r for r in replicas if int(r["offset"]) < offset]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas still behind after {timeout} s: {behind}")
            time.sleep(poll)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok with every slot served (after a failover)."""
        deadline = time.monotonic() + timeout
        while not all(self._node_ok(port) for port in self.alive_ports()):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come back to cluster_state:ok")
            time.sleep(0.05)

    def add_node(self, replica_of: str | None = None, timeout: float = 30.0) -> str:
        """Start one more server and join it (``redis-cli --cluster add-node``): as a replica of
        the primary at ``replica_of`` (``host:port``), synced with it, or as a primary without
        slots (:meth:`rebalance` gives it some). Returns its ``host:port``."""
        port = free_port([*self.ports, *(p + 10000 for p in self.ports)])
        self.ports.append(port)
        self.processes.append(self._spawn(port))
        wait_ping(port, timeout)
        address = f"{HOST}:{port}"
        known = f"{HOST}:{self.alive_ports()[0]}"
        args = [self.cli, "--cluster", "add-node", address, known]
        if replica_of is not None:
            primary = next(row["id"] for row in self.nodes() if row["address"] == replica_of)
            args += ["--cluster-slave", "--cluster-master-id", primary]
        self._cli(args)
        deadline = time.monotonic() + timeout
        alive = self.alive_ports()
        while (
            not all(any(r["address"] == address for r in self.nodes(p)) for p in alive)
            or not self._node_ok(port)
            or (replica_of is not None and not self._replica_ready(port, _port_of(replica_of)))
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the new node {address} did not join")
            time.sleep(0.05)
        return address

    def rebalance(self) -> str:
        """``redis-cli --cluster rebalance --cluster-use-empty-masters``: slots move to primaries
        that have none, slot by slot, keys and all; returns its output."""
        known = f"{HOST}:{self.alive_ports()[0]}"
        return self._cli([self.cli, "--cluster", "rebalance", known, "--cluster-use-empty-masters"])

    def _cli(self, args: list[str]) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args[1:3])} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def stop(self, timeout: float = 5.0) -> None:
        stop_processes(self.processes, timeout)
        self.processes = []
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        shutil.rmtree(self.folder, ignore_errors=True)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]
