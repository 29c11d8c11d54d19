"""Local redis-server processes on real servers: start/stop, crash safety of the AOF, the query engine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.commands.search.query import Query

from service.errors import RedisSetupError
from service.redis_server import (
    LocalRedis,
    ensure_libssl11,
    find_redis_server,
    has_query_engine,
    redis_stack_server_paths,
)
from tests.conftest import REDIS_STACK_CACHE, REPO_ROOT, short_temp_dir


@pytest.fixture
def data_dir():
    """A short folder under /tmp for servers a test starts itself."""
    path = short_temp_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_ping_stop(redis_server: LocalRedis, redis_client: redis.Redis):
    sock = redis_server.data_dir / "redis.sock"
    assert redis_server.url == f"unix://{sock}"
    assert redis_server.is_running()
    assert redis_client.ping()
    assert stat.S_IMODE(sock.stat().st_mode) == 0o700
    config = redis_client.config_get("*")
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] == "always"
    assert config["save"] == ""
    assert config["port"] == "0"
    assert Path(config["dir"]) == redis_server.data_dir
    assert (redis_server.data_dir / "redis.log").stat().st_size > 0

    redis_server.stop()
    assert not redis_server.is_running()
    assert not sock.exists()
    with pytest.raises(redis.ConnectionError):
        redis_client.ping()
    redis_server.stop()  # stopping twice is harmless


def test_context_manager_and_client(redis_server: LocalRedis, data_dir: Path):
    with LocalRedis(data_dir / "ctx", binary=redis_server.binary) as server:
        pid = server.pid
        client = server.client(decode_responses=True)
        client.set("k", "v")
        assert client.get("k") == "v"
        client.close()
    assert not server.is_running()
    assert not pid_alive(pid)


def test_data_survives_sigkill(redis_server: LocalRedis):
    client = redis_server.client()
    client.set("sf:subject", b"alice")
    client.hset("sf:face:1", mapping={"subject": "alice", "vec": np.arange(4, dtype=np.float32).tobytes()})
    for i in range(100):
        client.rpush("sf:list", i)
    client.close()

    pid = redis_server.pid
    redis_server.kill()  # SIGKILL: no shutdown, no final fsync
    assert not redis_server.is_running()
    assert not pid_alive(pid)

    with LocalRedis(redis_server.data_dir, binary=redis_server.binary) as again:
        client = again.client()
        assert client.get("sf:subject") == b"alice"
        face = client.hgetall("sf:face:1")
        assert face[b"subject"] == b"alice"
        assert np.array_equal(np.frombuffer(face[b"vec"], np.float32), np.arange(4, dtype=np.float32))
        assert client.llen("sf:list") == 100
        client.close()


def test_second_server_on_same_data_dir_is_refused(redis_server: LocalRedis):
    second = LocalRedis(redis_server.data_dir, binary=redis_server.binary)
    with pytest.raises(RedisSetupError, match="already running for data folder") as info:
        second.start()
    assert info.value.code == "redis_setup_failed"
    assert str(redis_server.data_dir) in info.value.message
    assert not second.is_running()
    # Nor on TCP: the lock is on the data folder, not the address.
    with pytest.raises(RedisSetupError, match="already running"):
        LocalRedis(redis_server.data_dir, binary=redis_server.binary, port=free_port()).start()
    assert redis_server.client().ping()


def test_server_outside_our_control_on_the_socket_is_refused(redis_server: LocalRedis, data_dir: Path):
    # A server someone else started on the socket of another data folder (no lock there).
    other = LocalRedis(data_dir / "other", binary=redis_server.binary)
    other.data_dir.mkdir()
    other.data_dir.joinpath("redis.sock").symlink_to(redis_server.data_dir / "redis.sock")
    with pytest.raises(RedisSetupError, match="already answers on"):
        other.start()


def test_restart_after_stop_on_same_dir(redis_server: LocalRedis):
    redis_server.client().set("a", 1)
    redis_server.stop()
    redis_server.start()
    assert redis_server.client().get("a") == b"1"


def test_missing_binary_gives_clear_error(data_dir: Path):
    server = LocalRedis(data_dir / "r", binary="/nonexistent/redis-server")
    with pytest.raises(RedisSetupError, match=r"/nonexistent/redis-server not found.*apt-get install"):
        server.start()
    assert not server.is_running()


def test_binary_that_exits_gives_error_with_log(data_dir: Path):
    fake = data_dir / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'fake server: cannot load libssl.so.1.1' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = LocalRedis(data_dir / "r", binary=str(fake))
    with pytest.raises(RedisSetupError, match=r"exited with code 3.*\n.*cannot load libssl"):
        server.start()
    # The lock was released: starting again is not refused as "already running".
    with pytest.raises(RedisSetupError, match="exited with code 3"):
        server.start()


def test_find_redis_server(monkeypatch: pytest.MonkeyPatch, data_dir: Path):
    if shutil.which("redis-server"):
        assert Path(find_redis_server()).name == "redis-server"
    monkeypatch.setenv("PATH", str(data_dir))
    with pytest.raises(RedisSetupError, match=r"not found on PATH.*apt-get install redis-server.*REDIS_URL"):
        find_redis_server()


def test_socket_path_too_long(redis_server: LocalRedis, data_dir: Path):
    deep = data_dir / ("d" * 100)
    with pytest.raises(RedisSetupError, match="longer than 107 bytes"):
        LocalRedis(deep, binary=redis_server.binary).start()


def test_tcp_mode(redis_server: LocalRedis, data_dir: Path):
    port = free_port()
    with LocalRedis(data_dir / "tcp", binary=redis_server.binary, port=port) as server:
        assert server.url == f"redis://127.0.0.1:{port}"
        assert server.socket_path is None
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert not (server.data_dir / "redis.sock").exists()
        client.close()
        # Another folder cannot take a port that already answers.
        with pytest.raises(RedisSetupError, match=f"already answers on 127.0.0.1:{port}"):
            LocalRedis(data_dir / "tcp2", binary=redis_server.binary, port=port).start()


def test_server_does_not_outlive_python(redis_server: LocalRedis, data_dir: Path):
    """The atexit safety net stops a server that the program forgot to stop."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from service.redis_server import LocalRedis
        server = LocalRedis(Path({str(data_dir / "orphan")!r}), binary={redis_server.binary!r}).start()
        server.client().set("k", "v")
        print(server.pid, flush=True)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True
    )
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    with LocalRedis(data_dir / "orphan", binary=redis_server.binary) as again:
        assert again.client().get("k") == b"v"


