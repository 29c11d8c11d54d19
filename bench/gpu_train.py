"""The GPU check's sections on the project's own paths: environment, training, resume, export, serving.

* ``environment``: the GPU, driver, torch, CUDA, cuDNN, onnxruntime; the pack decoded into a prepared
  folder (``sphereface prepare``'s format).
* ``train``: :func:`training.trainer.train` on the pack, SphereFace-20 from ``training/configs/base.toml``
  (A-Softmax m = 4, the papers' recipe) with bf16 on a GPU: the device-resident loader, the same run
  stopped half way and resumed, the streaming loader, then SphereFace+ from
  ``training/configs/casia_sphereface20_plus.toml`` fine-tuning the first run. The first three run
  with deterministic algorithms, so the resumed and the streamed run can be compared with the
  first bit for bit.
* ``export``: ``sphereface export``'s job (ONNX, parity against PyTorch on ONNX Runtime's CPU
  provider), then the LFW subset embedded by PyTorch on the device (fp32 and bf16) and by the ONNX
  file: features and accuracy side by side.
* ``inference``: onnxruntime's CUDA provider when the installed build has it (and which provider
  the session really took), else torch on the device; ONNX Runtime on the CPU for comparison.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.gpu_common import Check, Row, Skip, images_per_s, rate_text
from bench.gpu_pack import lfw_of, unpack
from bench.gpu_speed import shared_memory_free

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "training" / "configs" / "base.toml"
PLUS_CONFIG = ROOT / "training" / "configs" / "casia_sphereface20_plus.toml"
#: A resumed or streamed run within this relative weight difference of the first run is "ok (within
#: tolerance)" when not bit-exact: the project's own choice, about what bf16 rounding of one
#: step differently ordered leaves after a hundred steps.
WEIGHT_RTOL = 1e-3
#: The smallest cosine accepted between a face's fp32 features from PyTorch on the device and from the
#: ONNX file on ONNX Runtime's CPU provider (cuDNN's TF32 convolutions, torch's default, included).
MIN_COSINE = 0.999


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def _driver() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def environment(check: Check, until: float, rows: list[Row], info: dict[str, Any]) -> None:
    """What the machine is, and the pack decoded into a prepared folder."""
    import onnxruntime as ort

    info.update({
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "onnxruntime": ort.__version__, "ort_providers": ort.get_available_providers(),
        "cpu": _cpu_model(), "cpus": len(os.sched_getaffinity(0)),
    })  # fmt: skip
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        info.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(), driver=_driver(),
        )  # fmt: skip
        what = (
            f"{info['gpu']} (sm {info['capability']}, {info['gpu_memory_gib']} GiB), "
            f"driver {info['driver']}, "
            f"torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}"
        )
    else:
        what = f"CPU only: {info['cpu']}, torch {info['torch']}"
    info["shm_free_gib"] = round((shared_memory_free() or 0) / 2**30, 1)
    what += (
        f"; {info['cpus']} CPUs; /dev/shm {info['shm_free_gib']} GiB free; onnxruntime {info['onnxruntime']}"
    )
    rows.append(Row("machine", "ok", what))
    started = time.perf_counter()
    check.prepared = unpack(check.pack, check.work / "prepared", workers=min(8, info["cpus"]))
    info["unpack_s"] = time.perf_counter() - started
    pack = check.pack.info
    unpacked = (
        f"{pack['faces']:,} crops of {len(pack['identities'])} identities decoded from "
        f"{pack['bytes'] / 2**20:.1f} MiB of JPEG in {info['unpack_s']:.1f} s"
    )
    rows.append(Row("pack", "ok", unpacked))


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------


def _config(check: Check, path: Path, name: str, *extra: str) -> Any:
    from training.config import load_config

    sizes = check.sizes
    overrides = [
        f"name={name}", f"data={json.dumps(str(check.prepared))}",
        f"out_dir={json.dumps(str(check.work / 'runs'))}", 'lfw=""', f"network={sizes.network}",
        f"batch_size={sizes.train_batch}", f"steps={sizes.train_steps}", f"device={check.device.type}",
        f"precision={'bf16' if check.cuda else 'fp32'}", f"log_every={max(1, sizes.train_steps // 10)}",
        "checkpoint_every=0", *extra,
    ]  # fmt: skip
    if sizes.embedding_size is not None:
        overrides.append(f"embedding_size={sizes.embedding_size}")
    return load_config(path, overrides)


def _deterministic(on: bool) -> None:
    """Deterministic algorithms (warn, do not fail, where an op has none) for comparable runs."""
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(on, warn_only=True)


def _log_summary(run_dir: Path) -> dict[str, Any]:
    from training.run_log import read_log

    log = read_log(run_dir / "log.csv")
    rates = log["images_per_s"][1:] if len(log["images_per_s"]) > 1 else log["images_per_s"]
    return {
        "first_loss": float(log["loss"][0]),
        "last_loss": float(log["loss"][-1]),
        "last_accuracy": float(log["accuracy"][-1]),
        "last_mhe": float(log["mhe"][-1]),
        "trainer_images_per_s": float(np.median(rates)),
        "rows": len(log["loss"]),
    }


def _weights_diff(a: Path, b: Path) -> dict[str, Any]:
    """Bit-equality and the largest difference of the network and classifier weights of two runs."""
    from training.trainer import load_checkpoint

    sa, sb = load_checkpoint(a), load_checkpoint(b)
    equal, worst, scale = True, 0.0, 0.0
    for part in ("net", "head"):
        for key, value in sa[part].items():
            other = sb[part][key]
            equal = equal and torch.equal(value, other)
            worst = max(worst, float((value.float() - other.float()).abs().max()))
            scale = max(scale, float(value.float().abs().max()))
    return {"bit_exact": equal, "max_abs_diff": worst, "max_rel_diff": worst / max(scale, 1e-30)}


def _diff_row(label: str, diff: dict[str, Any]) -> Row:
    if diff["bit_exact"]:
        return Row(label, "ok", "bit-exact")
    status = "ok" if diff["max_rel_diff"] <= WEIGHT_RTOL else "FAIL"
    return Row(
        label, status,
        f"not bit-exact: max abs diff {diff['max_abs_diff']:.3g} ({diff['max_rel_diff']:.2g} of the largest "
        f"weight; tolerance {WEIGHT_RTOL:g}); the JSON lists the ops without a deterministic implementation",
    )  # fmt: skip


def _run_text(config: Any, summary: dict[str, Any], check: Check) -> str:
    precision = "bf16" if check.cuda else "fp32"
    text = (
        f"{config.steps} step{'s' if config.steps != 1 else ''} of {config.batch_size}, {config.network}, "
        f"{precision}: loss "
        f"{summary['first_loss']:.2f} -> {summary['last_loss']:.2f}, acc {summary['last_accuracy']:.3f}, "
        f"{summary['trainer_images_per_s']:,.0f} img/s (trainer)"
    )
    if not math.isnan(summary["last_mhe"]):
        text += f", MHE {summary['last_mhe']:.3g}"
    return text


def _train_one(config: Any, until_step: int | None = None, resume: bool = False) -> Path:
    from training.trainer import train

    result = train(config, resume=resume, progress=False, until_step=until_step)
    return result.run_dir


def _trained_row(label: str, config: Any, check: Check, rows: list[Row], details: dict[str, Any]) -> Path:
    """Train ``config`` to its end; its row says whether the loss stayed finite, and its numbers."""
    run_dir = _train_one(config)
    summary = details[config.name] = _log_summary(run_dir)
    ok = math.isfinite(summary["last_loss"])
    rows.append(Row(label, "ok" if ok else "FAIL", _run_text(config, summary, check)))
    return run_dir


def _deterministic_runs(check: Check, rows: list[Row], details: dict[str, Any]) -> Path:
    """The m = 4 runs: device loader, resumed half way, streaming loader; returns the first's folder."""
    half = max(1, check.sizes.train_steps // 2)
    device_cfg = _config(check, BASE_CONFIG, "m4_device", "loader=device")
    first = _trained_row("train m=4, GPU-resident loader", device_cfg, check, rows, details)
    check.found["checkpoint"] = first / "checkpoint.pt"
    resumed_cfg = _config(check, BASE_CONFIG, "m4_resumed", "loader=device")
    _train_one(resumed_cfg, until_step=half)
    resumed = _train_one(resumed_cfg, resume=True)
    details["resume"] = _weights_diff(first / "checkpoint.pt", resumed / "checkpoint.pt")
    rows.append(_diff_row(f"resume at step {half} = uninterrupted", details["resume"]))
    stream_cfg = _config(check, BASE_CONFIG, "m4_stream", "loader=stream")
    stream = _trained_row("train m=4, streaming loader", stream_cfg, check, rows, details)
    details["stream_vs_device"] = _weights_diff(first / "checkpoint.pt", stream / "checkpoint.pt")
    rows.append(_diff_row("streaming loader = GPU-resident loader", details["stream_vs_device"]))
    return first


def train_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """The four runs and their comparisons (see the module's doc)."""
    if check.prepared is None:
        raise Skip("needs the environment section (the unpacked pack)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _deterministic(True)
        try:
            first = _deterministic_runs(check, rows, details)
        finally:
            _deterministic(False)
            messages = {str(w.message).splitlines()[0][:200] for w in caught}
            details["nondeterministic_ops"] = sorted(m for m in messages if "determinis" in m)
    plus_cfg = _config(
        check, PLUS_CONFIG, "plus_device", "loader=device", f"steps={max(1, check.sizes.train_steps // 2)}",
        f"init_from={json.dumps(str(first / 'checkpoint.pt'))}",
    )  # fmt: skip
    _trained_row("train SphereFace+ from the m=4 run", plus_cfg, check, rows, details)
    check.found["trainer_images_per_s"] = details["plus_device"]["trainer_images_per_s"]
    configs = check.work / "runs"
    details["configs"] = {p.parent.name: p.read_text() for p in sorted(configs.glob("*/config.toml"))}


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


def _trained_net(checkpoint: Path, device: torch.device) -> torch.nn.Module:
    """The run's embedding network in eval mode on ``device`` (channels-last on a GPU)."""
    from models.nets import build_network
    from training.trainer import load_checkpoint

    state = load_checkpoint(checkpoint)
    net = build_network(state["network"], state["embedding_size"])
    net.load_state_dict(state["net"])
    net.eval().to(device)
    if device.type == "cuda":
        net.to(memory_format=torch.channels_last)
    return net


def _torch_features(net: torch.nn.Module, x: torch.Tensor, device: torch.device, bf16: bool) -> np.ndarray:
    out = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for a in range(0, len(x), 256):
            out.append(net(x[a : a + 256].to(device)).float().cpu())
    return torch.cat(out).numpy()


def _onnx_features(session: Any, x: np.ndarray) -> np.ndarray:
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[a : a + 64]})[0] for a in range(0, len(x), 64)])


