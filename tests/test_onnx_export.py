"""The ONNX form of PReLU: the same numbers as ``nn.PReLU``, and a graph ONNX Runtime keeps in
its NCHWc layout (no reorders around every activation, the cause of a slow embedder)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from models.nets.mobilefacenet import MobileFaceNet  # noqa: E402
from models.onnx_export import export_onnx, for_onnx_export  # noqa: E402


@pytest.mark.parametrize("num_parameters", [1, 32])
@pytest.mark.parametrize("shape", [(3, 32, 7, 5), (4, 32)])
def test_exported_prelu_form_equals_prelu_for_any_slope(num_parameters: int, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(0)
    prelu = torch.nn.PReLU(num_parameters)
    with torch.no_grad():  # negative, zero, fractional and steeper-than-identity slopes
        prelu.weight.copy_(
            torch.linspace(-1.5, 2.0, num_parameters) if num_parameters > 1 else torch.tensor([-0.7])
        )
    x = torch.randn(shape, generator=generator) * 3
    with torch.no_grad():
        torch.testing.assert_close(for_onnx_export(prelu)(x), prelu(x), atol=1e-6, rtol=1e-6)


def _optimised_op_counts(model: Path, tmp_path: Path) -> Counter:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return Counter(node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node)


def test_onnx_runtime_keeps_mobilefacenet_in_the_blocked_layout(tmp_path: Path) -> None:
    net = MobileFaceNet().eval()
    path = tmp_path / "model.onnx"
    export_onnx(net, path, (3, 112, 96))
    ops = _optimised_op_counts(path, tmp_path)
    if not any(op in ops for op in ("ReorderInput", "ReorderOutput")) and ops["Conv"] <= 50:
        pytest.skip("this CPU has no NCHWc kernels in ONNX Runtime (x86 with AVX2 or later has)")
    # One reorder back to NCHW before the flatten; none around the 33 PReLUs (was 67 + 33), whose
    # BatchNorms became NCHWc convolutions with the Add folded in.
    assert ops["ReorderOutput"] + ops["ReorderInput"] <= 2, ops
    assert "Mul" not in ops and "Clip" not in ops and "BatchNormalization" not in ops, ops
    x = np.random.default_rng(0).standard_normal((2, 3, 112, 96)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0], expected, atol=1e-4)
