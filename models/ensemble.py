"""Several embedding models as one model folder: one ONNX graph, their unit features side by side.

Two networks trained apart make different mistakes, and the cosine of their features side by side
is the mean of their cosines: on LFW two of this project's MobileFaceNets reach 90.2% against
88.9% and 88.3% alone (docs/results/sphereface-celeba.md). This module makes that one model the service can
load, so it is served, calibrated and evaluated like any other:

    sphereface combine models/sphereface_celeba runs/celeba_more/mobilefacenet_m4_colour/model \\
        --out models/sphereface_celeba_pair --name pair --version 1 --lfw ../shared/data/lfw

The graph feeds the one input to every part, L2-normalises each part's output and concatenates
them, scaled by 1/sqrt(k) so the result is a unit vector: ``[f1/|f1|, ..., fk/|fk|] / sqrt(k)``.
With the manifest's flip fusion the service then scores the mean of 2k cosines (each part on the
crop and on its mirror). The parts must take the same crop (template, size, colour order, pixel
normalisation) and fuse flips the same way; they may differ in embedding size.

Needs the ``onnx`` package (the ``train`` extra), not torch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from models.errors import ModelFolderError
from models.manifest import (
    INPUT_FIELDS,
    INPUT_NAME,
    MODEL_NAME,
    OUTPUT_NAME,
    ModelManifest,
    load_manifest,
    save_manifest,
)
from models.runtime import create_session


class EnsembleError(ModelFolderError):
    """The models cannot be combined: too few, or they expect different crops."""

    code = "ensemble_mismatch"


def check_combinable(manifests: Sequence[ModelManifest]) -> None:
    """Raise :class:`EnsembleError` unless every manifest takes the first one's crop and fusion."""
    if len(manifests) < 2:
        raise EnsembleError(f"an ensemble needs at least 2 models, got {len(manifests)}")
    first = manifests[0]
    for other in manifests[1:]:
        for key in INPUT_FIELDS:
            if getattr(other, key) != getattr(first, key):
                raise EnsembleError(
                    f"{other.model_id} has {key} = {getattr(other, key)!r} but {first.model_id} has "
                    f"{getattr(first, key)!r}: an ensemble's parts must take the same crop"
                )


def combine_graphs(model_paths: Sequence[Path], opset: int = 18):
    """One ONNX model: every part on the shared input, each output L2-normalised, concatenated,
    divided by sqrt(k). Parts' names are prefixed ``p0_``, ``p1_``... so they cannot collide."""
    import onnx
    from onnx import TensorProto, compose, helper, numpy_helper

    nodes, initializers, value_info, outputs = [], [], [], []
    for index, path in enumerate(model_paths):
        part = onnx.load(str(path))
        if [i.name for i in part.graph.input] != [INPUT_NAME] or [o.name for o in part.graph.output] != [
            OUTPUT_NAME
        ]:
            raise EnsembleError(f"{path} must have one input {INPUT_NAME!r} and one output {OUTPUT_NAME!r}")
        if index == 0:
            graph_input, ir_version = list(part.graph.input), part.ir_version
        part = compose.add_prefix(part, prefix=f"p{index}_", rename_inputs=False)
        nodes.extend(part.graph.node)
        initializers.extend(part.graph.initializer)
        value_info.extend(part.graph.value_info)
        normalised = f"p{index}_unit"
        nodes.append(
            helper.make_node("LpNormalization", [f"p{index}_{OUTPUT_NAME}"], [normalised], axis=1, p=2)
        )
        outputs.append(normalised)
    scale = numpy_helper.from_array(np.array(1.0 / math.sqrt(len(model_paths)), np.float32), "ensemble_scale")
    initializers.append(scale)
    nodes.append(helper.make_node("Concat", outputs, ["ensemble_concat"], axis=1))
    nodes.append(helper.make_node("Mul", ["ensemble_concat", "ensemble_scale"], [OUTPUT_NAME]))
    output = helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", None])
    graph = helper.make_graph(nodes, "ensemble", graph_input, [output], initializers, value_info=value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    onnx.checker.check_model(model)
    return model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _parts_text(manifests: Sequence[ModelManifest], dirs: Sequence[Path]) -> str:
    return "; ".join(
        f"{m.model_id} ({m.source or m.architecture}; model.onnx sha256 {_sha256(d / MODEL_NAME)[:16]})"
        for m, d in zip(manifests, dirs, strict=True)
    )


def _training_data_text(manifests: Sequence[ModelManifest]) -> str:
    texts = list(dict.fromkeys(m.training_data for m in manifests))
    if len(texts) == 1:
        return f"every part: {texts[0]}"
    return " | ".join(f"{m.model_id}: {m.training_data}" for m in manifests)


def concatenated_unit_features(features: Sequence[np.ndarray]) -> np.ndarray:
    """Each model's features L2-normalised, side by side, scaled to unit length: the cosine of two
    such rows is the mean of the models' cosines (every model weighs the same). What the combined
    graph computes, in numpy."""
    if not features:
        raise ValueError("an ensemble needs the features of at least one model")
    rows = {len(f) for f in features}
    if len(rows) != 1:
        raise ValueError(f"the models' features have different row counts: {sorted(rows)}")
    unit = []
    for f in features:
        f = np.asarray(f, dtype=np.float64)
        unit.append(f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12))
    return np.concatenate(unit, axis=1) / math.sqrt(len(unit))


