"""Part (b) of the face-path benchmark: our ONNX embedder against PyTorch eager for the same
network, interleaved, at each batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.baselines import load_torch_net
from bench.face_path_settings import EMBED_BATCH1_CROPS, EMBED_BATCHES, EMBED_WARMUP
from bench.timing import Contender, compare_speed, log, pass_ratio_spread, per_call_summary, run_interleaved
from models.embedder import Embedder, preprocess


def bench_embedder(
    model_dir: Path,
    checkpoint: Path,
    crops: np.ndarray,
    threads: int,
    variants: list[int],
    repeats: int,
    budget_s: float,
) -> dict[str, Any]:
    ours = {t: Embedder(model_dir, "cpu", intra_op_threads=t) for t in variants}
    manifest = ours[threads].manifest
    net = load_torch_net(checkpoint)

    def torch_raw(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return net(torch.from_numpy(preprocess(batch, manifest))).numpy()

    ref = torch_raw(crops[:32])
    got = ours[threads].raw(crops[:32])
    cos = np.sum(ref * got, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    out: dict[str, Any] = {
        "model_dir": str(model_dir),
        "model_id": manifest.model_id,
        "checkpoint": str(checkpoint),
        "crops": len(crops),
        "input": f"{manifest.input_height}x{manifest.input_width} uint8 RGB, same numpy preprocess for both",
        "parity_max_abs_diff": float(np.abs(ref - got).max()),
        "parity_min_cosine": float(cos.min()),
        "batches": {},
    }
    if out["parity_max_abs_diff"] > 1e-3:
        log(
            f"WARNING: {model_dir} disagrees with {checkpoint} "
            f"(max abs diff {out['parity_max_abs_diff']:.3g})"
        )
    contenders = {f"ours@{t}": Contender(ours[t].raw) for t in variants}
    contenders.update({f"torch@{t}": Contender(torch_raw, torch_threads=t) for t in variants})
    for bs in EMBED_BATCHES:
        # Batch 1 runs on the first EMBED_BATCH1_CROPS crops only: the cost does not depend on
        # the content, and this keeps a pass short.
        use = crops[:EMBED_BATCH1_CROPS] if bs == 1 else crops
        batches = [use[i : i + bs] for i in range(0, len(use) - bs + 1, bs)]
        log(
            f"(b) embedder at batch {bs}: {len(batches)} batches x {len(contenders)} contenders, "
            f"{repeats} passes"
        )
        seconds, _ = run_interleaved(contenders, batches, repeats, EMBED_WARMUP, f"embed/b{bs}", budget_s)
        timing = {name: per_call_summary(s, bs) for name, s in seconds.items()}
        speed = compare_speed(timing, "median_ms_per_batch", "ours", "torch", threads, variants)
        speed["same_threads_per_pass"] = pass_ratio_spread(
            seconds[f"torch@{threads}"], seconds[f"ours@{threads}"], np.median
        )
        out["batches"][str(bs)] = {"timing": timing, "speed": speed}
    return out