def _lfw_accuracy(features: np.ndarray, pairs: dict[str, Any]) -> float:
    from training.evaluation.verification import lfw_10fold_accuracy

    left, right = features[pairs["left"]], features[pairs["right"]]
    return lfw_10fold_accuracy(left, right, np.asarray(pairs["is_same"]), np.asarray(pairs["fold"])).accuracy


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.min(np.sum(a * b, axis=1)))


def _lfw_parity(check: Check, model_dir: Path, rows: list[Row], details: dict[str, Any]) -> None:
    """The LFW subset through PyTorch on the device (fp32, bf16) and through the ONNX file (CPU)."""
    from models.runtime import create_session
    from training.data import to_network_input

    crops, pairs = lfw_of(check.pack)
    x = to_network_input(torch.from_numpy(crops)).contiguous()
    net = _trained_net(check.found["checkpoint"], check.device)
    features = {
        "onnx_cpu": _onnx_features(create_session(model_dir / "model.onnx", "cpu"), x.numpy()),
        "torch_fp32": _torch_features(net, x, check.device, bf16=False),
        "torch_bf16": _torch_features(net, x, check.device, bf16=True),
    }
    accuracy = {name: _lfw_accuracy(f, pairs) for name, f in features.items()}
    cosine = {
        name: _min_cosine(f, features["onnx_cpu"]) for name, f in features.items() if name != "onnx_cpu"
    }
    details["lfw_subset"] = {"pairs": len(pairs["is_same"]), "accuracy": accuracy, "min_cosine": cosine}
    text = (
        f"{len(pairs['is_same'])} pairs, 10 folds ({pairs['landmarks']} landmarks): accuracy ONNX "
        f"{100 * accuracy['onnx_cpu']:.2f}%, torch {check.device.type} fp32 "
        f"{100 * accuracy['torch_fp32']:.2f}%, "
        f"bf16 {100 * accuracy['torch_bf16']:.2f}%; min cos to ONNX: fp32 {cosine['torch_fp32']:.5f} "
        f"(needs {MIN_COSINE}), bf16 {cosine['torch_bf16']:.4f}"
    )
    rows.append(
        Row("LFW subset: device vs ONNX", "ok" if cosine["torch_fp32"] >= MIN_COSINE else "FAIL", text)
    )


