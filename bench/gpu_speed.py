"""The GPU check's speed sections: training throughput, the arithmetic floor, MegaFace search, compile.

* ``throughput``: images/s of full training steps (forward, A-Softmax m = 4, backward, SGD) of the
  same network and head fed four ways, at each batch size, interleaved over rounds: one fixed
  batch already on the device (the model alone; channels-last and NCHW), the GPU-resident loader,
  the streaming loader, and a plain ``torch.utils.data.DataLoader`` whose worker processes decode
  the pack's JPEG files with PIL, flip and normalise them (``pin_memory``, an endless random
  sampler, so no epoch boundary stalls it).
* ``floor``: the network's multiply-accumulates counted from its definition
  (:func:`sphereface_macs`, checked against the shapes the built network produces), the device's
  bf16 matrix-product rate measured here, and the images/s that rate would allow.
* ``megaface``: :func:`training.evaluation.megaface_search.search_distractors` over synthetic unit
  features (probes x 1,000,000 distractors, 512 dimensions) on ``cuda`` and on the CPU, timed, with
  their results compared.
* ``compile``: the fixed-batch step with the embedding network under ``torch.compile`` (the head
  stays eager: its step argument would make every step a new graph).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from bench.gpu_common import Check, Row, Skip, images_per_s, rate_text, spread, synchronize
from bench.gpu_pack import decode

#: The lambda schedule's step used in timed steps (lambda at its floor; the cost does not depend on it).
TIMED_STEP = 10_000


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


def sphereface_macs(
    depth: int, embedding_size: int = 512, size: tuple[int, int] = (112, 96)
) -> dict[str, int]:
    """Multiply-accumulates of one forward pass of SphereFace-``depth``, from its definition.

    Every stage opens with a 3x3/2 convolution (padding 1: the map halves, rounded up) and holds
    ``units`` residual units of two 3x3/1 convolutions at its width (thesis Table 2.7,
    :data:`models.nets.sphereface.SPHEREFACE_UNITS` and ``SPHEREFACE_CHANNELS``); FC1 maps the last
    map to the embedding. A 3x3 convolution costs ``H x W x C_out x C_in x 9`` MACs. PReLU, the
    residual additions and the biases (element-wise, memory-bound) are not counted.
    """
    from models.nets.sphereface import SPHEREFACE_CHANNELS, SPHEREFACE_UNITS

    height, width = size
    c_in = 3
    counts: dict[str, int] = {}
    for k, (c_out, units) in enumerate(zip(SPHEREFACE_CHANNELS, SPHEREFACE_UNITS[depth], strict=True)):
        height, width = (height + 1) // 2, (width + 1) // 2
        opening = height * width * c_out * c_in * 9
        residual = units * 2 * height * width * c_out * c_out * 9
        counts[f"stage{k}"] = opening + residual
        c_in = c_out
    counts["fc1"] = c_in * height * width * embedding_size
    counts["total"] = sum(counts.values())
    return counts


def hooked_macs(net: torch.nn.Module, input_shape: tuple[int, int, int] = (3, 112, 96)) -> int:
    """MACs of the ``Conv2d`` and ``Linear`` layers of ``net``, from the shapes one forward pass produces."""
    total = 0

    def conv(module: torch.nn.Conv2d, _: Any, out: torch.Tensor) -> None:
        nonlocal total
        kh, kw = module.kernel_size
        total += out[0].numel() * (module.in_channels // module.groups) * kh * kw

    def linear(module: torch.nn.Linear, _: Any, out: torch.Tensor) -> None:
        nonlocal total
        total += out[0].numel() * module.in_features

    hooks = []
    for module in net.modules():
        if isinstance(module, torch.nn.Conv2d):
            hooks.append(module.register_forward_hook(conv))
        elif isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(linear))
    try:
        with torch.no_grad():
            net(torch.zeros(1, *input_shape, device=next(net.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    return total


def _matmul_tflops(device: torch.device, n: int, until: float) -> float:
    """The device's dense matrix-product rate, TFLOP/s: ``n x n x n`` products, bf16 on a GPU
    (fp32 on the CPU), the best of 3 to 5 rounds of 10."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    synchronize(device)
    best = 0.0
    for k in range(5):
        started = time.perf_counter()
        for _ in range(10):
            a @ b
        synchronize(device)
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - started) / 1e12)
        if k >= 2 and time.perf_counter() > until:
            break
    return best


