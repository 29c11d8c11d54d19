"""The GPU check: one command that runs the project's GPU paths and measures them, within a time budget.

Run on a lent GPU machine from the repository root, with the pack that ``bench/gpu_pack.py``
(``make gpu-pack``) built on the CPU machine carried along::

    PYTHONPATH=. python3 bench/gpu_check.py --pack .cache/gpu-pack --out "$OUT"

and on the CPU, tiny (what ``make test`` runs, so the script cannot rot)::

    .venv/bin/python bench/gpu_check.py --device cpu --pack /tmp/pack --out /tmp/gpu-check

Sections, in this order (docs/gpu.md says what each measures): ``environment`` (the machine; the
pack decoded), ``train`` (SphereFace-20, bf16, A-Softmax m = 4 with the GPU-resident and the
streaming loader, resume, SphereFace+), ``export`` (ONNX and its parity, the LFW subset on the
device against ONNX), ``throughput`` (training images/s at batch 256 and 512 against a plain
DataLoader + PIL), ``floor`` (the arithmetic floor from our own FLOP count), ``inference``
(onnxruntime's CUDA provider, else torch on the GPU), ``megaface`` (search at 1M distractors, cuda
against CPU) and ``compile`` (torch.compile, last: only when time is left).

Each section has a time budget; one that would not fit in what is left of ``--budget`` is skipped,
one that overruns its budget by half is stopped, and the table of what ran is always printed last.
``gpu_check.json`` in ``--out`` is rewritten after every section, so a run killed from outside
still leaves what it measured. Written for torch 2.11 (the GPU machine's) as well as 2.13: it uses
no torch API newer than 2.11. The exit status is 1 when a check failed.
"""

from __future__ import annotations

import os

# cuBLAS needs this before CUDA starts to compute deterministically (the train section's comparisons).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# First, also under PYTHONPATH=.: the script's own folder holds a bench/models.py that would hide models/.
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu_common import FULL, TINY, Check, Row, Sizes, Skip  # noqa: E402
from bench.gpu_long import long_section  # noqa: E402
from bench.gpu_pack import read_pack  # noqa: E402
from bench.gpu_speed import compile_section, floor_section, megaface_section, throughput_section  # noqa: E402
from bench.gpu_train import environment, export_section, inference_section, train_section  # noqa: E402

#: ``section(check, until, rows, details)``: appends its table rows and fills its JSON details as it
#: goes, so that what it measured before an error or a timeout is kept.
Section = Callable[[Check, float, list[Row], dict[str, Any]], None]
#: The sections in the order they run (the floor after the throughput it compares with).
SECTIONS: dict[str, Section] = {
    "environment": environment,
    "train": train_section,
    "export": export_section,
    "throughput": throughput_section,
    "floor": floor_section,
    "inference": inference_section,
    "megaface": megaface_section,
    "compile": compile_section,
    "long": long_section,
}
#: Sections that run only when ``--sections`` names them.
OPT_IN = ("long",)
#: Seconds past a section's hard limit (its budget and a half) before it is stopped.
ALARM_GRACE_S = 5.0
JSON_NAME = "gpu_check.json"
TABLE_NAME = "gpu_check.md"


class SectionTimeout(Exception):
    """A section ran past its hard limit (its budget and a half)."""


@contextmanager
def _alarm(seconds: float):
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (SIGALRM)."""

    def ring(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"stopped after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(0.5, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Report:
    """The sections' rows and details, written to ``--out`` after each section."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out = out
        self.header = header
        self.sections: list[dict[str, Any]] = []
        self.started = time.perf_counter()

    def add(self, name: str, status: str, seconds: float, rows: list[Row], details: dict[str, Any]) -> None:
        self.sections.append({
            "section": name, "status": status, "seconds": round(seconds, 2),
            "rows": [row.__dict__ for row in rows], "details": details,
        })  # fmt: skip
        self.write()

    def failed(self) -> bool:
        return any(row["status"] == "FAIL" for s in self.sections for row in s["rows"])

    def table(self) -> str:
        lines = ["| check | status | s | result |", "|---|---|---|---|"]
        for section in self.sections:
            for k, row in enumerate(section["rows"]):
                seconds = f"{section['seconds']:.0f}" if k == 0 else ""
                result = row["result"].replace("|", "/")
                lines.append(f"| {row['label']} | {row['status']} | {seconds} | {result} |")
        total = time.perf_counter() - self.started
        lines.append(f"\n{len(self.sections)} sections in {total:.0f} s; {self.header['command']}")
        return "\n".join(lines)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        body = {**self.header, "total_s": time.perf_counter() - self.started, "sections": self.sections}
        partial = self.out / (JSON_NAME + ".partial")
        partial.write_text(json.dumps(body, indent=1, default=str) + "\n")
        partial.replace(self.out / JSON_NAME)
        (self.out / TABLE_NAME).write_text(self.table() + "\n")


