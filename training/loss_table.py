"""The loss comparison table: runs' ``summary.json`` -> one Markdown table and one JSON.

Usage (after training the runs, e.g. ``make loss-table``)::

    python -m training.loss_table runs/celeba/sf4_* --json docs/results/loss_table.json \\
        --markdown docs/results/loss_table.md

New runs can be added to a committed table whose run folders are gone (``--keep``)::

    python -m training.loss_table runs/celeba_more/sf4_sphereface_plus_mhe10 \\
        --keep docs/results/loss_table.json --json docs/results/loss_table.json

Columns: LFW 10-fold accuracy (official protocol, crops aligned with our MTCNN's landmarks as the
training data, PyTorch features), the
angular Fisher score of the LFW features (Eq. A.1, people with 2+ images; lower = more
discriminative), and the hyperspherical energy of the classifier weights (normalised E_2 and
E_0, thesis Eq. 5.1, lower = more spread out), plus the minimum / nearest-neighbour angle
between classifier neurons, the final training accuracy and mean feature norm ||x||. A run the
trainer stopped (``stopped.json``: the loss became NaN, or the features collapsed) gets a row
that says at which step and why, without measures, and its curves up to the stop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

#: Row order of the table (paper order: Table A.1 then SphereFace+).
ORDER = (
    ("softmax", None),
    ("modified_softmax", None),
    ("asoftmax", 1),
    ("asoftmax", 2),
    ("asoftmax", 3),
    ("asoftmax", 4),
    ("sphereface_plus", 2),
    ("sphereface_plus", 4),
    ("cosface", None),
    ("arcface", None),
)


#: The learning rate of every from-scratch row (``training/configs/celeba_more/base.toml``); a row
#: trained at another one says so in its label.
TABLE_LR = 0.025


def _label(summary: dict[str, Any]) -> str:
    label = _head_label(summary)
    lr = summary.get("base_lr")
    if lr is not None and not summary.get("init_from") and abs(lr - TABLE_LR) > 1e-12:
        label += f", lr {lr:g}"
    if summary.get("seed"):
        label += f", seed {summary['seed']}"
    if summary.get("init_from"):
        label += f", fine-tuned from {Path(summary['init_from']).parent.name} ({summary['steps']} more steps)"
    return label


def _head_label(summary: dict[str, Any]) -> str:
    head, options = summary["head"], summary.get("head_options", {})
    if head == "softmax":
        return "softmax"
    if head == "modified_softmax":
        return "modified softmax"
    if head == "asoftmax":
        backward = ", the Caffe layer's backward" if options.get("backward") == "caffe" else ""
        return f"A-Softmax m = {options.get('m', 4)}{backward}"
    if head == "sphereface_plus":
        form = ", the Caffe layer's update" if options.get("mhe_form") == "caffe_among" else ""
        return f"SphereFace+ (m = {options.get('m', 4)}, MHE weight {options.get('mhe_weight', 1.0)}{form})"
    if head == "cosface":
        return f"CosFace (s = {options.get('scale', 30.0):g}, m = {options.get('margin', 0.35):g})"
    if head == "arcface":
        return f"ArcFace (s = {options.get('scale', 30.0):g}, m = {options.get('margin', 0.5):g})"
    return head


def _order_key(summary: dict[str, Any]) -> tuple[float, ...]:
    """Paper order, SphereFace+ by rising MHE weight, the Caffe layer's backward after the exact
    gradient; fine-tuned runs after the runs trained from scratch."""
    options = summary.get("head_options", {})
    key = (summary["head"], options.get("m"))
    offset = len(ORDER) + 1 if summary.get("init_from") else 0
    mhe_weight = float(options.get("mhe_weight", 0.0))
    caffe = 1 if options.get("backward") == "caffe" else 0
    lower_lr = -float(summary.get("base_lr") or TABLE_LR)
    for i, (head, m) in enumerate(ORDER):
        if key[0] == head and (m is None or key[1] == m):
            return offset + i, mhe_weight, caffe, lower_lr
    return offset + len(ORDER), mhe_weight, caffe, lower_lr


#: Written into a run folder by ``make loss-table``: ``sphereface evaluate megaface --protocol local``.
MEGAFACE_FILE = "megaface_local.json"


def megaface_rank1(run: Path) -> tuple[float | None, int | None]:
    """Rank-1 identification rate at the largest distractor count of the run's local-v1 report."""
    path = run / MEGAFACE_FILE
    if not path.is_file():
        return None, None
    identification = json.loads(path.read_text())["results"]["raw"]["identification"]
    largest = max(identification, key=int)
    return identification[largest]["rank1"], int(largest)


