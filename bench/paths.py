"""Where the benchmarks find the repository, the shared data and short temporary folders."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The real data (photos, LFW, CelebA faces, reference checkpoints): ``$SPHEREFACE_SHARED_DATA``,
#: else ``../shared/data`` beside the repository.
SHARED_DATA = Path(os.environ.get("SPHEREFACE_SHARED_DATA", REPO.parent / "shared" / "data"))


def short_temp_dir() -> Path:
    """A fresh folder under /tmp with a short path (a unix socket path must fit in 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="sfr"))
