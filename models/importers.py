"""Importers: third-party checkpoints -> model folders (``model.onnx`` + ``manifest.json``).

Used by ``sphereface import ...``. Needs torch (the ``train`` extra); torch is imported inside the
functions so that importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from models.errors import ModelFolderError
from models.manifest import ModelManifest, save_manifest

log = logging.getLogger(__name__)

#: Provenance of the reference checkpoint in ../shared/data/reference_models/mobilefacenet_casia.
MOBILEFACENET_CASIA_TRAINING = (
    "CASIA-WebFace, trained externally (not by this project) with an ArcFace head: "
    "Xiaoccer/MobileFaceNet_Pytorch@26bd8d2, model/best/068.ckpt (epoch {epoch}); "
    "its authors report 99.30% on LFW with MATLAB-aligned faces"
)
MOBILEFACENET_CASIA_LICENCE = (
    "Research and evaluation use only (weights trained on CASIA-WebFace, a research dataset); "
    "not for commercial use"
)


def _load_state_dict(checkpoint: Path) -> tuple[dict[str, Any], int | None]:
    """Read ``checkpoint``'s ``net_state_dict`` (tensors only, no arbitrary pickled code).

    Returns the state dict and the checkpoint's ``epoch`` (None when it has none).
    """
    import torch

    if not checkpoint.is_file():
        raise FileNotFoundError(f"MobileFaceNet checkpoint not found: {checkpoint}")
    try:
        # weights_only: a third-party pickle must not run code on load; the reference
        # checkpoint holds only an int and tensors.
        data = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises anything from KeyError to RuntimeError on junk
        raise ModelFolderError(
            f"{checkpoint} is not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(data, dict) and "net_state_dict" in data:
        state, epoch = data["net_state_dict"], data.get("epoch")
    elif isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
        state, epoch = data, None  # a bare state dict
    else:
        keys = sorted(data)[:10] if isinstance(data, dict) else type(data).__name__
        raise ModelFolderError(f"{checkpoint} has no 'net_state_dict' (found {keys})")
    if not isinstance(state, dict):
        raise ModelFolderError(f"{checkpoint}: 'net_state_dict' is a {type(state).__name__}, not a dict")
    # Checkpoints saved from nn.DataParallel prefix every key with "module.".
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state, epoch if isinstance(epoch, int) else None


def _describe_mismatch(net: Any, state: dict[str, Any], show: int = 5) -> str:
    """A short account of how ``state`` differs from ``net.state_dict()`` (keys and shapes)."""
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [
        f"{k} {tuple(getattr(state[k], 'shape', ()))} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(getattr(state[k], "shape", ())) != tuple(v.shape)
    ]
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", reshaped)):
        if items:
            more = f", ... ({len(items) - show} more)" if len(items) > show else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:show])}{more}")
    return "; ".join(parts) or "tensors could not be copied"


def import_mobilefacenet(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    name: str = "mobilefacenet_casia",
    *,
    version: str | None = None,
    training_data: str | None = None,
    licence: str = MOBILEFACENET_CASIA_LICENCE,
    parity_atol: float = 1e-4,
) -> ModelManifest:
    """Convert a MobileFaceNet checkpoint (``{"epoch", "net_state_dict"}``) into a model folder.

    Loads the weights strictly into :class:`models.nets.mobilefacenet.MobileFaceNet`, exports
    ``out_dir/model.onnx`` (input ``(N, 3, 112, 96)`` RGB, ``(x - 127.5) / 128``; output
    ``(N, 128)``), checks ONNX Runtime against PyTorch at batch 1 and 8, and writes
    ``out_dir/manifest.json``. The model file is only put in place once the parity check passed.

    Args:
        checkpoint: the ``.ckpt`` file.
        out_dir: model folder to write (created; an existing model in it is replaced).
        name: model name in the manifest.
        version: manifest version; default: the checkpoint's epoch as 3 digits (``"068"``),
            else the file name without suffix.
        training_data: provenance text; default: that of the reference CASIA-WebFace model.
        licence: licence text for the manifest.
        parity_atol: largest accepted absolute difference between ONNX and PyTorch outputs.

    Raises:
        FileNotFoundError: ``checkpoint`` does not exist.
        ModelFolderError: the file is not a checkpoint, or its tensors do not fit MobileFaceNet.
        models.onnx_export.OnnxParityError: the exported model disagrees with PyTorch.
    """
    from models.nets.mobilefacenet import MobileFaceNet
    from models.onnx_export import export_checked

    checkpoint = Path(checkpoint)
    out_dir = Path(out_dir)
    state, epoch = _load_state_dict(checkpoint)

    net = MobileFaceNet(embedding_size=128)
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelFolderError(
            f"{checkpoint} does not match the MobileFaceNet layout: {_describe_mismatch(net, state)}"
        ) from exc
    net.eval()

    export_checked(net, out_dir, input_shape=(3, 112, 96), parity_atol=parity_atol)

    if version is None:
        version = f"{epoch:03d}" if epoch is not None else checkpoint.stem
    if training_data is None:
        training_data = MOBILEFACENET_CASIA_TRAINING.format(epoch=epoch if epoch is not None else "unknown")
    manifest = ModelManifest(
        name=name,
        version=version,
        architecture="mobilefacenet",
        embedding_size=128,
        input_height=112,
        input_width=96,
        template="sphereface_112x96",
        color_order="RGB",
        pixel_mean=127.5,
        pixel_std=128.0,
        flip_fusion="concat",
        training_data=training_data,
        licence=licence,
        source=str(checkpoint.resolve()),
    )
    save_manifest(out_dir, manifest)
    log.info("wrote %s (%s)", out_dir, manifest.model_id)
    return manifest
