"""Shared fixtures.

Tests that need the real data in ``../shared/data`` are marked ``shared_data``. When the data
is missing they FAIL in CI (environment variable ``CI`` set) and are skipped with a message
naming the missing path on a developer's machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
def reference_model_dir(mobilefacenet_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference MobileFaceNet imported into a model folder once per test session."""
    from models.importers import import_mobilefacenet

    out = tmp_path_factory.mktemp("models") / "mobilefacenet_casia"
    import_mobilefacenet(mobilefacenet_checkpoint, out)
    return out
