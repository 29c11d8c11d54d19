"""Join the GPU check's ``long`` run weights (``long_net.fp16.pt.partN``) into a checkpoint.

The device tool returns files of at most 16 MiB, so ``bench/gpu_long.py`` sends the network as fp16
in parts. This joins them, turns the weights back into fp32 and writes a ``checkpoint.pt`` that
``sphereface export`` reads (network and config only: no classifier or optimiser, so it cannot be
resumed)::

    python bench/gpu_long_import.py /work/.device/N --out runs/gpu_long
    sphereface export runs/gpu_long --out runs/gpu_long/model
    sphereface evaluate lfw --model runs/gpu_long/model --data ../shared/data/lfw --landmarks file

(``sphereface export --lfw`` also calibrates thresholds on every LFW pair: 20 minutes more on 2
cores, needed only to serve the model.)
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from the checkout

from bench.gpu_long import PART_PREFIX  # noqa: E402


def read_parts(folder: Path) -> dict[str, Any]:
    """The state saved by :func:`bench.gpu_long.write_parts`, from its parts in ``folder``."""
    parts = sorted(folder.glob(f"{PART_PREFIX}*"), key=lambda p: int(p.name[len(PART_PREFIX) :]))
    if not parts:
        raise SystemExit(f"{folder}: no {PART_PREFIX}N files (run the GPU check with --sections long)")
    expected = [f"{PART_PREFIX}{k}" for k in range(len(parts))]
    if [p.name for p in parts] != expected:
        raise SystemExit(f"{folder}: parts {[p.name for p in parts]} are not 0..{len(parts) - 1}")
    data = b"".join(p.read_bytes() for p in parts)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def to_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """fp32 network weights and an empty classifier: what ``sphereface export`` needs."""
    out = dict(state)
    out["net"] = {k: v.float() if v.is_floating_point() else v for k, v in state["net"].items()}
    out["head"] = {}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", type=Path, help="the folder the device tool returned the files to")
    ap.add_argument("--out", type=Path, required=True, help="run folder to write checkpoint.pt into")
    args = ap.parse_args(argv)
    checkpoint = to_checkpoint(read_parts(args.parts))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, args.out / "checkpoint.pt")
    print(f"{args.out / 'checkpoint.pt'}: {checkpoint['network']} at step {checkpoint['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
