"""Plots and Markdown tables of MegaFace Challenge 1 protocol reports.

:func:`training.evaluation.megaface.run_megaface` writes one JSON report per run. This module turns
such reports into

* three PNG figures of one report (:func:`write_plots`): identification rate against the number of
  distractors, CMC curves and verification ROC curves;
* one Markdown document comparing any number of reports side by side (:func:`markdown_report`),
  together with the papers' MegaFace Challenge 1 numbers (:data:`PAPER_MEGAFACE`). The papers'
  numbers are put in the same table as a run only when the run used the real protocol (FaceScrub
  probes, MegaFace distractors, 1M of them); otherwise they are listed apart, with a note.

Rates in the reports are fractions; everything here prints them as percentages with 2 decimals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from training.evaluation.errors import MegaFaceDataError
from training.evaluation.report import markdown_table, new_axes, save_figure

#: Cell of a number that is not there (size not run, TAR not measurable at that FAR).
MISSING = "–"
#: Distractor count of the papers' MegaFace Challenge 1 numbers.
PAPER_DISTRACTORS = 1_000_000
#: File names written by :func:`write_plots`, in order.
PLOT_FILES = ("identification_vs_distractors.png", "cmc.png", "roc.png")
#: Variants in the order they are shown (any other variant follows, sorted by name).
VARIANT_ORDER = ("raw", "cleaned")


class PaperRow(NamedTuple):
    """One published MegaFace Challenge 1 result (percentages as printed in the paper)."""

    source: str
    method: str
    architecture: str
    training_data: str
    mr1: float | None  # rank-1 identification % with 1M distractors
    mv: float | None  # verification TAR % at FAR 1e-6


#: The papers' MegaFace Challenge 1 numbers of CASIA-WebFace-trained single models and the
#: SphereFace ensemble, from the SphereFace thesis: ``T2.10`` = Table 2.10 (SphereFace-64),
#: ``TA.2`` = Table A.2 (depth), ``T5.8 / TD.7`` = Tables 5.8 (MR1) and D.7 (MV), ``T5.9`` =
#: Table 5.9 (SphereFace+ on SphereFace-64, MR1 only).
PAPER_MEGAFACE: tuple[PaperRow, ...] = (
    PaperRow("T2.10", "Softmax", "SphereFace-64", "CASIA-WebFace", 54.855, 65.925),
    PaperRow("T2.10", "Softmax+Contrastive", "SphereFace-64", "CASIA-WebFace", 65.219, 78.865),
    PaperRow("T2.10", "Triplet", "SphereFace-64", "CASIA-WebFace", 64.797, 78.322),
    PaperRow("T2.10", "L-Softmax (m=4)", "SphereFace-64", "CASIA-WebFace", 67.128, 80.423),
    PaperRow("T2.10", "Softmax+Center", "SphereFace-64", "CASIA-WebFace", 65.494, 80.146),
    PaperRow("T2.10", "SphereFace (m=4)", "SphereFace-64", "CASIA-WebFace", 72.729, 85.561),
    PaperRow("T2.10", "SphereFace (m=4), 3-patch ensemble", "SphereFace-64", "CASIA-WebFace", 75.766, 89.142),
    PaperRow("TA.2", "SphereFace (m=4)", "SphereFace-4", "CASIA-WebFace", 57.529, 68.547),
    PaperRow("TA.2", "SphereFace (m=4)", "SphereFace-10", "CASIA-WebFace", 65.335, 78.069),
    PaperRow("TA.2", "SphereFace (m=4)", "SphereFace-20", "CASIA-WebFace", 69.623, 83.159),
    PaperRow("TA.2", "SphereFace (m=4)", "SphereFace-36", "CASIA-WebFace", 71.257, 84.052),
    PaperRow("T5.8 / TD.7", "SphereFace (m=4)", "SphereFace-20", "CASIA-WebFace", 70.68, 82.56),
    PaperRow("T5.8 / TD.7", "SphereFace+ (m=4)", "SphereFace-20", "CASIA-WebFace", 71.30, 83.39),
    PaperRow("T5.9", "SphereFace+ (m=4)", "SphereFace-64", "CASIA-WebFace", 73.03, None),
)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def size_label(n: int) -> str:
    """A distractor count as a column label: ``10``, ``1k``, ``100k``, ``1M``; ``10,318`` otherwise."""
    n = int(n)
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if 1_000 <= n < 1_000_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return f"{n:,}"


def percent(rate: float | None) -> str:
    """A rate in [0, 1] as a percentage with 2 decimals; :data:`MISSING` for None."""
    return MISSING if rate is None else f"{100.0 * float(rate):.2f}"


def _paper_number(value: float | None) -> str:
    """A paper's percentage as printed there (2 or 3 decimals); :data:`MISSING` for None."""
    if value is None:
        return MISSING
    text = f"{value:.3f}"
    return text[:-1] if text.endswith("0") else text


