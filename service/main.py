"""``sphereface serve`` and ``sphereface keys``: the service's processes and its Redis.

With no ``REDIS_URL``, ``serve`` starts a local ``redis-server`` that keeps the gallery in
``DATA_DIR/redis`` (append-only file, fsync on every write) and stops it on exit. On first start
with API keys on and none configured, it creates an admin key and writes it to
``DATA_DIR/admin.key`` (mode 0600).
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

from service.gallery import snapshot
from service.logs import uvicorn_log_config
from service.settings import Settings

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


def ensure_admin_key(settings: Settings, client: redis.Redis) -> Path | None:
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


def serve(
    host: str | None = None,
    port: int | None = None,
    model: str | None = None,
    data_dir: str | None = None,
    workers: int | None = None,
) -> int:
    """Start the service; flags override ``SPHEREFACE_*`` environment variables."""
    import uvicorn

    from models.manifest import load_manifest

    flags = {"host": host, "port": port, "model": model, "data_dir": data_dir, "workers": workers}
    overrides = {k: v for k, v in flags.items() if v is not None}
    settings = Settings(**overrides)
    # Fail before binding the port if the model is unknown, lacks its weights or is broken.
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
    # uvicorn finishes the requests in flight on SIGTERM or SIGINT (Ctrl-C), then raises the signal
    # again: leave through Python (the local redis-server is stopped on the way) with status 0, a
    # stop that was asked for.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    with gallery_redis(settings) as (url, _):
        settings = settings.model_copy(update={"redis_url": url})
        with redis.Redis.from_url(url, protocol=2) as client:
            ensure_admin_key(settings, client)
        if settings.workers == 1:
            from service.app import create_app

            uvicorn.run(
                create_app(settings),
                host=settings.host,
                port=settings.port,
                log_level="info",
                log_config=uvicorn_log_config(),
            )
            return 0
        # Several workers: each builds its app from the environment (service.main:app_from_env).
        # They share the gallery's vectors through snapshots in /dev/shm (removed at exit).
        own_snapshots = None
        if settings.gallery_snapshots is None and settings.search == "numpy":
            for stale in snapshot.remove_stale_roots():
                log.info("removed %s, left by a service that did not stop cleanly", stale)
            own_snapshots = snapshot.default_root(settings.workers)
            if own_snapshots is not None:
                overrides["gallery_snapshots"] = str(own_snapshots)
        for key, value in {**overrides, "redis_url": url}.items():
            os.environ[f"SPHEREFACE_{key.upper()}"] = str(value)
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
    return 0


def _exit_on_signal(signum, _frame) -> None:
    log.info("stopped on %s", signal.Signals(signum).name)
    raise SystemExit(0)


def app_from_env():
    """The app of one worker of a multi-worker ``sphereface serve`` (settings from the environment)."""
    from service.app import create_app

    return create_app(Settings())