def export_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """``sphereface export``'s job on the first run's checkpoint, then the LFW-subset comparison."""
    from training.export import export_checkpoint

    checkpoint = check.need("checkpoint", "train")
    model_dir = check.work / "model"
    started = time.perf_counter()
    _, report = export_checkpoint(checkpoint, model_dir, progress=False)
    seconds = time.perf_counter() - started
    check.found["model_dir"] = model_dir
    size = (model_dir / "model.onnx").stat().st_size
    details.update(export_s=seconds, onnx_bytes=size, **report)
    rows.append(Row(
        "export + ONNX parity", "ok",
        f"model.onnx {size / 2**20:.0f} MiB in {seconds:.0f} s; ONNX Runtime CPU vs PyTorch CPU max abs diff "
        f"{report['onnx_parity_max_abs_diff']:.2g} (tolerance 1e-3)",
    ))  # fmt: skip
    if check.pack.has_lfw:
        _lfw_parity(check, model_dir, rows, details)


# --------------------------------------------------------------------------------------------
# inference
# --------------------------------------------------------------------------------------------


def _ort_rate(session: Any, batch: int, until: float) -> dict[str, float | int]:
    x = np.random.default_rng(0).standard_normal((batch, 3, 112, 96)).astype(np.float32)
    name = session.get_inputs()[0].name
    return images_per_s(lambda: session.run(None, {name: x}), batch, torch.device("cpu"), 2, 3, until)


