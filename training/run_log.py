"""The face trainer's log: ``log.csv`` (one row per log interval, kept across resumes), read back
as columns, and the PNG of its curves."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from training.callbacks import Callback, Interval

LOG_COLUMNS = (
    "step", "epoch", "loss", "accuracy", "lambda", "mhe", "distill", "feature_norm", "lr", "images_per_s",
    "lfw_accuracy", "lfw_std", "elapsed_s",
)  # fmt: skip


class CsvLog(Callback):
    """Appends rows of :data:`LOG_COLUMNS` to ``log.csv`` (kept across resumes): every interval's,
    and the one that stopped a run (for its curves and tables)."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        rows = []
        if path.is_file():
            with path.open(newline="") as handle:
                rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= resume_step]
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, LOG_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, LOG_COLUMNS)
            writer.writerow({k: _fmt(row.get(k)) for k in LOG_COLUMNS})

    def on_interval(self, interval: Interval) -> None:
        self.write(interval.row)

    def on_stop(self, interval: Interval, error: BaseException) -> None:
        self.write(interval.row)


def _fmt(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def read_log(path: str | Path) -> dict[str, np.ndarray]:
    """``log.csv`` as columns of floats (NaN where a row has no value)."""
    with Path(path).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {k: np.array([float(r[k]) if r.get(k) else np.nan for r in rows]) for k in LOG_COLUMNS}


def plot_training_curves(log_path: str | Path, out: str | Path, title: str) -> Path:
    """Loss, training accuracy, mean feature norm, lambda / learning rate, LFW accuracy and the
    MHE term (when logged) against step (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = read_log(log_path)
    fig = Figure(figsize=(14, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    step = cols["step"]
    axes[0, 0].plot(step, cols["loss"], lw=1.2)
    axes[0, 0].set_title("training loss")
    axes[0, 1].plot(step, 100 * cols["accuracy"], lw=1.2)
    axes[0, 1].set_title("training accuracy (%, logits without margin)")
    axes[0, 2].plot(step, cols["feature_norm"], lw=1.2, color="tab:green")
    axes[0, 2].set_title("mean feature norm ||x||")
    axes[0, 2].set_ylim(bottom=0)
    has_mhe = np.isfinite(cols["mhe"])
    has_distill = np.isfinite(cols["distill"])
    if has_mhe.any():
        axes[1, 2].plot(step[has_mhe], cols["mhe"][has_mhe], lw=1.2, color="tab:purple")
        axes[1, 2].set_title("output-layer MHE term (unweighted)")
    elif has_distill.any():
        axes[1, 2].plot(step[has_distill], cols["distill"][has_distill], lw=1.2, color="tab:purple")
        axes[1, 2].set_title("distillation term: mean squared cosine gap (unweighted)")
    else:
        axes[1, 2].set_axis_off()
    ax = axes[1, 0]
    ax.plot(step, cols["lr"], lw=1.2, color="tab:blue", label="learning rate")
    ax.set_yscale("log")
    ax.set_title("learning rate and lambda")
    if (cols["lambda"] > 0).any():  # heads without a margin log lambda 0 or nothing
        twin = ax.twinx()
        twin.plot(step, np.where(cols["lambda"] > 0, cols["lambda"], np.nan), lw=1.2, color="tab:red")
        twin.set_yscale("log")
        twin.set_ylabel("lambda", color="tab:red")
    ax.set_ylabel("learning rate", color="tab:blue")
    has_lfw = np.isfinite(cols["lfw_accuracy"])
    axes[1, 1].plot(step[has_lfw], 100 * cols["lfw_accuracy"][has_lfw], "o-", lw=1.2)
    axes[1, 1].set_title("LFW 10-fold accuracy (%)")
    for a in axes.flat:
        if not a.axison:
            continue
        a.set_xlabel("step")
        a.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    return out
