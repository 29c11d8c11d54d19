"""The GPU check's opt-in ``long`` section: the papers' recipe trained to convergence on the pack.

SphereFace-20 from ``training/configs/base.toml`` (A-Softmax m = 4, λ annealed as the authors' Caffe
code, lr drops at the same fractions of the run) for ``Sizes.long_steps`` steps of batch 256 in bf16
on the pack's crops, then its LFW-subset accuracy on the device. The network's weights come back for
the full LFW protocol on the CPU machine: the fp32 ONNX file (about 87 MiB) is larger than what the
device tool returns, so the weights travel as fp16 in parts of at most :data:`PART_BYTES`
(``long_net.fp16.pt.partN``), and ``bench/gpu_long_import.py`` joins them into a checkpoint that
``sphereface export`` reads. The subset's accuracy with the fp16-rounded weights is measured on the
device beside the fp32 one, so what the rounding costs is known.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from bench.gpu_common import Check, Row, Skip
from bench.gpu_pack import lfw_of
from bench.gpu_train import BASE_CONFIG, _config, _lfw_accuracy, _log_summary, _torch_features, _train_one

#: The device tool returns files of at most 16 MiB each.
PART_BYTES = 15 * 2**20
PART_PREFIX = "long_net.fp16.pt.part"
#: Checkpoint entries that travel (the optimiser, the classifier and the RNG states stay there).
KEPT = ("net", "config", "network", "embedding_size", "step")


def _fp16_state(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's network in fp16 and what ``sphereface export`` reads beside it."""
    from training.trainer import load_checkpoint

    state = load_checkpoint(checkpoint)
    kept = {key: state[key] for key in KEPT if key in state}
    kept["net"] = {k: v.half() if v.is_floating_point() else v for k, v in state["net"].items()}
    kept["travelled_as"] = "fp16"
    return kept


def write_parts(state: dict[str, Any], out: Path) -> list[Path]:
    """``state`` saved with ``torch.save`` and cut into files of at most :data:`PART_BYTES`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, a in enumerate(range(0, len(data), PART_BYTES)):
        path = out / f"{PART_PREFIX}{k}"
        path.write_bytes(data[a : a + PART_BYTES])
        parts.append(path)
    return parts


def _subset_accuracy(check: Check, net_state: dict[str, Any], state: dict[str, Any]) -> float:
    """LFW-subset accuracy of ``net_state`` (fp32 features on the device)."""
    from models.nets import build_network
    from training.data import to_network_input

    crops, pairs = lfw_of(check.pack)
    net = build_network(state["network"], state["embedding_size"])
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in net_state.items()})
    net.eval().to(check.device)
    x = to_network_input(torch.from_numpy(crops)).contiguous()
    return _lfw_accuracy(_torch_features(net, x, check.device, bf16=False), pairs)


def _curve(run_dir: Path) -> dict[str, list[float]]:
    """The run's logged loss, accuracy, λ, feature norm and lr per step, for the JSON (plots on the
    CPU machine; the feature norm is what runs away before an A-Softmax run turns NaN)."""
    from training.run_log import read_log

    log = read_log(run_dir / "log.csv")
    keep = ("step", "loss", "accuracy", "lambda", "feature_norm", "lr", "images_per_s")
    return {k: [float(v) for v in log[k]] for k in keep if k in log}


def long_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """Train the papers' recipe for ``long_steps``, measure the LFW subset, send the weights home."""
    if check.prepared is None:
        raise Skip("needs the environment section (the unpacked pack)")
    steps = check.sizes.long_steps
    every = max(1, steps // 100)
    overrides = [f"steps={steps}", f"log_every={every}", f"checkpoint_every={10 * every}", *check.long_set]
    config = _config(check, BASE_CONFIG, "long_m4", "loader=device", *overrides)
    details["overrides"] = overrides
    run_dir = check.work / "runs" / config.name
    try:
        _train_one(config)
    except FloatingPointError as exc:  # keep the last good checkpoint's weights and numbers
        details["diverged"] = str(exc)
    if not (run_dir / "checkpoint.pt").is_file():
        raise Skip(f"no checkpoint was written: {details.get('diverged', 'the run stopped early')}")
    summary = details["summary"] = _log_summary(run_dir)
    details["curve"] = _curve(run_dir)
    details["config"] = (run_dir / "config.toml").read_text()
    state = _fp16_state(run_dir / "checkpoint.pt")
    full = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)["net"]
    accuracy = details["lfw_subset"] = {"fp32": None, "fp16_weights": None}
    if check.pack.has_lfw:
        accuracy["fp32"] = _subset_accuracy(check, full, state)
        accuracy["fp16_weights"] = _subset_accuracy(check, state["net"], state)
    parts = write_parts(state, check.out) if check.out is not None else []
    details["parts"] = [p.name for p in parts]
    finite = math.isfinite(summary["last_loss"]) and "diverged" not in details
    step = int(state["step"])
    text = "" if finite else f"diverged ({details['diverged'].split(';')[0]}); kept step {step:,}: "
    text += (
        f"{step:,} of {config.steps:,} steps of {config.batch_size}, lr {config.lr:g}, "
        f"{config.network}, m=4: "
        f"loss {summary['first_loss']:.2f} -> "
        f"{summary['last_loss']:.2f}, acc {summary['last_accuracy']:.3f}, "
        f"{summary['trainer_images_per_s']:,.0f} img/s"
    )
    if accuracy["fp32"] is not None:
        text += f"; LFW subset {100 * accuracy['fp32']:.2f}%"
        text += f" (fp16 weights {100 * accuracy['fp16_weights']:.2f}%)"
    text += f"; weights in {len(parts)} part(s)"
    rows.append(Row("long run, papers' recipe", "ok" if finite else "FAIL", text))