def run_summary(run: Path) -> dict[str, Any]:
    """The run's ``summary.json``; for a run the trainer stopped (``stopped.json``: a NaN loss or
    collapsed features), what its ``config.toml`` and ``stopped.json`` say, with ``stopped``."""
    from training.health import STOPPED_NAME

    path = run / "summary.json"
    config_path = run / "config.toml"
    config = tomllib.loads(config_path.read_text()) if config_path.is_file() else {}
    if path.is_file():
        return {**json.loads(path.read_text()), "base_lr": config.get("lr")}
    if not (run / STOPPED_NAME).is_file():
        raise FileNotFoundError(f"{path}: the run has not finished (no summary.json)")
    stopped = json.loads((run / STOPPED_NAME).read_text())
    keys = ("name", "network", "head", "head_options", "init_from", "seed", "steps", "batch_size")
    return {**{key: config.get(key) for key in keys}, "base_lr": config.get("lr"), "stopped": stopped}


def _stopped_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The table row of a stopped run: its label says where and why; no measures."""
    stopped = summary["stopped"]
    why = stopped["message"].split(";")[0]
    return {
        "run": summary["name"],
        "loss": f"{_label(summary)}, stopped: {why}",
        "network": summary["network"],
        "steps": summary["steps"],
        "batch_size": summary["batch_size"],
        "stopped_at": stopped["step"],
        "stop_reason": stopped["reason"],
        **{key: None for key in MEASURES},
        "seed": summary.get("seed"),
        "order": list(_order_key(summary)),
    }


#: The measured columns of a row (None in the row of a stopped run).
MEASURES = (
    "epochs", "lfw_accuracy", "lfw_std", "angular_fisher_score", "megaface_local_rank1",
    "megaface_distractors", "classifier_energy_s2", "classifier_energy_s0", "classifier_min_angle_deg",
    "classifier_nearest_mean_deg", "final_train_accuracy", "final_feature_norm",
)  # fmt: skip


def collect(run_dirs: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for run in run_dirs:
        summary = run_summary(run)
        if "stopped" in summary:
            rows.append(_stopped_row(summary))
            continue
        lfw = summary.get("lfw") or {}
        angles = summary.get("classifier_angles_deg", {})
        rank1, distractors = megaface_rank1(run)
        rows.append(
            {
                "run": summary["name"],
                "loss": _label(summary),
                "network": summary["network"],
                "steps": summary["steps"],
                "batch_size": summary["batch_size"],
                "epochs": summary["epochs"],
                "lfw_accuracy": lfw.get("accuracy"),
                "lfw_std": lfw.get("std"),
                "angular_fisher_score": lfw.get("angular_fisher_score"),
                "megaface_local_rank1": rank1,
                "megaface_distractors": distractors,
                "classifier_energy_s2": summary.get("classifier_energy_s2"),
                "classifier_energy_s0": summary.get("classifier_energy_s0"),
                "classifier_min_angle_deg": angles.get("min_deg"),
                "classifier_nearest_mean_deg": angles.get("nearest_mean_deg"),
                "final_train_accuracy": summary["final"].get("accuracy"),
                "final_feature_norm": summary["final"].get("feature_norm"),
                "seed": summary.get("seed"),
                "num_images": summary.get("num_images"),
                "num_classes": summary.get("num_classes"),
                "train_images_per_s": summary.get("mean_images_per_s"),
                "order": list(_order_key(summary)),
            }
        )
    rows.sort(key=lambda r: r["order"])
    return rows


def merge_rows(kept: list[dict[str, Any]], new: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The rows of an earlier table (``kept``, e.g. the committed JSON, whose run folders may be
    gone) with ``new`` rows added; a new row replaces a kept row of the same run. Paper order."""
    unordered = [r.get("run", "?") for r in kept if "order" not in r]
    if unordered:
        raise ValueError(
            f"{source}: rows {unordered} have no 'order' (written before tables kept it); "
            "rebuild that table from its runs instead"
        )
    replaced = {r["run"] for r in new}
    rows = [r for r in kept if r["run"] not in replaced] + list(new)
    rows.sort(key=lambda r: tuple(r["order"]))
    return rows