def floor_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """The arithmetic floor of a training step and how far the measured rates are from it."""
    from models.nets import build_network

    depth = int(check.sizes.network.removeprefix("sphereface"))
    embedding = check.sizes.embedding_size or 512
    counts = sphereface_macs(depth, embedding)
    hooked = hooked_macs(build_network(check.sizes.network, embedding))
    classes = len(check.pack.identities)
    per_image = 2 * (counts["total"] + embedding * classes)  # FLOPs, forward, with the classifier
    train_flops = 3 * per_image  # forward, input gradient, weight gradient
    peak = _matmul_tflops(check.device, check.sizes.matmul_size, until)
    floor = peak * 1e12 / train_flops
    measured = check.found.get("best_images_per_s")
    details.update({
        "network": check.sizes.network, "macs_forward": counts, "macs_hooked": hooked,
        "classifier_macs": embedding * classes, "flops_forward_per_image": per_image,
        "flops_train_per_image": train_flops, "matmul_tflops": peak, "floor_images_per_s": floor,
        "best_measured_images_per_s": measured,
        "tflops_at_best_measured": measured * train_flops / 1e12 if measured else None,
    })  # fmt: skip
    ok = hooked == counts["total"]
    text = (
        f"{check.sizes.network}: {counts['total'] / 1e9:.3f} GMAC = {per_image / 1e9:.2f} GFLOP forward per "
        f"image (own count{'' if ok else ', DISAGREES with the hooked count ' + format(hooked, ',')}), "
        f"x3 = {train_flops / 1e9:.1f} GFLOP a training step; matmul {peak:,.4g} TFLOP/s -> floor "
        f"{floor:,.0f} img/s"
    )
    if measured:
        text += f"; best measured {measured:,.0f} img/s = {100 * measured / floor:.1f}% of it"
    rows.append(Row("arithmetic floor", "ok" if ok else "FAIL", text))


# --------------------------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------------------------


