"""The tables and curves of docs/results/opt.md (discussed in docs/results/opt-claims.md) from
finished CIFAR-10 runs (``make opt-table``).

Usage::

    python -m training.opt_table --runs runs/opt/cifar --out docs/results

Reads ``runs/opt/cifar/*/summary.json`` (``training/configs/opt/cifar``) and writes ``opt.md``
(Markdown tables), ``opt.json`` (every number) and ``opt_curves.png`` (test accuracy of Table 1's
rows). Errors are in percent (100 - test accuracy) as the papers print them; a row with two seeds
shows the mean and both values. A comparison "holds" when the mean difference exceeds the largest
spread between the seeds of the two rows (where a row has one seed, the other row's spread, or
"one seed" when neither has two).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from training.cifar import plot_cifar_curves
from training.hyperspherical_table import (
    add_face_baseline_arguments,
    face_rows,
    faces_markdown,
    load_cifar_runs,
    plot_faces,
    seeds_of,
)

TABLE1 = (
    ("baseline", "baseline (plain training)"),
    ("baseline_lr002", "baseline at lr 0.02 (control)"),
    ("upt", "UPT: R unconstrained, v fixed"),
    ("gs_learnable_v", "OPT-GS, v learnable"),
    ("gs", "OPT-GS, v fixed"),
)
TABLE6 = (
    ("baseline", "baseline"),
    ("baseline_lr002", "baseline at lr 0.02 (control)"),
    ("hs_mhe", "HS-MHE"),
    ("gs", "GS"),
    ("hr", "HR"),
    ("ls", "LS"),
    ("cp", "CP"),
    ("ogd", "OGD"),
    ("or", "OR (relaxed)"),
)
TABLE4 = (("cp", "0"), ("cp_shift005", "0.05"), ("cp_shift02", "0.2"), ("cp_shift05", "0.5"))
SOPT = (("cp", "OPT-CP (full R)"), ("sopt_cp", "S-OPT-CP (p = d/4)"))
COMHE = (
    ("baseline", "baseline"),
    ("baseline_lr002", "baseline at lr 0.02 (control)"),
    ("mhe", "MHE"),
    ("hs_mhe", "HS-MHE"),
    ("rp_comhe", "RP-CoMHE"),
    ("ap_comhe", "AP-CoMHE (alternating)"),
)
#: (better row, worse row, the paper's claim), each decided by :func:`compare`.
CLAIMS = (
    ("gs", "baseline", "OPT-GS (v fixed) beats plain training (Table 1)"),
    ("gs", "gs_learnable_v", "fixing v beats learning it (Table 1)"),
    ("baseline", "upt", "an unconstrained R is worse than plain training (Table 1)"),
    ("cp", "baseline", "OPT-CP beats plain training (Table 6)"),
    ("sopt_cp", "baseline", "S-OPT beats plain training with far fewer trainable numbers (Table 10)"),
    ("rp_comhe", "hs_mhe", "RP-CoMHE beats HS-MHE (Table 6.1)"),
    ("hs_mhe", "mhe", "HS-MHE beats MHE (Table 6.1)"),
    ("cp", "cp_shift05", "a higher initial energy ends at a higher error (Table 4)"),
    ("gs", "baseline_lr002", "OPT-GS with v fixed beats plain training at lr 0.02, where it is stable"),
    ("cp", "baseline_lr002", "OPT-CP beats plain training at lr 0.02"),
    ("baseline_lr002", "upt", "an unconstrained R is worse than plain training at lr 0.02"),
    ("sopt_cp", "baseline_lr002", "S-OPT beats plain training at lr 0.02"),
    ("hs_mhe", "baseline_lr002", "HS-MHE beats plain training at lr 0.02 (Table 6.1)"),
)
#: (what marks the face runs in their label, the claim): each against the plain SphereFace-4's seeds.
FACE_CLAIMS = (
    ("OPT-", "OPT on SphereFace-4's convolutions beats plain training on LFW"),
    ("CoMHE", "compressive MHE on SphereFace-4's hidden layers beats plain training on LFW"),
)
PLAIN_FACE_RUN = "ordinary convolutions"
FACES_TITLE = (
    "SphereFace-4 + A-Softmax (m = 4), celeba_faces + celeba_small: OPT and CoMHE against plain training"
)


def _row(runs: dict[str, dict[str, Any]], key: str) -> dict[str, Any] | None:
    summaries = seeds_of(runs, f"cnn6_{key}")
    if not summaries:
        return None
    errors = [100 * (1 - s["test_accuracy"]) for s in summaries]
    energy = [s.get("layer_energy") or {} for s in summaries]
    return {
        "error": float(np.mean(errors)),
        "errors": errors,
        "seconds_per_step": float(np.mean([s["seconds_per_step"] for s in summaries])),
        "trainable_parameters": summaries[0].get("trainable_parameters"),
        "initial_energy": _mean_sum(e.get("initial") for e in energy),
        "final_energy": _mean_sum(e.get("final") for e in energy),
        "orthogonality_error": summaries[0].get("orthogonality_error"),
    }


def _mean_sum(values: Any) -> float | None:
    sums = [float(np.sum(v)) for v in values if v]
    return float(np.mean(sums)) if sums else None


def compare(better: dict[str, Any] | None, worse: dict[str, Any] | None) -> dict[str, Any] | None:
    """``worse - better`` in error points and whether it exceeds the seeds' spread."""
    if better is None or worse is None:
        return None
    gain = worse["error"] - better["error"]
    spreads = [max(r["errors"]) - min(r["errors"]) for r in (better, worse) if len(r["errors"]) > 1]
    if not spreads:
        verdict = "one seed" if gain > 0 else "does not hold"
        return {"gain": gain, "spread": None, "verdict": verdict}
    spread = max(spreads)
    verdict = "holds" if gain > spread else ("within seed noise" if gain > -spread else "does not hold")
    return {"gain": gain, "spread": spread, "verdict": verdict}


