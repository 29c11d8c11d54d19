"""The tables and curves of docs/results/hyperspherical.md (discussed in
docs/results/hyperspherical-claims.md), from finished runs (``make hyperspherical-table``).

Usage::

    python -m training.hyperspherical_table --runs runs/hyperspherical --out docs/results

Reads ``runs/hyperspherical/cifar/*/summary.json`` (CIFAR-10 runs of ``sphereface train``) and the
face runs (``runs/hyperspherical/sf4_*`` against the loss table's ``runs/celeba_more/sf4_asoftmax_m4*``,
or its committed ``docs/results/loss_table.json`` where those runs are not here)
and writes ``hyperspherical.md`` (Markdown tables), ``hyperspherical.json`` (every number) and PNG
curves: ``hyperspherical_convergence.png`` (Table 1's operators, softmax loss),
``hyperspherical_norm_b{4,16}.png`` (SphereNorm against BN), ``hyperspherical_deep.png`` (CNN-45)
and ``hyperspherical_faces.png``. A cell with two seeds shows their mean and both values.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from training.cifar import plot_cifar_curves
from training.loss_table import megaface_rank1

OPERATORS = (
    ("conv", "original conv"),
    ("cosine", "cosine SphereConv"),
    ("linear", "linear SphereConv"),
    ("sigmoid", "sigmoid (k = 0.3) SphereConv"),
)
HEADS = (("softmax", "softmax"), ("wsoftmax", "cosine W-Softmax"), ("gasoftmax", "linear GA-Softmax (m = 4)"))
NORM_ROWS = (
    ("bn", "BatchNorm"),
    ("spherenorm", "SphereNorm"),
    ("spherenorm_bn", "SphereNorm + BatchNorm"),
    ("spherenorm_rescaled", "rescaled SphereNorm"),
    ("nonorm", "no normalisation"),
)
FACE_BASELINES = ("sf4_asoftmax_m4", "sf4_asoftmax_m4_seed1")
LOSS_TABLE_CONFIGS = Path(__file__).resolve().parent / "configs" / "celeba_more"


def load_cifar_runs(root: Path) -> dict[str, dict[str, Any]]:
    """``{run name: summary}`` of every finished CIFAR-10 run under ``root``."""
    runs = {}
    for path in sorted(root.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        summary["run_dir"] = str(path.parent)
        runs[summary["name"]] = summary
    return runs


def seeds_of(runs: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The run ``name`` and its ``name_seedN`` repeats, seed order."""
    pattern = re.compile(rf"^{re.escape(name)}(_seed\d+)?$")
    return [runs[k] for k in sorted(runs) if pattern.match(k)]