def _torch_rate(net: torch.nn.Module, check: Check, bf16: bool, until: float) -> dict[str, float | int]:
    batch = check.sizes.inference_batch
    x = torch.randn(batch, 3, 112, 96, device=check.device)
    if check.cuda:
        x = x.contiguous(memory_format=torch.channels_last)

    def embed() -> torch.Tensor:
        with torch.no_grad(), torch.autocast(check.device.type, dtype=torch.bfloat16, enabled=bf16):
            return net(x)

    return images_per_s(embed, batch, check.device, 10 if check.cuda else 1, 3, until)


def _ort_cuda_row(onnx: Path, check: Check, until: float, details: dict[str, Any]) -> Row:
    """onnxruntime's CUDA provider, and the provider the session really took; n/a on a CPU build."""
    import onnxruntime as ort

    from models.runtime import create_session, session_provider

    providers = details["providers"] = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return Row(
            "onnxruntime CUDA provider", "n/a",
            f"onnxruntime {ort.__version__} offers {', '.join(providers)} only (a CPU build): timed the "
            f"same network in torch on {check.device.type} instead",
        )  # fmt: skip
    session = create_session(onnx, "cuda", allow_fallback=True)
    got = details["cuda_session_provider"] = session_provider(session)
    details["ort_cuda"] = _ort_rate(session, check.sizes.inference_batch, until)
    text = f"the session runs on {got}: {rate_text(details['ort_cuda'])} img/s"
    text += f" at batch {check.sizes.inference_batch}"
    return Row("onnxruntime CUDA provider", "ok" if got == "CUDAExecutionProvider" else "FAIL", text)


def inference_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """The exported model served: onnxruntime's CUDA provider if it is there, else torch on the device;
    ONNX Runtime on the CPU beside it."""
    import onnxruntime as ort

    from models.runtime import create_session

    onnx = check.need("model_dir", "export") / "model.onnx"
    details["onnxruntime"] = ort.__version__
    rows.append(_ort_cuda_row(onnx, check, until, details))
    net = _trained_net(check.need("checkpoint", "train"), check.device)
    details["torch_fp32"] = _torch_rate(net, check, False, until)
    details["torch_bf16"] = _torch_rate(net, check, True, until)
    details["ort_cpu"] = _ort_rate(create_session(onnx, "cpu"), check.sizes.ort_cpu_batch, until)
    rows.append(Row(
        "embedding speed", "ok",
        f"torch {check.device.type} fp32 {rate_text(details['torch_fp32'])}, bf16 "
        f"{rate_text(details['torch_bf16'])} img/s (batch {check.sizes.inference_batch}); ONNX Runtime CPU "
        f"{rate_text(details['ort_cpu'])} img/s (batch {check.sizes.ort_cpu_batch})",
    ))  # fmt: skip