def build(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    keys = {key for table in (TABLE1, TABLE6, TABLE4, SOPT, COMHE) for key, _ in table}
    rows = {key: _row(runs, key) for key in sorted(keys)}
    claims = [
        {"claim": text, "better": better, "worse": worse, **(compare(rows[better], rows[worse]) or {})}
        for better, worse, text in CLAIMS
    ]
    return {"rows": rows, "claims": claims}


def _lfw_error_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    errors = [100 * (1 - r["lfw_accuracy"]) for r in rows if r["lfw_accuracy"] is not None]
    return {"error": float(np.mean(errors)), "errors": errors} if errors else None


def face_claims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each face method's LFW error against the plain SphereFace-4's seeds (:func:`compare`)."""
    plain = _lfw_error_row([r for r in rows if r["method"] == PLAIN_FACE_RUN])
    claims = []
    for marker, text in FACE_CLAIMS:
        method = _lfw_error_row([r for r in rows if marker in r["method"]])
        claims.append({"claim": text, **(compare(method, plain) or {})})
    return claims


def _fmt_error(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    if len(row["errors"]) == 1:
        return f"{row['error']:.2f}"
    return f"**{row['error']:.2f}** ({' / '.join(f'{v:.2f}' for v in row['errors'])})"


def _fmt(value: float | int | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _table(rows: dict[str, Any], table: tuple[tuple[str, str], ...], extra: str = "") -> list[str]:
    header = "| | test error % | s / step | trainable numbers | energy before → after |"
    lines = [header, "|---|---|---|---|---|"]
    for key, label in table:
        row = rows.get(key)
        if row is None:
            lines.append(f"| {label} | – | – | – | – |")
            continue
        energy = f"{_fmt(row['initial_energy'], '.4f')} → {_fmt(row['final_energy'], '.4f')}"
        lines.append(
            f"| {label} | {_fmt_error(row)} | {row['seconds_per_step']:.3f} | "
            f"{_fmt(row['trainable_parameters'], ',')} | {energy} |"
        )
    return lines + ([extra] if extra else [])


def _claims_table(claims: list[dict[str, Any]], unit: str) -> list[str]:
    out = [f"| claim | gain ({unit}) | seed spread | verdict |", "|---|---|---|---|"]
    for claim in claims:
        if "gain" not in claim:
            out.append(f"| {claim['claim']} | – | – | not run |")
            continue
        spread = _fmt(claim["spread"], ".2f")
        out.append(f"| {claim['claim']} | {claim['gain']:+.2f} | {spread} | {claim['verdict']} |")
    return out


def faces_section(faces: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[str]:
    return [
        "## Faces: OPT and CoMHE on SphereFace-4 with A-Softmax (m = 4)",
        "",
        "celeba_faces + celeba_small, 2,000 steps of batch 64 as the loss table's A-Softmax m = 4 rows",
        "(training/configs/opt/sf4_*.toml); LFW 10 folds, MegaFace local-v1 rank-1 at 10,318 distractors.",
        "",
        faces_markdown(faces),
        "",
        *_claims_table(claims, "LFW error points"),
        "",
    ]


def markdown(result: dict[str, Any], faces: list[dict[str, Any]] | None = None) -> str:
    rows = result["rows"]
    out = [
        "# OPT and CoMHE on CIFAR-10 (generated by `python -m training.opt_table`)",
        "",
        "CNN-6 at 32 channels, 1,500 steps of batch 128, SGD lr 0.1 (training/configs/opt/cifar). Test error",
        "on all 10,000 test images. Energy: the sum over layers of each layer's normalised hyperspherical",
        "energy (s = 2) of its neurons. The papers' tables are CIFAR-100; these are CIFAR-10.",
        "",
        "## Table 1: OPT against plain and unconstrained training",
        "",
        *_table(rows, TABLE1),
        "",
        "## Table 6: ways of learning R",
        "",
        *_table(rows, TABLE6),
        "",
        "## Table 4: initial energy against final error (OPT-CP, v shifted before it is frozen)",
        "",
        "| v_shift | initial energy | test error % |",
        "|---|---|---|",
    ]
    for key, shift in TABLE4:
        row = rows.get(key)
        energy = "–" if row is None else _fmt(row["initial_energy"], ".4f")
        out.append(f"| {shift} | {energy} | {_fmt_error(row)} |")
    out += [
        "",
        "## S-OPT against OPT",
        "",
        *_table(rows, SOPT),
        "",
        "## CoMHE (Table 6.1 rows, Table E.5 cost)",
        "",
    ]
    out += [
        *_table(rows, COMHE),
        "",
        "## The claims",
        "",
        *_claims_table(result["claims"], "error points"),
        "",
    ]
    if faces:
        out += faces_section(faces, result["face_claims"])
    return "\n".join(out)


def plot(runs: dict[str, dict[str, Any]], out: Path) -> Path | None:
    dirs, labels = [], []
    for key, label in TABLE1:
        for summary in seeds_of(runs, f"cnn6_{key}")[:1]:
            dirs.append(Path(summary["run_dir"]))
            labels.append(label)
    if not dirs:
        return None
    return plot_cifar_curves(dirs, out, "OPT Table 1 rows on CIFAR-10 (CNN-6, 32 channels)", labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/opt/cifar", type=Path)
    parser.add_argument("--faces", default="runs/opt", type=Path, help="the face runs (sf4_*)")
    add_face_baseline_arguments(parser)
    parser.add_argument("--out", default="docs/results", type=Path)
    args = parser.parse_args(argv)
    runs = load_cifar_runs(args.runs)
    if not runs:
        print(f"no finished CIFAR-10 runs under {args.runs}", file=sys.stderr)
        return 1
    result = build(runs)
    faces = face_rows(args.faces, args.baselines, args.loss_table)
    result["face_claims"] = face_claims(faces)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "opt.md").write_text(markdown(result, faces))
    (args.out / "opt.json").write_text(json.dumps({**result, "faces": faces, "runs": runs}, indent=2) + "\n")
    plot(runs, args.out / "opt_curves.png")
    plot_faces(faces, args.out / "opt_faces.png", FACES_TITLE)
    print((args.out / "opt.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