def test_server_stops_when_its_parent_is_killed(redis_server: LocalRedis, data_dir: Path):
    """SIGKILL runs no atexit handler: before, the server outlived a killed `sphereface serve`,
    and the next serve reused it without stopping it on exit."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from service.redis_server import LocalRedis
        server = LocalRedis(Path({str(data_dir / "killed")!r}), binary={redis_server.binary!r}).start()
        server.client().set("k", "v")
        print(server.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    with LocalRedis(data_dir / "killed", binary=redis_server.binary) as again:
        assert again.client().get("k") == b"v"  # SIGTERM: the AOF was fsynced on the way out


def test_debian_redis_has_no_query_engine(redis_client: redis.Redis):
    assert has_query_engine(redis_client) is False


def test_redis_stack_paths():
    binary, module = redis_stack_server_paths()
    assert binary.endswith("redis-stack-server/bin/redis-server")
    assert module.endswith("redis-stack-server/lib/redisearch.so")
    assert os.access(binary, os.X_OK)


def test_redis_stack_has_query_engine(redis_stack: LocalRedis, redis_stack_client: redis.Redis):
    assert has_query_engine(redis_stack_client) is True
    assert redis_stack_client.info("server")["redis_version"].startswith("7.4")
    assert redis_stack_client.config_get("appendfsync")["appendfsync"] == "always"
    # A tiny vector index and a KNN query: the query engine really works.
    client = redis_stack_client
    client.execute_command(
        "FT.CREATE", "t:idx", "ON", "HASH", "PREFIX", "1", "t:",
        "SCHEMA", "v", "VECTOR", "FLAT", "6", "TYPE", "FLOAT32", "DIM", "3", "DISTANCE_METRIC", "COSINE",
    )  # fmt: skip
    vectors = {"a": [1, 0, 0], "b": [0, 1, 0], "c": [0.9, 0.1, 0]}
    for name, vec in vectors.items():
        client.hset(f"t:{name}", mapping={"v": np.asarray(vec, np.float32).tobytes()})
    query = np.asarray([1, 0.05, 0], np.float32).tobytes()
    knn = Query("*=>[KNN 2 @v $q AS d]").sort_by("d").return_field("d").dialect(2)
    result = client.ft("t:idx").search(knn, query_params={"q": query})
    assert result.total == 2
    assert [doc.id for doc in result.docs] == ["t:a", "t:c"]


def test_redis_stack_client_starts_empty(redis_stack_client: redis.Redis):
    assert redis_stack_client.dbsize() == 0
    assert redis_stack_client.execute_command("FT._LIST") == []


def test_ensure_libssl11_reuses_cache(redis_stack: LocalRedis, monkeypatch: pytest.MonkeyPatch):
    """Once Redis Stack runs, OpenSSL 1.1 is on the system or in the cache: asking again fetches
    nothing (apt is never run) and names the same folder, which holds both libraries."""
    import service.redis_server as rs

    def no_fetch(*args, **kwargs):
        raise AssertionError(f"libssl1.1 fetched again: {args}")

    monkeypatch.setattr(rs, "_fetch_libssl11", no_fetch)
    monkeypatch.setattr(rs, "_run_apt", no_fetch)
    folder = ensure_libssl11(REDIS_STACK_CACHE)
    assert ensure_libssl11(REDIS_STACK_CACHE) == folder
    if folder is None:
        assert rs._system_has_libssl11()
    else:
        assert (folder / "libssl.so.1.1").exists() and (folder / "libcrypto.so.1.1").exists()
