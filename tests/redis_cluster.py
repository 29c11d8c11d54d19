"""A real Redis Cluster for tests: 3 primaries and 3 replicas of Debian's ``redis-server``.

:class:`LocalCluster` starts six servers on free loopback ports (cluster mode, a short node
timeout, no persistence) in a temporary folder of its own, joins them with
``redis-cli --cluster create --cluster-replicas 1``, waits until every node reports
``cluster_state:ok`` with all 16384 slots covered and every replica has synced, and stops every
server it started (also at interpreter exit, and when Linux sees this process die: each server
gets a parent-death signal). :meth:`LocalCluster.add_node` and :meth:`LocalCluster.rebalance`
grow it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from service.supervision import set_parent_death_signal

SLOTS = 16384
NODE_TIMEOUT_MS = 1000


def _free_port(taken: set[int]) -> int:
    """A loopback port free now whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _die_with_parent() -> None:
    set_parent_death_signal(signal.SIGTERM)


class LocalCluster:
    """Six cluster-mode redis-servers (3 primaries, 3 replicas) on loopback; see the module docstring."""

    def __init__(self, server: str = "/usr/bin/redis-server", cli: str = "/usr/bin/redis-cli") -> None:
        self.server, self.cli = server, cli
        self.folder = Path(tempfile.mkdtemp(prefix="sfc"))
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen] = []
        self.startup_seconds = 0.0

    @property
    def startup_nodes(self) -> str:
        """The nodes as ``--redis-cluster`` takes them: ``HOST:PORT,HOST:PORT,...``."""
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        started = time.perf_counter()
        atexit.register(self.stop)
        try:
            taken: set[int] = set()
            for _ in range(6):
                port = _free_port(taken)
                taken |= {port, port + 10000}
                self.ports.append(port)
                self.processes.append(self._spawn(port))
            for port in self.ports:
                self._wait_ping(port, timeout)
            self._create()
            self._wait_ok(timeout)
            self._wait_synced(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started
        return self

    def _spawn(self, port: int) -> subprocess.Popen:
        folder = self.folder / str(port)
        folder.mkdir()
        # fmt: off
        args = [
            self.server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
            "--logfile", "redis.log", "--daemonize", "no", "--repl-diskless-sync-delay", "0",
        ]
        # fmt: on
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def _wait_ping(self, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {port} did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _create(self) -> None:
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        done = subprocess.run(
            [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")

    def _node_ok(self, port: int) -> bool:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
            info = client.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
        state = info.get("cluster_state")
        state = state.decode() if isinstance(state, bytes) else state
        return state == "ok" and int(info.get("cluster_slots_ok", 0)) == SLOTS

    def _wait_ok(self, timeout: float) -> None:
        """Until every node says the cluster is ok with every slot served, and sees 6 nodes."""
        deadline = time.monotonic() + timeout
        while not all(self._node_ok(port) and len(self.nodes(port)) == 6 for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def _wait_synced(self, timeout: float) -> None:
        """Until every replica has finished its first sync (WAIT counts only synced replicas)."""
        deadline = time.monotonic() + timeout
        replicas = [int(r["address"].rsplit(":", 1)[1]) for r in self.nodes() if "slave" in r["flags"]]
        while not all(self._synced(port) for port in replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not finish their first sync")
            time.sleep(0.05)

    def nodes(self, port: int | None = None) -> list[dict[str, str]]:
        """``CLUSTER NODES`` of one node: address, id, flags, primary (a replica's), slots ("a-b ...")."""
        port = port or (self.alive_ports() or self.ports)[0]
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
            parsed = client.execute_command(
                "CLUSTER NODES"
            )  # redis-py: {address: {node_id, flags, master_id, slots}}
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
        nodes = [ClusterNode("127.0.0.1", port) for port in self.ports]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def flush(self) -> None:
        """Empty every primary (the replicas follow)."""
        for row in self.nodes():
            if "master" in row["flags"]:
                host, port = row["address"].rsplit(":", 1)
                with redis.Redis(host=host, port=int(port)) as client:
                    client.flushall()

    def kill_node(self, address: str) -> None:
        """SIGKILL the server at ``host:port`` (a crash: its replica takes over after the node timeout)."""
        index = self.ports.index(int(address.rsplit(":", 1)[1]))
        self.processes[index].kill()
        self.processes[index].wait()

    def alive_ports(self) -> list[int]:
        pairs = zip(self.ports, self.processes, strict=True)
        return [port for port, process in pairs if process.poll() is None]

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every replica has every write its primary has (replication is asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            behind = []
            for row in self.nodes():
                if "master" not in row["flags"] or "fail" in row["flags"]:
                    continue
                host, port = row["address"].rsplit(":", 1)
                with redis.Redis(host=host, port=int(port)) as client:
                    info = client.info("replication")
                offset = info["master_repl_offset"]
                replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                behind += [r for r in replicas if int(r["offset"]) < offset]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas still behind after {timeout} s: {behind}")
            time.sleep(0.02)

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
        port = _free_port(set(self.ports) | {p + 10000 for p in self.ports})
        self.ports.append(port)
        self.processes.append(self._spawn(port))
        self._wait_ping(port, timeout)
        address = f"127.0.0.1:{port}"
        known = f"127.0.0.1:{self.alive_ports()[0]}"
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
            or (replica_of is not None and not self._synced(port))
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the new node {address} did not join")
            time.sleep(0.05)
        return address

    def _synced(self, port: int) -> bool:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
            info = client.info("replication")
        return info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")

    def rebalance(self) -> str:
        """``redis-cli --cluster rebalance --cluster-use-empty-masters``: slots move to primaries
        that have none, slot by slot, keys and all; returns its output."""
        known = f"127.0.0.1:{self.alive_ports()[0]}"
        return self._cli([self.cli, "--cluster", "rebalance", known, "--cluster-use-empty-masters"])

    def _cli(self, args: list[str]) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[1:3])} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        shutil.rmtree(self.folder, ignore_errors=True)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


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