def _check_report(report: Any, where: str) -> str | None:
    """Why ``report`` is not a MegaFace report JSON (None when it is one)."""
    if not isinstance(report, dict):
        return f"{where} is not a MegaFace report (a JSON object is expected, got {type(report).__name__})"
    missing = [key for key in ("results", "sizes") if key not in report]
    if missing:
        return (
            f"{where} is not a MegaFace report JSON (as training.evaluation.megaface writes): "
            f"it lacks {', '.join(repr(k) for k in missing)}"
        )
    if not isinstance(report["results"], dict) or not isinstance(report["sizes"], list):
        return f"{where} is not a MegaFace report JSON: 'results' must be an object and 'sizes' a list"
    return None


def _variants(report: dict[str, Any]) -> list[str]:
    """The result variants of a report, raw first, then cleaned, then any other."""
    names = list(report["results"])
    known = [v for v in VARIANT_ORDER if v in names]
    return known + sorted(v for v in names if v not in VARIANT_ORDER)


def _sizes(report: dict[str, Any]) -> list[int]:
    return sorted({int(n) for n in report["sizes"]})


def _largest(report: dict[str, Any]) -> int | None:
    sizes = _sizes(report)
    return sizes[-1] if sizes else None


def _rate(result: dict[str, Any], size: int | None, key: str) -> float | None:
    """``key`` (rank1 / rank10) of the identification at ``size``; None when not there."""
    if size is None:
        return None
    return result.get("identification", {}).get(str(size), {}).get(key)


def _tar(result: dict[str, Any], size: int | None, far: str) -> float | None:
    """TAR at the FAR label ``far`` of the verification at ``size``; None when not there."""
    if size is None:
        return None
    return result.get("verification", {}).get(str(size), {}).get("tar_at_far", {}).get(far)


def _far_sort_key(label: str) -> tuple[float, str]:
    try:
        return (-float(label), label)
    except ValueError:
        return (0.0, label)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------


