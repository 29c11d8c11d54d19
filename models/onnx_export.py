"""PyTorch -> ONNX export with a dynamic batch axis, and a numerical parity check on ONNX Runtime.

Shared by the third-party importers (:mod:`models.importers`) and the training export. Needs
torch (the ``train`` extra): import this module only from import, training and export commands.

Every exported embedding model has one input ``"input"`` ``(N, C, H, W)`` float32 and one output
``"embedding"`` ``(N, D)``, N dynamic, as :class:`models.embedder.Embedder` expects.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from models.errors import ModelFolderError
from models.manifest import INPUT_NAME, OUTPUT_NAME
from models.runtime import create_session

log = logging.getLogger(__name__)


#: Loggers of the exporter's stack that report every graph pass at INFO; quietened during export.
_CHATTY_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")


class OnnxParityError(ModelFolderError):
    """The ONNX model's output differs from the PyTorch module's by more than the tolerance."""

    code = "onnx_parity"


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in _CHATTY_LOGGERS}
    with warnings.catch_warnings():
        # torch.export's own use of a deprecated pytree API, not something the caller can fix.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        try:
            for name in _CHATTY_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
            yield
        finally:
            for name, level in saved.items():
                logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put ``module`` in eval mode for the block and restore its previous mode afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


#: BatchNorm epsilon of the PReLU form below: a power of two, so 1 - eps + eps is exactly 1.
_BN_EPS = 2.0**-10


class _BatchNormPReLU(torch.nn.Module):
    """PReLU written as ``x + (1 - a) * relu(-x)``, both products as inference BatchNorms.

    The same numbers as ``nn.PReLU`` (to float rounding), but a graph ONNX Runtime's CPU provider
    keeps in its blocked NCHWc layout from the first convolution to the last: it turns each
    BatchNormalization into a 1x1 depthwise NchwcConv, fuses the Relu into the first and the Add
    into the second. ONNX Runtime's own PRelu kernel took 40-75% of these networks' time; the form
    ``relu(x) + a * min(x, 0)`` left the layout around every PReLU (two ReorderOutput and one
    ReorderInput each, for the per-channel Mul and the Clip); ``(1 - a) * relu(x) + a * x`` stayed
    blocked but left its Relu unfused (the convolution's output had two readers), a pass of its
    own that took 13% of P-Net's time. This form is two passes instead of three: P-Net 8-10% faster
    again on phone photos (docs/results/face-path.md).
    """

    def __init__(self, prelu: torch.nn.PReLU) -> None:
        super().__init__()
        self.weight = prelu.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        slope = self.weight.expand(channels) if self.weight.numel() == 1 else self.weight
        zeros = torch.zeros_like(slope)
        # Variance 1 - eps, so that the normaliser sqrt(var + eps) is 1.
        unit_var = torch.full_like(slope, 1.0 - _BN_EPS)
        minus_one = torch.full_like(slope, -1.0)
        negative_part = torch.relu(F.batch_norm(x, zeros, unit_var, minus_one, zeros, False, 0.0, _BN_EPS))
        return x + F.batch_norm(negative_part, zeros, unit_var, 1.0 - slope, zeros, False, 0.0, _BN_EPS)


def for_onnx_export(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` with every ``nn.PReLU`` replaced by its faster ONNX equivalent."""
    import copy

    clone = copy.deepcopy(module)
    for child in list(clone.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, torch.nn.PReLU):
                setattr(child, attr, _BatchNormPReLU(sub))
    return clone


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def export_onnx(
    module: torch.nn.Module,
    path: str | Path,
    input_shape: tuple[int, int, int] = (3, 112, 96),
    opset: int = 18,
    *,
    exporter: Literal["dynamo", "torchscript"] = "dynamo",
) -> Path:
    """Export ``module`` (run in eval mode) to a single self-contained ONNX file.

    Args:
        module: maps a float32 ``(N, *input_shape)`` tensor to ``(N, D)``. Its train/eval mode is
            restored afterwards; it stays on its device.
        path: the ``.onnx`` file to write (parent folders are created).
        input_shape: ``(C, H, W)`` of one input.
        opset: ONNX opset of the default domain. The torch.export-based exporter builds opset
            18 graphs and converts them down; a warning is logged if the file ends up with
            another opset.
        exporter: ``"dynamo"`` (default): ``torch.onnx.export(dynamo=True)``, the
            torch.export-based exporter that is the supported path since torch 2.9;
            ``"torchscript"``: the legacy TorchScript exporter (deprecated; faster, kept as a
            fallback for modules torch.export cannot trace).

    Returns:
        ``path`` as a :class:`~pathlib.Path`. The graph has input ``"input"`` and output
        ``"embedding"``, both with a dynamic batch axis named ``"batch"``.
    """
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Batch 2, not 1: tracing with a size-1 dimension invites specialising it to a constant.
    sample = torch.zeros((2, *input_shape), dtype=torch.float32, device=_module_device(module))
    module = for_onnx_export(module)
    common = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME], "opset_version": opset}
    with _eval_mode(module), torch.no_grad():
        if exporter == "dynamo":
            with _quiet_exporter_logs():
                torch.onnx.export(
                    module,
                    (sample,),
                    str(path),
                    **common,
                    dynamo=True,
                    dynamic_shapes=({0: torch.export.Dim("batch")},),
                    external_data=False,
                    verbose=False,
                )
        elif exporter == "torchscript":
            torch.onnx.export(
                module,
                (sample,),
                str(path),
                **common,
                dynamo=False,
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            )
        else:
            raise ValueError(f"exporter must be 'dynamo' or 'torchscript', not {exporter!r}")

    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    got_opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if got_opset != opset:
        log.warning("%s: asked for ONNX opset %d, the exporter wrote opset %s", path, opset, got_opset)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if inputs != [INPUT_NAME] or outputs != [OUTPUT_NAME]:
        raise ModelFolderError(
            f"exported graph has inputs {inputs} and outputs {outputs}; "
            f"expected [{INPUT_NAME!r}] and [{OUTPUT_NAME!r}]"
        )
    log.debug("exported %s (%s exporter, opset %s)", path, exporter, got_opset)
    return path


