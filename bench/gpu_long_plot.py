"""Loss and learning rate per step of the GPU check's ``long`` runs, one line per run, in one PNG.

python bench/gpu_long_plot.py docs/results/gpu/long_*.json --out docs/results/gpu/long_runs.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def long_run(path: Path) -> dict[str, Any]:
    """The ``long`` section's details of one ``gpu_check.json``, with a label for the legend."""
    report = json.loads(path.read_text())
    section = next((s for s in report["sections"] if s["section"] == "long"), None)
    if section is None or "curve" not in section["details"]:
        raise SystemExit(f"{path}: no long run with a logged curve in it")
    details = section["details"]
    overrides = dict(o.split("=", 1) for o in details.get("overrides", []))
    precision = overrides.get("precision", "bf16")
    label = f"lr {overrides.get('lr', 'base')}, {precision}, {overrides.get('steps', '?')} steps"
    if "diverged" in details:
        label += f" (NaN at step {details['diverged'].split('at step ')[1].split(';')[0]})"
    environment = next((s["details"] for s in report["sections"] if s["section"] == "environment"), {})
    pack = report.get("pack", {})
    where = f"SphereFace-20 on {pack.get('faces', 0):,} crops, {environment.get('gpu', 'CPU')}"
    return {"label": label, "curve": details["curve"], "where": where}


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_norm = any("feature_norm" in run["curve"] for run in runs)
    ratios = (3, 1, 1) if with_norm else (3, 1)
    fig, axes = plt.subplots(len(ratios), 1, figsize=(8, 6 + with_norm), sharex=True, height_ratios=ratios)
    loss_ax, lr_ax = axes[0], axes[1]
    for run in runs:
        curve = run["curve"]
        loss_ax.plot(curve["step"], curve["loss"], label=run["label"])
        lr_ax.plot(curve["step"], curve["lr"], label=run["label"])
        if with_norm and "feature_norm" in curve:
            axes[2].plot(curve["step"], curve["feature_norm"], label=run["label"])
    if with_norm:
        axes[2].set_ylabel("mean ||x||")
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss (A-Softmax, m = 4)")
    loss_ax.set_title("; ".join(sorted({run["where"] for run in runs})), fontsize=10)
    loss_ax.legend(fontsize=8)
    lr_ax.set_yscale("log")
    lr_ax.set_ylabel("lr")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", type=Path, nargs="+", help="gpu_check.json files with a long section")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args(argv)
    plot([long_run(p) for p in args.reports], args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
