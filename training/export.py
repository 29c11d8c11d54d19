"""``sphereface export``: a training checkpoint -> a model folder the service and the evaluators use.

Only the embedding network is exported (up to FC1; the classifier is training-only, thesis Table 2.7),
as ONNX with a dynamic batch axis, checked against PyTorch on ONNX Runtime. With an LFW folder,
the new model folder is evaluated with ``sphereface evaluate lfw``'s job (through ONNX Runtime,
the service's path; by default on crops aligned with our MTCNN's landmarks, as the service and
``sphereface prepare`` align faces) and its cosine thresholds are calibrated on every pair of
LFW's photos at the stated false-accept rates, as ``sphereface calibrate`` does
(:mod:`training.evaluation.calibration`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from models.manifest import ModelManifest, load_manifest_data, save_manifest

log = logging.getLogger(__name__)

DEFAULT_LICENCE = (
    "Weights inherit the licence of their training data. CelebA (and CASIA-WebFace, LFW) are "
    "research datasets: research and non-commercial use only."
)


def _training_data_text(config: dict[str, Any]) -> str:
    """What the run trained on, from the prepared folders' manifests (one or several folders)."""
    from training.prepare import DatasetError, load_training_set

    paths = [config["data"]] if isinstance(config["data"], str) else list(config["data"])
    minimum = int(config.get("min_photos_per_identity", 1))
    sources = []
    for path in paths:
        try:
            data = json.loads((Path(path) / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            sources.append(f"prepared dataset {path}")
            continue
        name = Path(data.get("source", path)).name
        sources.append(f"{name} ({data.get('num_images')} faces of {data.get('num_classes')} identities)")
    text = " + ".join(sources)
    if len(paths) > 1 or minimum > 1:
        try:
            combined = load_training_set(paths, minimum)
            text += (
                f", trained as one set (identities merged by name, at least {minimum} faces each): "
                f"{combined.num_images} faces of {combined.num_classes} identities"
            )
        except DatasetError:
            text += f", at least {minimum} faces per identity"
    return text + "; detected and aligned by sphereface prepare (MTCNN, SphereFace 112x96 template)"


def _operator_text(config: dict[str, Any]) -> str:
    """`` with sphereconv (angular=sigmoid, k=0.3)`` or `` with OPT-GS, R folded in``; else empty."""
    operator = config.get("operator", "conv")
    if config.get("opt", "none") != "none":
        options = ", ".join(f"{k}={v}" for k, v in config.get("opt_options", {}).items())
        return f" with OPT-{config['opt'].upper()}" + (f" ({options})" if options else "") + ", R folded in"
    if operator == "conv":
        return ""
    options = ", ".join(f"{k}={v}" for k, v in config.get("operator_options", {}).items())
    return f" with {operator}" + (f" ({options})" if options else "")


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    name: str | None = None,
    version: str | None = None,
    lfw_dir: str | Path | None = None,
    landmarks: str = "detect",
    verification_far: float = 1e-3,
    identification_far: float = 1e-4,
    licence: str = DEFAULT_LICENCE,
    parity_atol: float = 1e-3,
    progress: bool = True,
) -> tuple[ModelManifest, dict[str, Any]]:
    """Write ``out_dir/model.onnx`` + ``manifest.json`` (+ LFW results and thresholds).

    Args:
        checkpoint: ``checkpoint.pt`` of ``sphereface train`` (or its run folder).
        name, version: manifest name and version; default: the run's name and ``step<N>``.
        lfw_dir: LFW folder; when given, LFW accuracy (``lfw.json``, ``lfw_roc.png``) and
            thresholds at ``verification_far`` / ``identification_far`` (calibrated on every pair
            of LFW's 13,233 photos, our MTCNN's landmarks; ``calibration.json``,
            ``calibration.png``) go into the manifest.
        landmarks: where the LFW evaluation's landmarks come from: ``"detect"`` (default; our
            MTCNN, face nearest the centre: the landmarks the served model sees, and those
            ``sphereface prepare`` aligned its training data with) or ``"file"``
            (``landmarks.txt``, about 1 px off ours: docs/results/face-path.md), for comparison with
            published numbers. Calibration always uses our MTCNN's landmarks.
        parity_atol: largest accepted |ONNX - PyTorch| on random inputs (SphereFace nets have
            no BatchNorm, so their raw features are large: the default is 1e-3).

    Returns:
        The manifest and a report (parity difference, LFW accuracy, calibration).
    """
    from models.nets import build_network
    from models.nets.hyperspherical import HypersphericalSettings
    from models.nets.opt import fold_opt
    from models.onnx_export import export_checked
    from training.opt import opt_settings
    from training.trainer import load_checkpoint

    state = load_checkpoint(checkpoint)
    config = state["config"]
    operator = HypersphericalSettings(
        config.get("operator", "conv"),
        dict(config.get("operator_options", {})),
        config.get("operator_fc", False),
    )
    opt = opt_settings(config.get("opt", "none"), config.get("opt_options", {}))
    net = build_network(state["network"], state["embedding_size"], operator, opt)
    net.load_state_dict(state["net"])
    fold_opt(net)  # R v into plain layers: the exported graph costs what the plain network costs
    net.eval()
    out_dir = Path(out_dir)
    diff = export_checked(net, out_dir, input_shape=(3, 112, 96), parity_atol=parity_atol)

    head_options = ", ".join(f"{k}={v}" for k, v in config.get("head_options", {}).items())
    manifest = ModelManifest(
        name=name or config["name"],
        version=version or f"step{state['step']}",
        architecture=state["network"],
        embedding_size=int(state["embedding_size"]),
        training_data=_training_data_text(config),
        licence=licence,
        source=(
            f"sphereface train: {config['name']}, {state['network']}{_operator_text(config)} "
            f"+ {config['head']}"
            f"({head_options}), {state['step']} steps of batch {config['batch_size']}, "
            f"lr {config['lr']}, seed {config['seed']}"
        ),
    )
    save_manifest(out_dir, manifest)
    report: dict[str, Any] = {"onnx_parity_max_abs_diff": diff, "checkpoint_step": int(state["step"])}
    if lfw_dir is not None:
        manifest, measured = evaluate_and_calibrate(
            out_dir, lfw_dir, landmarks=landmarks, verification_far=verification_far,
            identification_far=identification_far, progress=progress,
        )  # fmt: skip
        report.update(measured)
    return manifest, report


def evaluate_and_calibrate(
    model_dir: str | Path,
    lfw_dir: str | Path,
    *,
    landmarks: str = "detect",
    verification_far: float = 1e-3,
    identification_far: float = 1e-4,
    progress: bool = True,
) -> tuple[ModelManifest, dict[str, Any]]:
    """LFW accuracy (``lfw.json``, ``lfw_roc.png``) and thresholds calibrated on every pair of LFW's
    photos (``calibration.json``, ``calibration.png``) of a model folder, both written into its
    manifest. Returns the manifest and the numbers."""
    from training.evaluation.calibration import plot_calibration, run_calibration, write_calibration
    from training.evaluation.lfw import run_lfw_evaluation
    from training.evaluation.report import write_json

    model_dir = Path(model_dir)
    result = run_lfw_evaluation(
        model_dir, lfw_dir, landmarks=landmarks, json_out=model_dir / "lfw.json",
        plot_out=model_dir / "lfw_roc.png", progress=progress,
    )  # fmt: skip
    manifest = load_manifest_data(model_dir)
    manifest.lfw = result.manifest_entry()
    save_manifest(model_dir, manifest)
    calibration = run_calibration(model_dir, lfw_dir, progress=progress)
    write_json(model_dir / "calibration.json", calibration)
    plot_calibration(calibration, model_dir / "calibration.png")
    manifest = write_calibration(model_dir, calibration, verification_far, identification_far)
    return manifest, {
        "lfw_accuracy": result.accuracy,
        "lfw_std": result.std,
        "calibration": calibration["fars"],
    }