def _cell(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not summaries:
        return None
    accs = [100 * s["test_accuracy"] for s in summaries]
    return {
        "mean": float(np.mean(accs)),
        "values": accs,
        "seconds_per_step": float(np.mean([s["seconds_per_step"] for s in summaries])),
    }


def _fmt_cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "–"
    if len(cell["values"]) == 1:
        return f"{cell['mean']:.2f}"
    return f"**{cell['mean']:.2f}** ({' / '.join(f'{v:.2f}' for v in cell['values'])})"


def table1(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Operator x loss test accuracies (SphereNet Table 1 subset) and the two comparisons it decides."""
    cells = {
        op: {head: _cell(seeds_of(runs, f"cnn9_{op}_{head}")) for head, _ in HEADS} for op, _ in OPERATORS
    }

    def mean_of(op: str, head: str) -> float | None:
        cell = cells[op][head]
        return None if cell is None else cell["mean"]

    operator_gain = {}  # SphereConv minus conv, per loss
    for op, _ in OPERATORS[1:]:
        for head, _ in HEADS:
            a, b = mean_of(op, head), mean_of("conv", head)
            if a is not None and b is not None:
                operator_gain[f"{op}/{head}"] = a - b
    margin_gain = {}  # GA-Softmax minus W-Softmax, per operator
    for op, _ in OPERATORS:
        a, b = mean_of(op, "gasoftmax"), mean_of(op, "wsoftmax")
        if a is not None and b is not None:
            margin_gain[op] = a - b
    seed_spread = [
        max(c["values"]) - min(c["values"])
        for row in cells.values()
        for c in row.values()
        if c is not None and len(c["values"]) > 1
    ]
    return {
        "cells": cells,
        "sphereconv_minus_conv": operator_gain,
        "ga_minus_w_softmax": margin_gain,
        "median_seed_spread": float(np.median(seed_spread)) if seed_spread else None,
    }


def table1_markdown(result: dict[str, Any]) -> str:
    lines = [
        "| Operator | " + " | ".join(label for _, label in HEADS) + " | s / step |",
        "|---|" + "---|" * (len(HEADS) + 1),
    ]
    for op, label in OPERATORS:
        row = result["cells"][op]
        speeds = [c["seconds_per_step"] for c in row.values() if c is not None]
        speed = f"{np.mean(speeds):.3f}" if speeds else "–"
        lines.append(f"| {label} | " + " | ".join(_fmt_cell(row[h]) for h, _ in HEADS) + f" | {speed} |")
    return "\n".join(lines)


#: Step windows whose mean logged training loss shows how fast each operator starts (Fig. 3a/3b).
CONVERGENCE_WINDOWS = ((0, 100), (100, 200), (300, 400), (700, 800))
#: Steps whose periodic test accuracy is shown beside them.
CONVERGENCE_STEPS = (100, 200, 400, 800)


def _curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[int, float]]:
    """(steps, training losses, {step: test accuracy}) of a run's log.csv."""
    with open(run_dir / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = np.array([int(r["step"]) for r in rows])
    losses = np.array([float(r["loss"]) for r in rows])
    tests = {int(r["step"]): float(r["test_accuracy"]) for r in rows if r.get("test_accuracy")}
    return steps, losses, tests


def convergence_table(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per loss and operator (seed 0): the mean training loss in :data:`CONVERGENCE_WINDOWS` and
    the test accuracy at :data:`CONVERGENCE_STEPS`, same optimiser and steps for every operator."""
    table: dict[str, Any] = {}
    for head, _ in HEADS:
        for op, _ in OPERATORS:
            name = f"cnn9_{op}_{head}"
            if name not in runs:
                continue
            steps, losses, tests = _curve(Path(runs[name]["run_dir"]))
            windows = {}
            for a, b in CONVERGENCE_WINDOWS:
                inside = losses[(steps > a) & (steps <= b)]
                windows[f"{a}-{b}"] = float(inside.mean()) if len(inside) else None
            accuracy = {str(step): 100 * tests[step] if step in tests else None for step in CONVERGENCE_STEPS}
            table.setdefault(head, {})[op] = {"loss": windows, "test_accuracy": accuracy}
    return table


def convergence_markdown(table: dict[str, Any]) -> str:
    windows = [f"{a}-{b}" for a, b in CONVERGENCE_WINDOWS]
    lines = [
        "| loss | operator | "
        + " | ".join(f"train loss, steps {w}" for w in windows)
        + " | "
        + " | ".join(f"test % at {s}" for s in CONVERGENCE_STEPS)
        + " |",
        "|---|---|" + "---|" * (len(windows) + len(CONVERGENCE_STEPS)),
    ]
    heads, operators = dict(HEADS), dict(OPERATORS)

    def fmt(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    for head, rows in table.items():
        for op, row in rows.items():
            lines.append(
                f"| {heads[head]} | {operators[op]} | "
                + " | ".join(fmt(row["loss"][w], ".3f") for w in windows)
                + " | "
                + " | ".join(fmt(row["test_accuracy"][str(s)], ".1f") for s in CONVERGENCE_STEPS)
                + " |"
            )
    return "\n".join(lines)


def norm_table(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        f"b{batch}": {key: _cell(seeds_of(runs, f"norm_b{batch}_{key}")) for key, _ in NORM_ROWS}
        for batch in (4, 16)
    }


def norm_markdown(result: dict[str, Any]) -> str:
    lines = ["| Normalisation | batch 4 | batch 16 |", "|---|---|---|"]
    for key, label in NORM_ROWS:
        lines.append(f"| {label} | {_fmt_cell(result['b4'][key])} | {_fmt_cell(result['b16'][key])} |")
    return "\n".join(lines)


def deep_table(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in ("conv", "cosine"):
        summaries = seeds_of(runs, f"cnn45_{key}")
        cell = _cell(summaries)
        if cell is not None:
            cell["final_train_loss"] = float(np.mean([s["final_train_loss"] for s in summaries]))
        out[key] = cell
    return out


def deep_markdown(result: dict[str, Any]) -> str:
    labels = {"conv": "original conv, softmax", "cosine": "cosine SphereConv, cosine W-Softmax"}
    lines = ["| CNN-45 (plain, 16/24/32 channels) | test accuracy % | final training loss |", "|---|---|---|"]
    for key, label in labels.items():
        cell = result.get(key)
        loss = "–" if cell is None else f"{cell['final_train_loss']:.3f}"
        lines.append(f"| {label} | {_fmt_cell(cell)} | {loss} |")
    return "\n".join(lines)


def face_rows(face_root: Path, baseline_root: Path, loss_table: Path | None = None) -> list[dict[str, Any]]:
    """LFW and MegaFace local-v1 rank-1 of the face runs and their ordinary-convolution baselines.

    A baseline whose run folder is not here (a fresh checkout) comes from the loss table's committed
    results (``docs/results/loss_table.json``), without curves.
    """
    rows = []
    for name in FACE_BASELINES:
        if (baseline_root / name / "summary.json").exists():
            rows.append(_face_row_from_run(baseline_root / name))
        elif loss_table is not None and loss_table.exists():
            rows.extend(_face_rows_from_loss_table(loss_table, name))
    for run in sorted(face_root.glob("sf4_*")):
        if (run / "summary.json").exists():
            rows.append(_face_row_from_run(run))
        elif (run / "log.csv").exists() and (run / "config.toml").exists():
            rows.append(_face_row_from_stopped_run(run))
    return rows


def face_method_label(config: dict[str, Any]) -> str:
    """What a face run changes against the plain network: its operator, OPT or compressive MHE."""

    def options(table: dict[str, Any]) -> str:
        return f" ({', '.join(f'{k} = {v}' for k, v in table.items())})" if table else ""

    if config.get("opt", "none") != "none":
        return f"OPT-{config['opt'].upper()}{options(config.get('opt_options', {}))}"
    if config.get("hidden_mhe_projection", "none") != "none":
        short = {"random": "RP", "angle": "AP", "group": "G"}[config["hidden_mhe_projection"]]
        extra = options(config.get("hidden_mhe_options", {}))
        return f"{short}-CoMHE, weight {config['hidden_mhe_weight']:g}{extra}"
    operator = config.get("operator", "conv")
    if operator == "conv":
        return "ordinary convolutions"
    return f"{operator}{options(config.get('operator_options', {}))}"


def _face_row_from_stopped_run(run: Path) -> dict[str, Any]:
    """A run without a summary: its last log row, no LFW. ``collapsed`` when the trainer stopped it
    on collapsed features (its ``stopped.json``), or, for runs older than that record, when its
    last logged feature norm is under the collapse threshold; otherwise it is unfinished."""
    from training.health import STOPPED_NAME
    from training.run_log import read_log

    config = tomllib.loads((run / "config.toml").read_text())
    cols = read_log(run / "log.csv")
    stopped = json.loads((run / STOPPED_NAME).read_text()) if (run / STOPPED_NAME).is_file() else None
    collapsed = bool(
        cols["feature_norm"][-1] < config.get("feature_norm_collapse", 0.02) * cols["feature_norm"][0]
    )
    if stopped is not None:
        collapsed = stopped["reason"] == "FeatureCollapseError"
    return {
        "run": str(run),
        "name": config["name"],
        "source": "run",
        "stopped_at": int(stopped["step"] if stopped is not None else cols["step"][-1]),
        "lr": config["lr"],
        "method": face_method_label(config),
        "operator": config.get("operator", "conv"),
        "seed": config.get("seed", 0),
        "lfw_accuracy": None,
        "lfw_std": None,
        "megaface_local_rank1": None,
        "final_train_accuracy": float(cols["accuracy"][-1]),
        "final_feature_norm": float(cols["feature_norm"][-1]),
        "final_loss": float(cols["loss"][-1]),
        "collapsed": collapsed,
        "stop_message": None if stopped is None else stopped["message"],
        "images_per_s": float(np.nanmean(cols["images_per_s"])),
    }


def _face_row_from_run(run: Path) -> dict[str, Any]:
    summary = json.loads((run / "summary.json").read_text())
    lfw = summary.get("lfw") or {}
    rank1, _ = megaface_rank1(run)
    config = tomllib.loads((run / "config.toml").read_text())
    return {
        "run": str(run),
        "name": summary["name"],
        "source": "run",
        "lr": config["lr"],
        "method": face_method_label(config),
        "operator": summary.get("operator", "conv"),
        "seed": summary.get("seed", 0),
        "lfw_accuracy": lfw.get("accuracy"),
        "lfw_std": lfw.get("std"),
        "megaface_local_rank1": rank1,
        "final_train_accuracy": summary["final"]["accuracy"],
        "final_feature_norm": summary["final"]["feature_norm"],
        "images_per_s": summary.get("mean_images_per_s"),
    }


def _face_rows_from_loss_table(loss_table: Path, name: str) -> list[dict[str, Any]]:
    from training.config import read_toml

    config = read_toml(LOSS_TABLE_CONFIGS / f"{name}.toml")
    return [
        {
            "run": row["run"],
            "name": row["run"],
            "source": str(loss_table),
            "lr": config["lr"],
            "method": face_method_label(config),
            "operator": "conv",
            "seed": row["seed"],
            "lfw_accuracy": row["lfw_accuracy"],
            "lfw_std": row["lfw_std"],
            "megaface_local_rank1": row["megaface_local_rank1"],
            "final_train_accuracy": row["final_train_accuracy"],
            "final_feature_norm": row["final_feature_norm"],
            "images_per_s": row.get("train_images_per_s"),
        }
        for row in json.loads(loss_table.read_text())
        if row["run"] == name
    ]


def faces_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| SphereFace-4, A-Softmax m = 4 | lr | seed | LFW % | MegaFace local-v1 rank-1 % "
        "| train acc. % | ‖x‖ | images/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r["method"]
        if r.get("collapsed"):
            label += (
                f", stopped at step {r['stopped_at']} (loss {r['final_loss']:.3f}: the features collapsed)"
            )
        elif r.get("stopped_at") is not None:
            label += f", unfinished at step {r['stopped_at']}"
        lfw = (
            "–" if r["lfw_accuracy"] is None else f"{100 * r['lfw_accuracy']:.2f} ± {100 * r['lfw_std']:.2f}"
        )
        mf = "–" if r["megaface_local_rank1"] is None else f"{100 * r['megaface_local_rank1']:.2f}"
        speed = "–" if r["images_per_s"] is None else f"{r['images_per_s']:.0f}"
        lines.append(
            f"| {label} | {r['lr']:g} | {r['seed']} | {lfw} | {mf} | {100 * r['final_train_accuracy']:.1f} "
            f"| {r['final_feature_norm']:.3g} | {speed} |"
        )
    return "\n".join(lines)


FACES_TITLE = "SphereFace-4 + A-Softmax (m = 4) on celeba_faces + celeba_small: operator against convolution"


def plot_faces(rows: list[dict[str, Any]], out: Path, title: str = FACES_TITLE) -> Path | None:
    from training.run_log import read_log

    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for r in rows:
        if r.get("source", "run") != "run":
            continue
        cols = read_log(Path(r["run"]) / "log.csv")
        label = f"{r['method']}, lr {r['lr']:g}, seed {r['seed']}"
        axes[0].plot(cols["step"], cols["loss"], lw=1.1, label=label)
        axes[1].plot(cols["step"], 100 * cols["accuracy"], lw=1.1, label=label)
        axes[2].plot(cols["step"], cols["feature_norm"], lw=1.1, label=label)
    for ax, panel in zip(
        axes, ("training loss", "training accuracy (%)", "mean feature norm ||x||"), strict=True
    ):
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    return out


def plot_all(runs: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """The CIFAR-10 curves: operators, SphereNorm at batch 4 and 16, the deep plain network."""
    figures = [
        (
            [f"cnn9_{op}_{head}" for head in ("softmax", "wsoftmax") for op, _ in OPERATORS],
            "hyperspherical_convergence.png",
            "CNN-9 (24/36/48 channels), CIFAR-10: operators, same optimiser and steps (seed 0)",
        ),
        *(
            (
                [f"norm_b{batch}_{key}" for key, _ in NORM_ROWS],
                f"hyperspherical_norm_b{batch}.png",
                f"SphereNorm against BatchNorm at batch {batch} (CNN-9, softmax)",
            )
            for batch in (4, 16)
        ),
        (
            ["cnn45_conv", "cnn45_cosine"],
            "hyperspherical_deep.png",
            "A plain CNN-45 (no shortcuts): convolution against cosine SphereConv",
        ),
    ]
    written = []
    for names, filename, title in figures:
        present = [n for n in names if n in runs]
        if present:
            run_dirs = [Path(runs[n]["run_dir"]) for n in present]
            written.append(plot_cifar_curves(run_dirs, out / filename, title, present))
    return written


def markdown(
    t1: dict[str, Any],
    norms: dict[str, Any],
    deep: dict[str, Any],
    faces: list[dict[str, Any]],
    convergence: dict[str, Any] | None = None,
) -> str:
    parts = [
        "<!-- written by `python -m training.hyperspherical_table` (make hyperspherical-table) -->",
        "### Operator × loss: CIFAR-10 test accuracy % (SphereNet Table 1 subset)",
        "",
        table1_markdown(t1),
        "",
        "SphereConv minus convolution, per loss (points): "
        + ", ".join(f"{k} {v:+.2f}" for k, v in t1["sphereconv_minus_conv"].items()),
        "",
        "GA-Softmax minus W-Softmax, per operator (points): "
        + ", ".join(f"{k} {v:+.2f}" for k, v in t1["ga_minus_w_softmax"].items()),
        "",
        f"Median spread between the two seeds of a cell: {t1['median_seed_spread']:.2f} points"
        if t1["median_seed_spread"] is not None
        else "",
        "",
        "### Convergence: the same optimiser and steps for every operator (seed 0)",
        "",
        convergence_markdown(convergence or {}),
        "",
        "### SphereNorm against BatchNorm: CIFAR-10 test accuracy % after 2,000 steps",
        "",
        norm_markdown(norms),
        "",
        "### A deep plain network",
        "",
        deep_markdown(deep),
        "",
        "### Faces",
        "",
        faces_markdown(faces),
        "",
    ]
    return "\n".join(parts)


def add_face_baseline_arguments(parser: argparse.ArgumentParser) -> None:
    """``--baselines`` and ``--loss-table``: where the plain face runs are (see :func:`face_rows`)."""
    parser.add_argument("--baselines", default="runs/celeba_more", type=Path, help="the loss table's runs")
    parser.add_argument(
        "--loss-table",
        default="docs/results/loss_table.json",
        type=Path,
        help="the loss table's committed results, for baselines whose runs are not here",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/hyperspherical", type=Path)
    add_face_baseline_arguments(parser)
    parser.add_argument("--out", default="docs/results", type=Path)
    args = parser.parse_args(argv)
    runs = load_cifar_runs(args.runs / "cifar")
    if not runs:
        print(f"no finished CIFAR-10 runs under {args.runs / 'cifar'}", file=sys.stderr)
        return 1
    t1, norms, deep = table1(runs), norm_table(runs), deep_table(runs)
    convergence = convergence_table(runs)
    faces = face_rows(args.runs, args.baselines, args.loss_table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hyperspherical.md").write_text(markdown(t1, norms, deep, faces, convergence))
    report = {
        "table1": t1,
        "convergence": convergence,
        "normalisation": norms,
        "deep": deep,
        "faces": faces,
        "runs": runs,
    }
    (args.out / "hyperspherical.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_all(runs, args.out)
    plot_faces(faces, args.out / "hyperspherical_faces.png")
    print((args.out / "hyperspherical.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