def _run_section(
    name: str, fn: Section, check: Check, budget: float
) -> tuple[str, list[Row], dict[str, Any]]:
    """One section under its budget: ``(status, rows, details)``; an error adds a FAIL row to what
    the section had already found."""
    left = check.left()
    if budget > left:
        return "skipped", [Row(name, "skipped", f"needs up to {budget:.0f} s, {left:.0f} s left")], {}
    rows: list[Row] = []
    details: dict[str, Any] = {}
    try:
        with _alarm(min(1.5 * budget, left) + ALARM_GRACE_S):
            fn(check, time.perf_counter() + budget, rows, details)
        return "ok", rows, details
    except Skip as exc:
        return "skipped", [*rows, Row(name, "skipped", str(exc))], details
    except (Exception, SectionTimeout) as exc:
        lines = traceback.format_exception(exc)
        print("".join(lines), file=sys.stderr, flush=True)
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        details["traceback"] = lines[-12:]
        return "FAIL", [*rows, Row(name, "FAIL", message)], details


def run(check: Check, report: Report, chosen: list[str]) -> None:
    """Every chosen section in order, each row printed as it comes."""
    for name, fn in SECTIONS.items():
        if name not in chosen:
            continue
        print(f"[gpu-check] {name} ({check.left():.0f} s left) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        status, rows, details = _run_section(name, fn, check, check.sizes.budgets[name])
        seconds = time.perf_counter() - started
        report.add(name, status, seconds, rows, details)
        for row in rows:
            print(f"[gpu-check] {row.label}: {row.status}: {row.result}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    ap.add_argument("--pack", default=".cache/gpu-pack", help="the folder bench/gpu_pack.py wrote")
    out_help = "where gpu_check.json and gpu_check.md go (default: $OUT, else runs/gpu_check)"
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help=out_help)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--size", default="auto", choices=("auto", "full", "tiny"),
                    help="full on a GPU, tiny on the CPU (auto)")  # fmt: skip
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds for all sections (450 full, 240 tiny)"
    )
    sections_help = (
        f"comma-separated, from: {', '.join(SECTIONS)} (default: all but long, and but compile on tiny); "
        "environment always runs"
    )
    ap.add_argument("--sections", default=None, help=sections_help)
    ap.add_argument(
        "--long-set", action="append", default=[], metavar="KEY=VALUE",
        help="override the long run's config (repeatable), e.g. lr=0.025",
    )  # fmt: skip
    ap.add_argument(
        "--work", default=None, help="scratch folder (default: a temporary one, removed at the end)"
    )
    return ap.parse_args(argv)


def _sizes(args: argparse.Namespace, device: torch.device) -> Sizes:
    size = args.size if args.size != "auto" else ("full" if device.type == "cuda" else "tiny")
    return FULL if size == "full" else TINY


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    wanted = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(wanted)
    sizes = _sizes(args, device)
    budget = args.budget if args.budget is not None else (450.0 if sizes is FULL else 240.0)
    default = [s for s in SECTIONS if (sizes is FULL or s != "compile") and s not in OPT_IN]
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else default
    chosen = ["environment", *chosen]  # every other section reads the pack it decodes
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    pack = read_pack(args.pack)
    command = "python bench/gpu_check.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    header = {
        "what": "bench/gpu_check.py", "command": command, "device": str(device), "budget_s": budget,
        "sizes": sizes.__dict__, "pack": {k: v for k, v in pack.info.items() if k != "identities"},
    }  # fmt: skip
    report = Report(Path(args.out), header)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        work = Path(args.work) if args.work else Path(scratch)
        check = Check(device, sizes, pack, work, time.perf_counter() + budget, out=Path(args.out))
        check.long_set = args.long_set
        run(check, report, chosen)
    report.write()
    print(report.table(), flush=True)
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
