"""The pieces of service.supervision on real processes: the Redis watcher (restart, reaping,
back-off, stop), the data folder lock and the parent-death signal. No model, no service."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.processes import process_state, running, wait_for
from service.redis_server import LocalRedis
from service.supervision import (
    SERVE_LOCK_NAME,
    Backoff,
    RedisWatcher,
    ServeRunningError,
    lock_data_dir,
)
from tests.conftest import REPO_ROOT

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's"
)


def answers(server: LocalRedis) -> bool:
    return server.is_running() and server._ping(timeout=0.2)


def test_backoff_doubles_to_the_cap_and_starts_again_after_a_healthy_run():
    backoff = Backoff(first=0.5, cap=10.0, healthy_s=30.0)
    assert [backoff.next(ran_s=1.0) for _ in range(7)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert backoff.next(ran_s=30.0) == 0.5
    assert backoff.next(ran_s=0.1) == 1


@linux_only
def test_watcher_restarts_a_killed_server_on_the_same_socket_and_reaps_it(
    redis_server: LocalRedis, caplog: pytest.LogCaptureFixture
):
    redis_server.client().set("k", "v")
    watcher = RedisWatcher(redis_server, Backoff(first=0.2)).start()
    try:
        for restarts in (1, 2):
            old = redis_server.pid
            assert old is not None
            with caplog.at_level(logging.WARNING, logger="service.supervision"):
                os.kill(old, signal.SIGKILL)
                # counted once the restarted server answered the watcher
                assert wait_for(lambda n=restarts: watcher.restarts == n, 15)
            assert redis_server.pid != old and answers(redis_server)
            assert process_state(old) is None  # reaped, not a zombie
            assert redis_server.client().get("k") == b"v"  # the same socket and data
        assert "was killed by SIGKILL; restarting it in 0.2 s" in caplog.text
        assert "restarting it in 0.4 s" in caplog.text  # doubled
    finally:
        watcher.stop()
    assert not redis_server.is_running()
    assert not watcher._thread.is_alive()


def test_a_server_stopped_on_purpose_is_not_restarted(redis_server: LocalRedis):
    watcher = RedisWatcher(redis_server, Backoff(first=0.01)).start()
    pid = redis_server.pid
    redis_server.stop()  # e.g. by the exit handler, not through the watcher
    watcher._thread.join(5)
    assert not watcher._thread.is_alive()
    assert watcher.restarts == 0 and redis_server.pid == pid and not redis_server.is_running()
    watcher.stop()  # harmless afterwards


@linux_only
def test_restarted_server_dies_with_its_parent(redis_server: LocalRedis, workdir: Path):
    """The watcher thread starts the new server: it must die with the process all the same."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from service.redis_server import LocalRedis
        from service.supervision import Backoff, RedisWatcher
        server = LocalRedis(Path({str(workdir / "watched")!r}), binary={redis_server.binary!r}).start()
        RedisWatcher(server, Backoff(first=0.01)).start()
        first = server.pid
        os.kill(first, signal.SIGKILL)
        while server.pid == first or not server._ping():
            time.sleep(0.02)
        print(server.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pid = int(out.stdout.strip())
    gone = wait_for(lambda: not running(pid), 5)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone


def test_one_lock_per_data_folder_naming_its_holder(workdir: Path):
    fd = lock_data_dir(workdir / "d")
    try:
        assert (workdir / "d" / SERVE_LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ServeRunningError, match=f"pid {os.getpid()}") as info:
            lock_data_dir(workdir / "d")
        assert str(workdir / "d") in info.value.message and info.value.code == "serve_running"
    finally:
        os.close(fd)
    os.close(lock_data_dir(workdir / "d"))  # free once its holder lets go


def test_an_unwritable_folder_takes_no_lock_unless_required(workdir: Path):
    blocked = workdir / "file"
    blocked.write_text("")  # a file where the folder's parent should be
    assert lock_data_dir(blocked / "d", required=False) is None
    with pytest.raises(Exception, match="cannot lock data folder"):
        lock_data_dir(blocked / "d")


@linux_only
def test_a_process_dies_with_its_parent_or_exits_when_the_parent_is_already_gone():
    child = textwrap.dedent("""
        import sys, time
        from service.supervision import die_with_parent
        die_with_parent(int(sys.argv[1]))
        print("armed", flush=True)
        time.sleep(60)
    """)
    parent = textwrap.dedent(f"""
        import os, signal, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {child!r}, str(os.getpid())], stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"armed\\n"
        print(p.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run(
        [sys.executable, "-c", parent], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    pid = int(out.stdout.strip())
    gone = wait_for(lambda: not running(pid), 5)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone
    # a parent that is not this process's parent (any more): exit at once, with status 1
    late = subprocess.run([sys.executable, "-c", child, "1"], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert late.returncode == 1 and b"armed" not in late.stdout
