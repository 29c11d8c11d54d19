"""facenet-pytorch 2.6.0 in a throwaway folder, importable beside our torch.

facenet-pytorch pins an old torch, so it is never installed: its wheel (``make install`` puts it
in ``.cache/wheels``) is unpacked into a folder under ``.cache/bench`` together with a pure-torch
stand-in for the two torchvision functions it imports (``bench/torchvision_standin.py``), and that
folder goes on ``sys.path`` of the benchmark process only. Only ``facenet_pytorch.models.mtcnn``
is imported (the package's ``__init__`` also pulls in InceptionResnetV1, which needs ``requests``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

from bench.paths import REPO
from bench.timing import log

FNP_VERSION = "2.6.0"
DEFAULT_WHEEL = REPO / ".cache" / "wheels" / f"facenet_pytorch-{FNP_VERSION}-py3-none-any.whl"
DEFAULT_ENV = REPO / ".cache" / "bench" / f"facenet_pytorch-{FNP_VERSION}"
STANDIN_SOURCE = Path(__file__).resolve().parent / "torchvision_standin.py"
TORCHVISION_PYTHON = REPO / ".cache" / "bench" / "torchvision-venv" / "bin" / "python"

_STANDIN_PACKAGE = {
    "__init__.py": '"""Benchmark-only stand-in for torchvision (see bench/torchvision_standin.py)."""\n'
    "__standin__ = True\n__version__ = '0.0+bench-standin'\n",
    "ops/__init__.py": "from torchvision.ops.boxes import batched_nms, nms\n",
    "ops/boxes.py": "from torchvision._standin import batched_nms, nms\n",
    "transforms/__init__.py": "from torchvision.transforms import functional\n",
    "transforms/functional.py": "from torchvision._standin import to_tensor\n",
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_facenet_env(wheel: Path, env_dir: Path) -> dict[str, Any]:
    """Unpack the facenet-pytorch wheel into ``env_dir`` (once) and (re)write the stand-in."""
    if not wheel.is_file():
        raise SystemExit(
            f"facenet-pytorch wheel not found: {wheel}\n"
            f"run `make install` (it runs `pip download --no-deps facenet-pytorch=={FNP_VERSION}`)"
        )
    sha = _sha256(wheel)
    marker = env_dir / ".wheel-sha256"
    if not (marker.is_file() and marker.read_text().strip() == sha):
        log(f"unpacking {wheel.name} into {env_dir}")
        partial = env_dir.with_name(env_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(partial)
        (partial / ".wheel-sha256").write_text(sha + "\n")
        shutil.rmtree(env_dir, ignore_errors=True)
        partial.rename(env_dir)
    write_standin_package(env_dir)
    return {"wheel": str(wheel), "wheel_sha256": sha, "env_dir": str(env_dir)}


def write_standin_package(root: Path) -> Path:
    """``root/torchvision``: the stand-in as an importable package (files rewritten only when changed)."""
    package = root / "torchvision"
    files = {**_STANDIN_PACKAGE, "_standin.py": STANDIN_SOURCE.read_text()}
    for name, text in files.items():
        target = package / name
        if not (target.is_file() and target.read_text() == text):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    return package


def load_facenet(env_dir: Path):
    """Import facenet-pytorch's MTCNN class from ``env_dir``; returns (MTCNN, stand-in module)."""
    if "torchvision" in sys.modules:
        raise RuntimeError("torchvision is already imported; the stand-in cannot be used")
    sys.path.insert(0, str(env_dir))
    import torchvision  # the stand-in written by prepare_facenet_env

    if getattr(torchvision, "__standin__", False) is not True:
        raise RuntimeError(f"expected the benchmark's torchvision stand-in, got {torchvision.__file__}")
    # Register the package without running its __init__ (which imports requests for the
    # InceptionResnetV1 weights download); the MTCNN module only needs torch and torchvision.
    spec = importlib.util.spec_from_loader("facenet_pytorch", loader=None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(env_dir / "facenet_pytorch")]
    sys.modules["facenet_pytorch"] = package
    from facenet_pytorch.models.mtcnn import MTCNN
    from torchvision import _standin

    warnings.filterwarnings("ignore", module=r"facenet_pytorch\..*")
    return MTCNN, _standin
