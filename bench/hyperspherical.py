"""What a hyperspherical operator costs against a convolution: training in PyTorch, inference in ORT.

For SphereFace-4 (112x96 faces) and the CIFAR CNN-9 (32x32), each with ordinary convolutions and
with cosine, linear and sigmoid SphereConv (and TanhConv), measured in one process, interleaved:

* **train**: one forward + backward + SGD step at batch 64 (faces) / 128 (CIFAR) in PyTorch;
* **onnx**: the exported network (SphereFace-4 only; the form the service runs) at batch 1 and 32
  in ONNX Runtime.

Every figure is the median of ``--rounds`` interleaved rounds (round r: every variant in turn),
with the smallest and largest round beside it, and its ratio to the convolution in the same round.

Usage::

    .venv/bin/python bench/hyperspherical.py --json docs/results/bench_hyperspherical.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.evaluation.report import write_json  # noqa: E402

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "conv": ("conv", {}),
    "cosine SphereConv": ("sphereconv", {"angular": "cosine"}),
    "linear SphereConv": ("sphereconv", {"angular": "linear"}),
    "sigmoid SphereConv": ("sphereconv", {"angular": "sigmoid", "k": 0.3}),
    "TanhConv (cosine)": ("tanhconv", {"angular": "cosine"}),
}


def _network(kind: str, operator: str, options: dict[str, Any]) -> torch.nn.Module:
    from models.nets import build_network
    from models.nets.hyperspherical import HypersphericalSettings
    from models.nets.plain_cnn import PlainCNN

    settings = HypersphericalSettings(operator, options)
    if kind == "faces":
        return build_network("sphereface4", operator=settings)
    return settings.apply(PlainCNN(3, (24, 36, 48)))


def _train_step_seconds(net: torch.nn.Module, x: torch.Tensor, optimiser: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    loss = net(x).square().mean()
    optimiser.zero_grad(set_to_none=True)
    loss.backward()
    optimiser.step()
    return time.perf_counter() - start


def _onnx_session(net: torch.nn.Module, folder: Path) -> Any:
    import onnxruntime as ort

    from models.onnx_export import export_checked

    net.eval()
    export_checked(net, folder, parity_atol=1e-3)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _summary(times: list[list[float]], base: list[list[float]]) -> dict[str, Any]:
    per_round = np.array([np.median(t) for t in times]) * 1e3
    ratio = per_round / (np.array([np.median(t) for t in base]) * 1e3)
    return {
        "median_ms": float(np.median(per_round)),
        "min_ms": float(per_round.min()),
        "max_ms": float(per_round.max()),
        "ratio_to_conv": {
            "median": float(np.median(ratio)),
            "min": float(ratio.min()),
            "max": float(ratio.max()),
        },
    }


def bench(rounds: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    inputs = {"faces": torch.randn(64, 3, 112, 96), "cifar": torch.randn(128, 3, 32, 32)}
    nets = {(k, v): _network(k, *VARIANTS[v]) for k in inputs for v in VARIANTS}
    optimisers = {key: torch.optim.SGD(net.parameters(), lr=1e-3) for key, net in nets.items()}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {
            v: _onnx_session(_network("faces", *VARIANTS[v]), Path(tmp) / str(i))
            for i, v in enumerate(VARIANTS)
        }
        batches = {
            b: np.random.default_rng(0).standard_normal((b, 3, 112, 96), dtype=np.float32) for b in (1, 32)
        }
        times: dict[str, dict[str, list[list[float]]]] = {}
        for key in nets:  # warm-up
            _train_step_seconds(nets[key], inputs[key[0]], optimisers[key])
        for r in range(rounds):
            for key, net in nets.items():
                row = times.setdefault(f"train {key[0]}", {}).setdefault(key[1], [])
                row.append(
                    [_train_step_seconds(net, inputs[key[0]], optimisers[key]) for _ in range(repeats)]
                )
            for variant, session in sessions.items():
                for b, x in batches.items():
                    row = times.setdefault(f"onnx faces batch {b}", {}).setdefault(variant, [])
                    samples = []
                    for _ in range(repeats * 3):
                        start = time.perf_counter()
                        session.run(None, {session.get_inputs()[0].name: x})
                        samples.append(time.perf_counter() - start)
                    row.append(samples)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return {
        task: {v: _summary(t, per_variant["conv"]) for v, t in per_variant.items()}
        for task, per_variant in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = bench(args.rounds, args.repeats)
    for task, per_variant in results.items():
        print(f"\n{task} (median of {args.rounds} interleaved rounds, ms; x conv)")
        for variant, s in per_variant.items():
            r = s["ratio_to_conv"]
            print(
                f"  {variant:22s} {s['median_ms']:8.1f}  ({s['min_ms']:.1f}-{s['max_ms']:.1f})"
                f"   x{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
            )
    if args.json:
        write_json(args.json, {"threads": args.threads, "rounds": args.rounds, "host": platform.node(),
                               "processor": platform.processor(), "results": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
