"""Writing a job's report: one JSON file, its folder made when missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """Write ``data`` as JSON (and a final newline) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path