def check_onnx_parity(
    module: torch.nn.Module,
    onnx_path: str | Path,
    batch_sizes: Sequence[int] = (1, 8),
    atol: float = 1e-4,
    seed: int = 0,
) -> float:
    """Compare ``module`` (eval mode, float32) with the ONNX file on ONNX Runtime's CPU provider.

    For each batch size, a standard-normal input ``(N, C, H, W)`` (the shape read from the ONNX
    graph, seeded by ``seed``) goes through both; the largest absolute output difference over
    all batch sizes is returned.

    Raises:
        OnnxParityError: the difference exceeds ``atol``, or the output shapes differ.
    """
    session = create_session(onnx_path, "cpu")
    onnx_input = session.get_inputs()[0]
    chw = tuple(onnx_input.shape[1:])
    if not all(isinstance(d, int) for d in chw):
        raise ModelFolderError(f"{onnx_path}: input shape {onnx_input.shape} is not fixed beyond the batch")
    rng = np.random.default_rng(seed)
    device = _module_device(module)
    worst = 0.0
    with _eval_mode(module), torch.no_grad():
        for n in batch_sizes:
            x = rng.standard_normal((n, *chw)).astype(np.float32)
            expected = module(torch.from_numpy(x).to(device)).float().cpu().numpy()
            got = session.run(None, {onnx_input.name: x})[0]
            if got.shape != expected.shape:
                raise OnnxParityError(
                    f"{onnx_path}: batch {n}: ONNX output shape {got.shape} != PyTorch {expected.shape}"
                )
            diff = float(np.max(np.abs(got - expected))) if got.size else 0.0
            log.debug("parity batch %d: max abs diff %.3g", n, diff)
            if not diff <= atol:  # also catches NaN
                raise OnnxParityError(
                    f"{onnx_path}: ONNX Runtime and PyTorch differ by {diff:.3g} (max abs) at batch {n}, "
                    f"more than the tolerance {atol:g}"
                )
            worst = max(worst, diff)
    return worst


def export_checked(
    module: torch.nn.Module,
    out_dir: str | Path,
    input_shape: tuple[int, int, int] = (3, 112, 96),
    parity_atol: float = 1e-4,
) -> float:
    """Export ``module`` to ``out_dir/model.onnx``, put in place only once parity at batch 1 and 8 passed.

    Returns the largest |ONNX - PyTorch| difference. A failed export or parity check leaves any
    earlier ``model.onnx`` untouched.
    """
    import os

    from models.manifest import MODEL_NAME

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / (MODEL_NAME + ".partial")
    try:
        export_onnx(module, partial, input_shape=input_shape, opset=18)
        diff = check_onnx_parity(module, partial, batch_sizes=(1, 8), atol=parity_atol)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out_dir / MODEL_NAME)
    log.info("ONNX Runtime vs PyTorch: max abs diff %.3g at batch 1 and 8 (tolerance %g)", diff, parity_atol)
    return diff