def _num(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| Loss | LFW accuracy (%) | MegaFace local-v1 rank-1 (%) | AFS of LFW features ↓ "
        "| Classifier energy E₂ ↓ | E₀ ↓ "
        "| Min / mean-nearest angle between classifier neurons (°) | Final train acc. (%) | Final ‖x‖ |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        acc = "–"
        if r["lfw_accuracy"] is not None:
            acc = f"{100 * r['lfw_accuracy']:.2f}"
            if r.get("lfw_std") is not None:
                acc += f" ± {100 * r['lfw_std']:.2f}"
        train_acc = None if r["final_train_accuracy"] is None else 100 * r["final_train_accuracy"]
        min_angle, nearest = r["classifier_min_angle_deg"], r["classifier_nearest_mean_deg"]
        angles = f"{_num(min_angle, '.1f')} / {_num(nearest, '.1f')}"
        rank1 = None if r["megaface_local_rank1"] is None else 100 * r["megaface_local_rank1"]
        lines.append(
            f"| {r['loss']} | {acc} | {_num(rank1, '.2f')} | {_num(r['angular_fisher_score'], '.4f')} "
            f"| {_num(r['classifier_energy_s2'], '.4f')} | {_num(r['classifier_energy_s0'], '.4f')} "
            f"| {angles} | {_num(train_acc, '.1f')} | {_num(r['final_feature_norm'], '.1f')} |"
        )
    return head + "\n".join(lines) + "\n"


def _steps_before(summary: dict[str, Any]) -> int:
    """Steps of the run a fine-tuned run started from (its summary beside the checkpoint), else 0."""
    source = summary.get("init_from")
    if not source:
        return 0
    path = Path(source)
    path = (path if path.is_dir() else path.parent) / "summary.json"
    return int(json.loads(path.read_text())["steps"]) if path.is_file() else 0


def curve_series(summary: dict[str, Any], cols: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """x (steps, after the source run's for a fine-tuned run), classification loss (the logged loss
    without SphereFace+'s weighted MHE term), accuracy in % and ||x|| of one run's log."""
    import numpy as np

    loss = np.asarray(cols["loss"], dtype=float)
    weight = float(summary.get("head_options", {}).get("mhe_weight", 0.0))
    if summary.get("head") == "sphereface_plus" and weight:
        loss = loss - weight * np.nan_to_num(np.asarray(cols["mhe"], dtype=float))
    steps = np.asarray(cols["step"]) + _steps_before(summary)
    return steps, loss, 100 * np.asarray(cols["accuracy"]), np.asarray(cols["feature_norm"])


def plot_curves(run_dirs: list[Path], out: Path) -> Path:
    """Classification loss, accuracy and mean feature norm ||x|| of every run against step, one PNG;
    a fine-tuned run continues where the run it started from ended."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from training.run_log import read_log

    fig = Figure(figsize=(15, 4.6), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    titles = (
        "training loss (without the MHE term)", "training accuracy (%, logits without margin)",
        "mean feature norm ||x||",
    )  # fmt: skip
    for run in run_dirs:
        summary = run_summary(run)
        steps, *series = curve_series(summary, read_log(run / "log.csv"))
        label = _label(summary)
        style = "--" if summary.get("seed") else "-"
        for ax, values in zip(axes, series, strict=True):
            ax.plot(steps, values, style, lw=1.2, label=label)
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[2].set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_rows = (len(labels) + 1) // 2
    fig.set_figheight(4.6 + 0.22 * legend_rows)
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * legend_rows / fig.get_figheight() + 0.02, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the loss comparison table from finished runs")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with summary.json)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of every run's loss, accuracy and ||x||")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="a table's JSON whose rows stay (their runs need not be here); the runs given add rows "
        "or replace the rows of the same run (e.g. --keep docs/results/loss_table.json)",
    )
    args = parser.parse_args(argv)
    rows = collect(args.runs)
    if args.keep:
        rows = merge_rows(json.loads(args.keep.read_text()), rows, str(args.keep))
    if args.plot:
        plot_curves(args.runs, args.plot)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