def _new_axes(title: str) -> tuple[Any, Any]:
    """A Figure on the Agg canvas (no pyplot, no global state) and its one Axes."""
    fig, ax = new_axes((7.2, 5.2), dpi=120)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _finish(fig: Any, ax: Any, path: Path, empty_text: str, legend_loc: str = "best") -> Path:
    """Legend (when anything is labelled) or a note that there is nothing to draw; save the PNG."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc=legend_loc, fontsize=8)
    else:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes, fontsize=10)
    return save_figure(fig, path)


def _plot_identification(report: dict[str, Any], path: Path, heading: str) -> Path:
    fig, ax = _new_axes(f"MegaFace identification vs distractors\n{heading}")
    sizes = _sizes(report)
    shown = [n for n in sizes if n > 0]
    styles = {"raw": "-", "cleaned": "--"}
    for variant in _variants(report):
        result = report["results"][variant]
        for key, label, color, marker in (("rank1", "rank-1", "C0", "o"), ("rank10", "rank-10", "C1", "s")):
            points = [(n, _rate(result, n, key)) for n in shown]
            points = [(n, 100.0 * r) for n, r in points if r is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs,
                ys,
                linestyle=styles.get(variant, ":"),
                marker=marker,
                color=color,
                lw=1.6,
                ms=5,
                label=f"{variant} {label}",
            )
    ax.set_xscale("log")
    if shown:
        # Label a size only when it lies far enough from the last labelled one (10k and 10,318 would overlap).
        labelled: list[int] = []
        for n in shown:
            if not labelled or n / labelled[-1] >= 2.5:
                labelled.append(n)
        ax.set_xticks(labelled, [size_label(n) for n in labelled])
        ax.minorticks_off()
    xlabel = "distractors N (log scale)"
    if 0 in sizes:
        zero = [f"{v} rank-1 {percent(_rate(report['results'][v], 0, 'rank1'))}%" for v in _variants(report)]
        xlabel += "\nN = 0 (not on the log axis): " + ", ".join(zero)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("identification rate (%)")
    return _finish(fig, ax, path, "no distractor count above 0", legend_loc="lower left")


def _plot_cmc(report: dict[str, Any], path: Path, heading: str) -> Path:
    from matplotlib import colormaps
    from matplotlib.ticker import ScalarFormatter

    fig, ax = _new_axes(f"MegaFace CMC (raw)\n{heading}")
    cmc = report["results"].get("raw", {}).get("cmc", {})
    sizes = [n for n in _sizes(report) if cmc.get(str(n))]
    cmap = colormaps["viridis"]
    for i, n in enumerate(sizes):
        curve = cmc[str(n)]
        color = cmap(i / max(len(sizes) - 1, 1) * 0.9)
        ax.plot(
            range(1, len(curve) + 1),
            [100.0 * v for v in curve],
            color=color,
            lw=1.6,
            label=f"N = {size_label(n)}",
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("rank (log scale)")
    ax.set_ylabel("identification rate (%)")
    return _finish(fig, ax, path, "no CMC curve in this report", legend_loc="lower right")


def _plot_roc(report: dict[str, Any], path: Path, heading: str) -> Path:
    from matplotlib import colormaps

    fig, ax = _new_axes(f"MegaFace verification ROC (raw)\n{heading}")
    raw = report["results"].get("raw", {})
    roc = raw.get("roc", {})
    sizes = [n for n in _sizes(report) if roc.get(str(n), {}).get("far")]
    cmap = colormaps["viridis"]
    for i, n in enumerate(sizes):
        points = [
            (f, 100.0 * t) for f, t in zip(roc[str(n)]["far"], roc[str(n)]["tar"], strict=False) if f > 0
        ]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, color=cmap(i / max(len(sizes) - 1, 1) * 0.9), lw=1.6, label=f"N = {size_label(n)}")
    largest = _largest(report)
    if largest is not None:
        tars = raw.get("verification", {}).get(str(largest), {}).get("tar_at_far", {})
        marked = [(float(far), 100.0 * t) for far, t in tars.items() if t is not None and float(far) > 0]
        for j, (far, tar) in enumerate(sorted(marked)):
            ax.plot(
                [far],
                [tar],
                "o",
                color="C3",
                ms=6,
                zorder=3,
                label=f"TAR at reported FARs, N = {size_label(largest)}" if j == 0 else None,
            )
            ax.annotate(f"{tar:.2f}%", (far, tar), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("false accept rate (log scale)")
    ax.set_ylabel("true accept rate (%)")
    return _finish(fig, ax, path, "no ROC points in this report", legend_loc="lower right")


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the three PNG figures of one report into ``out_dir`` (created when missing).

    * ``identification_vs_distractors.png``: rank-1 and rank-10 identification rate against the
      number of distractors (log axis; N = 0 is written under it), raw solid, cleaned dashed;
    * ``cmc.png``: the raw CMC curve of every size;
    * ``roc.png``: the raw ROC curve of every size with ROC points, and the TAR at the reported
      FARs of the largest size.

    Returns the paths in that order.
    """
    problem = _check_report(report, "the report")
    if problem:
        raise ValueError(problem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heading = f"{report.get('model_id', 'model')} (protocol {report.get('protocol', '?')})"
    return [
        _plot_identification(report, out / PLOT_FILES[0], heading),
        _plot_cmc(report, out / PLOT_FILES[1], heading),
        _plot_roc(report, out / PLOT_FILES[2], heading),
    ]


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _distractor_text(report: dict[str, Any]) -> str:
    d = report.get("distractors") or {}
    total = d.get("total")
    text = MISSING if total is None else f"{int(total):,}"
    augmented = int(d.get("augmented") or 0)
    if augmented > 0:
        text += f" ({augmented:,} augmented)"
    return text


def _comparable(report: dict[str, Any]) -> bool:
    """Whether the papers' MegaFace Challenge 1 numbers can stand beside this report's."""
    largest = _largest(report)
    return report.get("protocol") == "megaface" and largest is not None and largest >= PAPER_DISTRACTORS


def _paper_rows(with_source: bool) -> list[list[str]]:
    rows = []
    for row in PAPER_MEGAFACE:
        method = row.method if with_source else f"{row.method} [{row.source}]"
        head = [row.source, method] if with_source else [method]
        rows.append(
            head + [row.architecture, row.training_data, _paper_number(row.mr1), _paper_number(row.mv)]
        )
    return rows


def markdown_report(reports: list[dict[str, Any]], names: list[str] | None = None) -> str:
    """A Markdown document comparing MegaFace protocol reports side by side.

    One row per report and result variant (raw, cleaned): probes, distractors, rank-1 % at every
    distractor count of any report, and rank-10 % and TAR % at each FAR at the report's largest
    count. Reports of the real protocol (``megaface``) with 1M distractors or more are then put in
    one table with the papers' numbers (:data:`PAPER_MEGAFACE`); without such a report the papers'
    numbers get their own section with a note that they are not comparable.

    ``names`` (one per report) replace the model ids in the tables. Raises ValueError when there is
    no report, when ``names`` does not match, or when a dict is not a MegaFace report.
    """
    labels = _labels(reports, names)
    lines = ["# MegaFace Challenge 1 protocol: results", ""]
    lines += [
        "Rates in %. Rank-1 identification at every distractor count N; rank-10 identification and "
        "verification TAR at each false accept rate are at the report's largest N "
        f"(`{MISSING}`: not run, or too few impostor pairs for that FAR).",
        "",
    ]
    lines += _results_table(reports, labels)
    lines += ["", "Protocols:", ""] + _protocol_lines(reports)
    notes = _distractor_notes(reports, labels)
    if notes:
        lines += ["", "Distractors and cleaning:", ""] + notes
    lines.append("")
    lines += _papers_section(reports, labels)
    return "\n".join(lines) + "\n"


def _labels(reports: list[dict[str, Any]], names: list[str] | None) -> list[str]:
    """The row name of each report (``names``, else its model id), after checking the reports."""
    if not reports:
        raise ValueError("no MegaFace report given: markdown_report needs at least one report")
    for i, report in enumerate(reports):
        problem = _check_report(report, f"report {i + 1}")
        if problem:
            raise ValueError(problem)
    if names is not None and len(names) != len(reports):
        raise ValueError(f"{len(names)} names given for {len(reports)} reports")
    if names is not None:
        return list(names)
    return [str(r.get("model_id", f"report {i + 1}")) for i, r in enumerate(reports)]


def _results_table(reports: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """The main table: one row per report and variant."""
    all_sizes = sorted({n for r in reports for n in _sizes(r)})
    fars = sorted({str(f) for r in reports for f in r.get("fars") or []}, key=_far_sort_key)
    header = ["model", "variant", "protocol", "probe images / ids", "distractors"]
    header += [f"rank-1 @{size_label(n)}" for n in all_sizes]
    header += ["largest N", "rank-10 @largest"] + [f"TAR @{far}" for far in fars]
    rows = []
    for label, report in zip(labels, reports, strict=True):
        largest = _largest(report)
        sizes = set(_sizes(report))
        for variant in _variants(report):
            result = report["results"][variant]
            probes = f"{int(result.get('probe_images', 0)):,} / {int(result.get('identities', 0)):,}"
            row = [label, variant, str(report.get("protocol", "?")), probes, _distractor_text(report)]
            row += [percent(_rate(result, n, "rank1")) if n in sizes else MISSING for n in all_sizes]
            row += [
                MISSING if largest is None else size_label(largest),
                percent(_rate(result, largest, "rank10")),
            ]
            row += [percent(_tar(result, largest, far)) for far in fars]
            rows.append(row)
    return markdown_table(header, rows, numeric_from=3)


def _protocol_lines(reports: list[dict[str, Any]]) -> list[str]:
    """One line per distinct protocol (name and description) of the reports, in order."""
    seen: list[tuple[str, str]] = []
    for report in reports:
        key = (str(report.get("protocol", "?")), str(report.get("protocol_description", "")))
        if key not in seen:
            seen.append(key)
    return [f"- `{p}`: {desc or 'no description'}" for p, desc in seen]


def _distractor_notes(reports: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """Augmented distractors, extra feature files and cleaning of each report, one line each."""
    notes = []
    for label, report in zip(labels, reports, strict=True):
        d = report.get("distractors") or {}
        if int(d.get("augmented") or 0) > 0:
            notes.append(f"- {label}: {int(d['augmented']):,} augmented distractors: {d.get('augmentation')}")
        if d.get("extra_features"):
            extra = d["extra_features"]
            notes.append(
                f"- {label}: {int(extra.get('rows', 0)):,} extra distractor features from {extra.get('file')}"
            )
        probes_removed = (report.get("probes") or {}).get("removed")
        if "cleaned" in report["results"] and (probes_removed is not None or d.get("removed") is not None):
            notes.append(
                f"- {label}: cleaned = {probes_removed or 0:,} noisy probe images removed, "
                f"{d.get('removed') or 0:,} noisy distractors kept in the count but never ranked"
            )
    return notes


def _papers_section(reports: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """The papers' numbers: beside the comparable runs, or apart with a note when none is."""
    comparable = [i for i, r in enumerate(reports) if _comparable(r)]
    if not comparable:
        return _papers_apart(reports)
    lines = ["## MegaFace Challenge 1 at 1M distractors: this run and the papers", ""]
    ours = [row for i in comparable for row in _comparable_rows(reports[i], labels[i])]
    lines += markdown_table(
        ["method", "arch", "training data", "rank-1 @1M", "TAR @1e-6"],
        ours + _paper_rows(with_source=False),
        numeric_from=3,
    )
    others = [labels[i] for i in range(len(reports)) if i not in comparable]
    if others:
        lines += ["", f"Not in this comparison (not the MegaFace protocol at 1M): {', '.join(others)}."]
    return lines


def _comparable_rows(report: dict[str, Any], label: str) -> list[list[str]]:
    """A comparable report's rows beside the papers': rank-1 and TAR at FAR 1e-6 at 1M (or its
    largest count, named in the row)."""
    size = PAPER_DISTRACTORS if PAPER_DISTRACTORS in _sizes(report) else _largest(report)
    rows = []
    for variant in _variants(report):
        result = report["results"][variant]
        at = "" if size == PAPER_DISTRACTORS else f", N = {size:,}"
        method = f"{label} ({variant}, this run{at})"
        rows.append(
            [
                method,
                MISSING,
                MISSING,
                percent(_rate(result, size, "rank1")),
                percent(_tar(result, size, "1e-06")),
            ]
        )
    return rows


def _papers_apart(reports: list[dict[str, Any]]) -> list[str]:
    """The papers' table on its own, with a note naming the reports' protocols."""
    protocols = list(dict.fromkeys(str(r.get("protocol", "?")) for r in reports))
    lines = [
        "## The papers: MegaFace Challenge 1 at 1M distractors",
        "",
        "The papers used FaceScrub probes and the 1M MegaFace distractors, so these numbers are not "
        f"comparable with the protocol{'s' if len(protocols) > 1 else ''} of the reports above "
        f"({', '.join(f'`{p}`' for p in protocols)}).",
        "",
    ]
    return lines + markdown_table(
        ["source", "method", "arch", "training data", "rank-1 @1M", "TAR @1e-6"],
        _paper_rows(with_source=True),
        numeric_from=4,
    )


def load_reports(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Read MegaFace report JSON files; MegaFaceDataError naming the file when one is missing, is not
    valid JSON or is not a MegaFace report."""
    reports = []
    for item in paths:
        path = Path(item)
        if not path.is_file():
            raise MegaFaceDataError(f"MegaFace report {path} does not exist (or is not a file)")
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MegaFaceDataError(f"MegaFace report {path} is not valid JSON: {exc}") from exc
        except OSError as exc:
            raise MegaFaceDataError(f"MegaFace report {path} cannot be read: {exc}") from exc
        problem = _check_report(report, f"{path}")
        if problem:
            raise MegaFaceDataError(problem)
        reports.append(report)
    return reports
