"""The evaluation jobs' one report writer: JSON files, Markdown text and tables, PNG figures.

LFW, MegaFace and calibration (and the benchmarks) write through it, so every report is made the
same way: the folder is created when missing, JSON ends with a newline, and figures are drawn on
matplotlib's Agg canvas without pyplot (no global state, no display needed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """Write ``data`` as JSON (and a final newline) to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (e.g. a Markdown document) to ``path`` as it is, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def markdown_cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], numeric_from: int) -> list[str]:
    """A Markdown table's lines; columns from index ``numeric_from`` on are right-aligned."""
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(markdown_cell(h) for h in header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(markdown_cell(c) for c in row) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------


def new_axes(figsize: tuple[float, float], dpi: float | None = None) -> tuple[Any, Any]:
    """A Figure of ``figsize`` inches on the Agg canvas and its one Axes (``dpi``: matplotlib's
    default when None)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize) if dpi is None else Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def save_figure(fig: Any, path: str | Path, dpi: float | None = None) -> Path:
    """Lay the figure out tightly and write it to ``path`` as PNG (at ``dpi`` when given, else the
    figure's own), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    if dpi is None:
        fig.savefig(path)
    else:
        fig.savefig(path, dpi=dpi)
    return path