class JpegFaces(torch.utils.data.Dataset):
    """The pack's JPEG crops, decoded with PIL per item, flipped at random, normalised (the usual
    PyTorch face-training input pipeline)."""

    def __init__(self, files: list, labels: np.ndarray) -> None:
        self.files = files
        self.labels = labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        array = decode(self.files[i]).astype(np.float32)
        if torch.rand(()) < 0.5:
            array = array[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
        return (x - 127.5) / 128.0, int(self.labels[i])


def shared_memory_free() -> int | None:
    """Free bytes of ``/dev/shm``, where DataLoader workers hand their batches over (None: no such
    folder)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def loader_settings(workers: int, batch: int, shm_free: int | None) -> tuple[int, int]:
    """``(workers, prefetch_factor)`` for the DataLoader baseline: 4 batches ahead per worker, fewer
    (and then fewer workers) when the float batches in flight would fill half of ``/dev/shm``."""
    per_batch = batch * 3 * 112 * 96 * 4
    prefetch = 4
    if shm_free is None:
        return workers, prefetch
    while workers > 1 and workers * prefetch * per_batch > shm_free / 2:
        if prefetch > 2:
            prefetch -= 1
        else:
            workers -= 1
    return workers, prefetch


def _dataloader(check: Check, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    dataset = JpegFaces(check.pack.files, check.pack.labels)
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=10**9)
    workers, prefetch = loader_settings(check.sizes.loader_workers, batch, shared_memory_free())
    check.found.setdefault("dataloader_settings", {})[batch] = {
        "workers": workers,
        "prefetch_factor": prefetch,
    }
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=check.cuda,
        drop_last=True, persistent_workers=workers > 0, prefetch_factor=prefetch if workers else None,
    )  # fmt: skip
    for images, labels in loader:
        yield images.to(check.device, non_blocking=True), labels.to(check.device, non_blocking=True)


def _fixed_batch(check: Check, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from training.data import to_network_input

    images, labels = check.found["faces"]
    pick = torch.arange(batch) % len(labels)
    x = to_network_input(images[pick].to(check.device))
    y = labels[pick].to(check.device)
    return itertools.repeat((x, y))


def _sources(check: Check, batch: int) -> dict[str, tuple[str, Callable[[], Iterator]]]:
    """Variant name -> (memory format, a function making its batch iterator)."""
    from training.data import DeviceResidentLoader, StreamingLoader
    from training.prepare import load_prepared

    shards = load_prepared(check.prepared).shards
    return {
        "model only (one batch), channels-last": ("cl", lambda: _fixed_batch(check, batch)),
        "model only (one batch), NCHW": ("nchw", lambda: _fixed_batch(check, batch)),
        "GPU-resident loader": (
            "cl",
            lambda: iter(DeviceResidentLoader.from_shards(shards, batch, check.device)),
        ),
        "streaming loader": ("cl", lambda: iter(StreamingLoader(shards, batch, check.device))),
        "DataLoader + PIL": ("cl", lambda: _dataloader(check, batch)),
    }


def _models(check: Check) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """One SphereFace model + A-Softmax m = 4 head per memory format, each with its SGD."""
    from training.config import TrainConfig
    from training.trainer import build_model

    config = TrainConfig(
        network=check.sizes.network, embedding_size=check.sizes.embedding_size, head="asoftmax",
        head_options={"m": 4},
    )  # fmt: skip
    models = {}
    for layout in ("cl", "nchw"):
        model = build_model(config, len(check.pack.identities)).to(check.device)
        if layout == "cl":
            model.net.to(memory_format=torch.channels_last)
        models[layout] = (
            model,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4),
        )
    return models


def _steps(
    model: torch.nn.Module, optimizer: Any, batches: Iterator, layout: str, steps: int, check: Check
) -> None:
    bf16 = check.cuda
    for _ in range(steps):
        images, labels = next(batches)
        images = images.contiguous(
            memory_format=torch.channels_last if layout == "cl" else torch.contiguous_format
        )
        with torch.autocast(check.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _, _ = model(images, labels, TIMED_STEP)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _round(check: Check, batch: int, layout: str, model_opt: tuple, batches: Iterator, warmup: int) -> float:
    """One timed round of one variant: images/s over ``round_steps`` steps after ``warmup`` untimed ones."""
    model, optimizer = model_opt
    _steps(model, optimizer, batches, layout, warmup, check)
    synchronize(check.device)
    started = time.perf_counter()
    _steps(model, optimizer, batches, layout, check.sizes.round_steps, check)
    synchronize(check.device)
    return check.sizes.round_steps * batch / (time.perf_counter() - started)


def _rounds(check: Check, batch: int, sources: dict, iterators: dict, until: float) -> dict[str, Any]:
    """Interleaved rounds (the order rotated each round) of every variant: images/s per round, or
    the error that stopped a variant (the others go on without it)."""
    sizes = check.sizes
    models = _models(check)
    rates: dict[str, Any] = {name: [] for name in sources}
    names = list(sources)
    for r in range(sizes.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if not isinstance(rates[name], list):
                continue
            layout = sources[name][0]
            warmup = sizes.warmup * (2 if r == 0 else 1)
            try:
                rates[name].append(_round(check, batch, layout, models[layout], iterators[name], warmup))
            except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others' numbers
                rates[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        if time.perf_counter() > until:
            break
    return rates


def _time_batch_size(check: Check, batch: int, until: float) -> dict[str, Any]:
    """Images/s of every variant at one batch size (median of the rounds, with the range), or its error."""
    sources = _sources(check, batch)
    iterators = {name: make() for name, (_, make) in sources.items()}
    try:
        rates = _rounds(check, batch, sources, iterators, until)
    finally:
        for iterator in iterators.values():
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
    return {name: spread(values) if isinstance(values, list) and values else {"error": values}
            for name, values in rates.items()}  # fmt: skip


def _batch_row(batch: int, result: dict[str, Any], check: Check) -> Row:
    """The table row of one batch size: every variant's rate, and the best loader against the DataLoader."""
    parts, failed = [], False
    for name, r in result.items():
        failed = failed or "error" in r
        parts.append(f"{name} {'FAILED (' + str(r['error']) + ')' if 'error' in r else rate_text(r)}")
    text = "; ".join(parts) + " img/s"
    loaders = [
        result[n]["median"] for n in ("GPU-resident loader", "streaming loader") if "median" in result[n]
    ]
    if loaders:
        best = max(loaders)
        check.found["best_images_per_s"] = max(check.found.get("best_images_per_s", 0.0), best)
        if "median" in result["DataLoader + PIL"]:
            text += f"; best loader / DataLoader {best / result['DataLoader + PIL']['median']:.2f}x"
    return Row(f"training img/s, batch {batch}", "FAIL" if failed else "ok", text)


def throughput_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """Training images/s of each variant at each batch size (see the module's doc)."""
    from training.prepare import load_prepared

    if check.prepared is None:
        raise Skip("needs the environment section (the unpacked pack)")
    images, labels = load_prepared(check.prepared).concatenate()
    check.found["faces"] = (torch.from_numpy(images), torch.from_numpy(labels))
    details.update(bf16=check.cuda, cudnn_benchmark=True, shm_free_bytes=shared_memory_free())
    batches = check.sizes.throughput_batches
    torch.backends.cudnn.benchmark = True
    try:
        for k, batch in enumerate(batches):
            share = (until - time.perf_counter()) / (len(batches) - k)
            result = details[f"batch_{batch}"] = _time_batch_size(check, batch, time.perf_counter() + share)
            rows.append(_batch_row(batch, result, check))
            details["dataloader"] = check.found.get("dataloader_settings")
    finally:
        torch.backends.cudnn.benchmark = False


def compile_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """The fixed-batch training step with ``torch.compile`` on the embedding network."""
    if "faces" not in check.found:
        raise Skip("needs the throughput section")
    batch = check.sizes.throughput_batches[0]
    model, optimizer = _models(check)["cl"]
    started = time.perf_counter()
    model.net = torch.compile(model.net)
    batches = _fixed_batch(check, batch)
    _steps(model, optimizer, batches, "cl", 3, check)
    synchronize(check.device)
    details["compile_s"] = time.perf_counter() - started
    details["images_per_s"] = images_per_s(
        lambda: _steps(model, optimizer, batches, "cl", 1, check), batch, check.device,
        check.sizes.round_steps, check.sizes.rounds, until,
    )  # fmt: skip
    eager = check.found.get("best_images_per_s")
    text = f"batch {batch}: {rate_text(details['images_per_s'])} img/s"
    text += f" after {details['compile_s']:.0f} s of compiling"
    if eager:
        text += f" (best eager loader {eager:,.0f})"
    rows.append(Row("training img/s, torch.compile", "ok", text))


# --------------------------------------------------------------------------------------------
# megaface
# --------------------------------------------------------------------------------------------


def _unit_rows(count: int, dim: int, seed: int, device: torch.device) -> np.ndarray:
    """``(count, dim)`` float32 random unit vectors, drawn on ``device`` in chunks."""
    generator = torch.Generator(device=device).manual_seed(seed)
    out = np.empty((count, dim), dtype=np.float32)
    for a in range(0, count, 131072):
        b = min(count, a + 131072)
        x = torch.randn(b - a, dim, device=device, generator=generator)
        out[a:b] = torch.nn.functional.normalize(x, dim=1).cpu().numpy()
    return out


def _search(
    probes: np.ndarray, distractors: np.ndarray, size: int, device: str, also: int = 0
) -> tuple[float, Any]:
    """Seconds and result of MegaFace's search at ``size`` distractors (and at ``also`` on the way)."""
    from training.evaluation.megaface_search import distractor_sizes, search_distractors

    sizes = sorted(set(distractor_sizes(size)) | ({also} if 0 < also <= size else set()))
    started = time.perf_counter()
    result = search_distractors(probes, distractors, np.arange(size), sizes, device=device, progress=False)
    return time.perf_counter() - started, result


def _agreement(a: Any, b: Any, size: int) -> float:
    """Largest difference between two searches' top scores and kept impostor scores at ``size``."""
    top_a, imp_a = a.variants["raw"][size]
    top_b, imp_b = b.variants["raw"][size]
    n = min(len(imp_a), len(imp_b))
    worst = float(np.max(np.abs(top_a - top_b)))
    return max(worst, float(np.max(np.abs(imp_a[:n] - imp_b[:n]))) if n else 0.0)


def megaface_section(check: Check, until: float, rows: list[Row], details: dict[str, Any]) -> None:
    """Probes x distractors of synthetic unit features searched on the device and on the CPU."""
    sizes = check.sizes
    total, dim = sizes.megaface_distractors, sizes.megaface_dim
    started = time.perf_counter()
    distractors = _unit_rows(total, dim, 1, check.device)
    probes = _unit_rows(sizes.megaface_probes, dim, 2, check.device)
    details.update(probes=len(probes), distractors=total, dim=dim, features_s=time.perf_counter() - started)
    accelerated = "cuda" if check.cuda else "torch-cpu"
    sample = min(total, max(1000, total // 10))
    details[f"{accelerated}_s"], fast = _search(probes, distractors, total, accelerated, also=sample)
    details["cpu_sample_s"], sampled = _search(probes, distractors, sample, "cpu")
    details["max_abs_diff"] = _agreement(fast, sampled, sample)
    projected = details["cpu_sample_s"] * total / sample
    if time.perf_counter() + projected * 1.2 < until:
        details["cpu_s"], slow = _search(probes, distractors, total, "cpu")
        details["max_abs_diff"] = max(details["max_abs_diff"], _agreement(fast, slow, total))
        cpu_text = f"cpu {details['cpu_s']:.1f} s"
        speedup = details["cpu_s"] / details[f"{accelerated}_s"]
    else:
        cpu_text = f"cpu {details['cpu_sample_s']:.1f} s at {sample:,} "
        cpu_text += f"(about {projected:.0f} s at {total:,}, not run)"
        speedup = projected / details[f"{accelerated}_s"]
    fast_s = details[f"{accelerated}_s"]
    text = f"{len(probes):,} probes x {total:,} distractors, dim {dim}: {accelerated} {fast_s:.1f} s, "
    text += f"{cpu_text}; {speedup:.1f}x"
    compared = total if "cpu_s" in details else sample
    text += f"; scores agree to {details['max_abs_diff']:.1g} (compared at {compared:,})"
    status = "ok" if details["max_abs_diff"] < 1e-4 else "FAIL"
    rows.append(Row(f"MegaFace search, {total:,} distractors", status, text))
