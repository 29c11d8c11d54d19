"""``sphereface serve`` and ``sphereface keys``: the service's processes and its Redis.

With ``SPHEREFACE_REDIS_CLUSTER`` (``--redis-cluster``) the gallery lives in that Redis Cluster.
With neither it nor ``REDIS_URL``, ``serve`` starts a local ``redis-server`` that keeps the
gallery in ``DATA_DIR/redis`` (append-only file, fsync on every write), starts it again when it
dies, and stops it on exit. On first start with API keys on and none configured, it creates an admin key
and writes it to ``DATA_DIR/admin.key`` (mode 0600).

One serve per data folder: ``DATA_DIR/serve.lock`` is held for the life of the process (see
:mod:`service.supervision`). The workers of ``--workers N`` and the local redis-server die with
the serve process, even when SIGKILL ends it (Linux).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from service.gallery import snapshot
from service.logs import uvicorn_log_config
from service.settings import Settings
from service.supervision import SUPERVISOR_PID_ENV, RedisWatcher, die_with_supervisor, lock_data_dir

log = logging.getLogger(__name__)

ADMIN_KEY_FILE = "admin.key"


def local_redis_dir(settings: Settings) -> Path:
    return Path(settings.data_dir).expanduser().absolute() / "redis"


@contextmanager
def gallery_redis(settings: Settings) -> Iterator[tuple[str, bool]]:
    """The Redis URL of the gallery: ``REDIS_URL``, a local server already running for the data
    folder, or a local server started for the duration. Yields (url, started)."""
    if settings.redis_url:
        yield settings.redis_url, False
        return
    from service.redis_server import LocalRedis

    folder = local_redis_dir(settings)
    server = LocalRedis(folder)
    if server.socket_path.exists():
        try:
            redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()
            yield server.url, False  # a `sphereface serve` of this data folder is running
            return
        except redis.RedisError:
            pass
    server.start()
    log.info("local redis-server for %s on %s (append-only file, fsync always)", folder, server.url)
    try:
        yield server.url, True
    finally:
        server.stop()


@contextmanager
def gallery_client_of(settings: Settings) -> Iterator[redis.Redis | RedisCluster]:
    """A client of the gallery's Redis for a command: the cluster of ``SPHEREFACE_REDIS_CLUSTER``,
    or the Redis of :func:`gallery_redis`; closed after."""
    from service.redis_clients import cluster_client

    settings.check_redis()
    if settings.redis_cluster:
        client = cluster_client(settings.cluster_nodes(), settings.redis_timeout)
        try:
            yield client
        finally:
            client.close()
        return
    with gallery_redis(settings) as (url, _), redis.Redis.from_url(url, protocol=2) as client:
        yield client


def ensure_admin_key(settings: Settings, client: redis.Redis | RedisCluster) -> Path | None:
    """First start with keys on and none anywhere: create an admin key, write it to a 0600 file."""
    from service.auth import create_key, list_keys

    if settings.auth == "off" or settings.api_key is not None or list_keys(client, settings.redis_prefix):
        return None
    key, info = create_key(client, "admin", name="bootstrap (sphereface serve)", prefix=settings.redis_prefix)
    path = Path(settings.data_dir).expanduser().absolute() / ADMIN_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    print(f"created admin API key {info.key_id}; it is in {path} (send it as header X-API-Key)", flush=True)
    return path


@contextmanager
def served_redis(settings: Settings) -> Iterator[str | None]:
    """The Redis URL of a serve process: ``REDIS_URL`` (None with a Redis Cluster, which the
    settings name), or a local redis-server that this process starts, watches (started again
    when it dies: :class:`~service.supervision.RedisWatcher`) and stops on the way out. A server
    of the data folder that this process did not start is refused
    (:class:`~service.errors.RedisSetupError`): it could not be restarted, and would stop when
    its owner, a ``keys`` or ``gallery`` command, ends."""
    if settings.redis_url or settings.redis_cluster:
        yield settings.redis_url
        return
    from service.redis_server import LocalRedis

    server = LocalRedis(local_redis_dir(settings)).start()
    log.info("local redis-server for %s on %s (append-only file, fsync always)", server.data_dir, server.url)
    watcher = RedisWatcher(server).start()
    try:
        yield server.url
    finally:
        watcher.stop()


def check_model(settings: Settings) -> None:
    """Fail before binding the port if the model is unknown, lacks its weights or is broken; warn
    when it has no calibrated thresholds."""
    from models.manifest import load_manifest

    manifest = load_manifest(settings.model_dir)
    if "verification" not in manifest.thresholds:
        log.warning("model %s has no calibrated thresholds: answers decide nothing", manifest.model_id)
    elif "identification" not in manifest.thresholds:
        log.warning(
            "model %s has no identification threshold: identify uses the verification one (FAR %g); "
            "run `sphereface calibrate --model %s`",
            manifest.model_id,
            manifest.thresholds["verification"].far,
            settings.model,
        )


def serve(
    host: str | None = None,
    port: int | None = None,
    model: str | None = None,
    data_dir: str | None = None,
    workers: int | None = None,
    redis_url: str | None = None,
    redis_cluster: str | None = None,
) -> int:
    """Start the service; flags override ``SPHEREFACE_*`` environment variables."""
    flags = {
        "host": host,
        "port": port,
        "model": model,
        "data_dir": data_dir,
        "workers": workers,
        "redis_url": redis_url,
        "redis_cluster": redis_cluster,
    }
    overrides = {k: v for k, v in flags.items() if v is not None}
    settings = Settings(**overrides)
    settings.check_redis()  # not both a URL and a cluster
    settings.webhook_endpoints()  # a bad SPHEREFACE_WEBHOOKS entry refuses the start (invalid_webhooks)
    # One serve per data folder. With REDIS_URL the folder still holds what this process writes
    # (the workers' metrics, the bootstrap admin key), so it is locked too when it can be written;
    # several serves share one REDIS_URL (or cluster) with a data folder each.
    lock = lock_data_dir(settings.data_dir, required=not (settings.redis_url or settings.redis_cluster))
    try:
        check_model(settings)
        # uvicorn finishes the requests in flight on SIGTERM or SIGINT (Ctrl-C), then raises the
        # signal again: leave through Python (the local redis-server is stopped on the way) with
        # status 0, a stop that was asked for.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGINT, _exit_on_signal)
        with served_redis(settings) as url:
            if url is not None:
                settings = settings.model_copy(update={"redis_url": url})
                overrides["redis_url"] = url
            with gallery_client_of(settings) as client:
                ensure_admin_key(settings, client)
            if settings.workers == 1:
                run_one_process(settings)
            else:
                run_workers(settings, overrides)
    finally:
        if lock is not None:
            os.close(lock)
    return 0


def run_one_process(settings: Settings) -> None:
    """Serve from this process (one worker)."""
    import uvicorn

    from service.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        log_config=uvicorn_log_config(),
    )


def run_workers(settings: Settings, overrides: dict) -> None:
    """Serve from ``settings.workers`` worker processes, each building its app from the environment
    (:func:`app_from_env`; ``overrides`` are the settings they get through it). They share the
    gallery's vectors through snapshots in /dev/shm (removed at exit) and die with this process."""
    import uvicorn

    own_snapshots = None
    if settings.gallery_snapshots is None and settings.search == "numpy":
        for stale in snapshot.remove_stale_roots():
            log.info("removed %s, left by a service that did not stop cleanly", stale)
        own_snapshots = snapshot.default_root(settings.workers)
        if own_snapshots is not None:
            overrides["gallery_snapshots"] = str(own_snapshots)
    for key, value in overrides.items():
        os.environ[f"SPHEREFACE_{key.upper()}"] = str(value)
    os.environ[SUPERVISOR_PID_ENV] = str(os.getpid())
    metrics_dir = Path(settings.data_dir).expanduser().absolute() / "metrics"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    try:
        uvicorn.run(
            "service.main:app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level="info",
            log_config=uvicorn_log_config(),
        )
    finally:
        if own_snapshots is not None:
            snapshot.remove_root(own_snapshots)


def _exit_on_signal(signum, _frame) -> None:
    log.info("stopped on %s", signal.Signals(signum).name)
    raise SystemExit(0)


def app_from_env():
    """The app of one worker of a multi-worker ``sphereface serve`` (settings from the environment).

    uvicorn calls this factory in each worker it spawns, before the app and its model load: the
    first code of the project that runs there. The worker asks for SIGTERM when its serve process
    dies (Linux), and exits at once if it already has (:func:`service.supervision.die_with_supervisor`)."""
    die_with_supervisor()
    from service.app import create_app

    return create_app(Settings())
