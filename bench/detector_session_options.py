"""ONNX Runtime session options of the MTCNN sessions: does any of them detect the photos faster?

The shipped detector (intra-op spinning off, memory pattern and CPU arena on, as
``models/runtime.create_session`` sets them) against variants that change one option each. Every
variant detects the same real photos (``photos/``, decoded once) one at a time; rounds are
interleaved (the order of the variants rotates each round); each figure is the median ms per photo
over the rounds, with the range of the round values. ``--max-side 0`` (the default) searches the
photos at full resolution, as ``make bench`` does; the service's setting is 1024.

    .venv/bin/python bench/detector_session_options.py --json docs/results/bench_detector_session_options.json

``--profile-pnet`` adds ONNX Runtime's own profile of the shipped P-Net over the photos (twice):
its time per operator type, as a share of all its operators' time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.detector_threads import summary  # noqa: E402
from models.image import decode_image  # noqa: E402
from models.mtcnn import MTCNNDetector  # noqa: E402

#: Variant name -> (session attributes, session config entries) changed from the shipped ones.
VARIANTS: dict[str, tuple[dict[str, bool], dict[str, str]]] = {
    "shipped": ({}, {}),
    "intra-op spinning on": ({}, {"session.intra_op.allow_spinning": "1"}),
    "memory pattern off": ({"enable_mem_pattern": False}, {}),
    "CPU arena off": ({"enable_cpu_mem_arena": False}, {}),
}


@contextmanager
def session_options(configure: Callable[[ort.SessionOptions], None]) -> Iterator[None]:
    """Sessions opened inside get their ``SessionOptions`` passed through ``configure`` first."""
    shipped = ort.SessionOptions

    class Configured(shipped):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            configure(self)

    ort.SessionOptions = Configured
    try:
        yield
    finally:
        ort.SessionOptions = shipped


def detector_with(
    attributes: dict[str, bool], entries: dict[str, str], max_side: int | None
) -> MTCNNDetector:
    """An MTCNN detector whose sessions are opened with these options changed."""

    def configure(options: ort.SessionOptions) -> None:
        for name, value in attributes.items():
            setattr(options, name, value)
        # create_session sets its config entries after this: wrap the setter to change them.
        add_entry = options.add_session_config_entry
        options.add_session_config_entry = lambda key, value: add_entry(key, entries.get(key, value))

    with session_options(configure):
        return MTCNNDetector(max_image_side=max_side)


def pnet_operator_profile(images: list, max_side: int | None) -> dict[str, float]:
    """Share of the shipped P-Net's operator time per operator type, over the images twice."""
    with tempfile.TemporaryDirectory() as folder:

        def configure(options: ort.SessionOptions) -> None:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(folder) / "pnet")

        with session_options(configure):
            # one stage at a time: every P-Net call then goes through det.pnet, the session profiled
            # (side by side, a large photo's levels run on one-thread copies)
            det = MTCNNDetector(max_image_side=max_side, side_by_side=False)
        for image in images + images:
            det.detect(image)
        events = json.loads(Path(det.pnet.end_profiling()).read_text())
    per_op: Counter[str] = Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]
    total = sum(per_op.values())
    return {op: us / total for op, us in per_op.most_common()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-side", type=int, default=0, help="0: full resolution")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile-pnet", action="store_true", help="also ORT's operator profile of P-Net")
    args = p.parse_args(argv)
    paths = sorted((args.data / "photos").rglob("*.jpg"))
    if len(paths) < 2:
        p.error(f"no photos under {args.data / 'photos'} (../shared/data is needed)")
    images = [decode_image(path.read_bytes()) for path in paths]
    max_side = args.max_side or None
    variants = {name: detector_with(*change, max_side) for name, change in VARIANTS.items()}
    for det in variants.values():  # warm-up
        for image in images[:3]:
            det.detect(image)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for image in images:
                variants[name].detect(image)
            times[name].append((time.perf_counter() - t0) / len(images) * 1e3)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    report = {
        "command": "python bench/detector_session_options.py " + " ".join(sys.argv[1:]),
        "photos": len(images),
        "max_side": max_side,
        "rounds": args.rounds,
        "onnxruntime": ort.__version__,
        "loadavg": list(os.getloadavg()),
        "one_photo": {k: summary(v) for k, v in times.items()},
    }
    print("| session options | ms per photo: median (range) |")
    print("|---|---|")
    for name in names:
        o = report["one_photo"][name]
        print(f"| {name} | {o['median_ms']:.1f} ({o['min_ms']:.1f}-{o['max_ms']:.1f}) |")
    if args.profile_pnet:
        report["pnet_operator_share"] = pnet_operator_profile(images, max_side)
        print(
            "P-Net operator time: "
            + ", ".join(f"{op} {share:.0%}" for op, share in report["pnet_operator_share"].items())
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