def ensemble_parity(
    model_dirs: Sequence[Path],
    combined: Path,
    input_shape: tuple[int, int, int],
    batch: int = 3,
    seed: int = 0,
) -> float:
    """Largest |combined - reference| on random inputs of ``input_shape`` (C, H, W), the reference
    computed part by part on ONNX Runtime and joined by :func:`concatenated_unit_features`."""
    crops = np.random.default_rng(seed).standard_normal((batch, *input_shape)).astype(np.float32)
    run = lambda path: create_session(path, "cpu").run(None, {INPUT_NAME: crops})[0]  # noqa: E731
    reference = concatenated_unit_features([run(d / MODEL_NAME) for d in model_dirs])
    got = run(combined)
    if got.shape != reference.shape:
        raise EnsembleError(f"the combined graph gives {got.shape}, expected {reference.shape}")
    return float(np.abs(got - reference).max())


def combine_models(
    model_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    name: str,
    version: str,
    licence: str | None = None,
    parity_atol: float = 1e-5,
) -> tuple[ModelManifest, float]:
    """Write ``out_dir/model.onnx`` and its manifest (no thresholds or LFW entry: calibrate it).

    Returns the manifest and the parity difference against the parts run one by one.
    """
    dirs = [Path(d) for d in model_dirs]
    manifests = [load_manifest(d) for d in dirs]
    check_combinable(manifests)
    licences = list(dict.fromkeys(m.licence for m in manifests))
    if licence is None and len(licences) > 1:
        raise EnsembleError("the parts have different licences: pass the ensemble's licence explicitly")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import onnx

    onnx.save(combine_graphs([d / MODEL_NAME for d in dirs]), str(out / MODEL_NAME))
    first = manifests[0]
    diff = ensemble_parity(dirs, out / MODEL_NAME, (3, first.input_height, first.input_width))
    if diff > parity_atol:
        raise EnsembleError(f"the combined graph differs from its parts by {diff:.3g} (> {parity_atol:g})")
    manifest = ModelManifest(
        name=name,
        version=version,
        architecture="ensemble of " + " + ".join(m.architecture for m in manifests),
        embedding_size=sum(m.embedding_size for m in manifests),
        **{key: getattr(first, key) for key in INPUT_FIELDS},
        training_data=_training_data_text(manifests),
        licence=licence if licence is not None else licences[0],
        source=f"sphereface combine: unit features of {len(dirs)} models side by side, / sqrt({len(dirs)}): "
        + _parts_text(manifests, dirs),
    )
    save_manifest(out, manifest)
    return manifest, diff
