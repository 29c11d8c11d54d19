"""An int8 copy of a model folder: ONNX Runtime static quantisation, calibrated on real faces.

``sphereface quantize --model default --calibration PHOTOS --out FOLDER`` writes a model folder
whose ``model.onnx`` holds int8 weights (per output channel) and int8 activations (QDQ format,
ranges from the calibration crops), with the float folder's manifest under a new name
(``<name>_int8``): its vectors are another model's in the gallery, and its thresholds and LFW
figures are not copied, they must be measured (``sphereface calibrate``, ``sphereface evaluate
lfw``; ``make int8-model`` does all of it). Calibrate on photos the model is not evaluated on.

Needs the ``onnx`` package (the ``train`` extra) for the quantisation tools; serving the result
needs only ONNX Runtime.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from models.embedder import preprocess
from models.manifest import MANIFEST_NAME, MODEL_NAME, load_manifest

#: Faces whose crops (and mirror images, as the embedder runs both) set the activation ranges.
DEFAULT_CALIBRATION_FACES = 200
SUFFIX = "_int8"


def calibration_crops(model_dir: Path, photos: Sequence[Path], count: int) -> np.ndarray:
    """Aligned crops of the largest face of up to ``count`` photos, as the service makes them."""
    from models.errors import NoFaceError
    from models.image import read_image
    from models.pipeline import FacePipeline

    pipeline = FacePipeline(model_dir, "cpu")
    crops = []
    for path in photos:
        try:
            _, crop = pipeline.crops(read_image(path), "largest")
        except NoFaceError:
            continue
        crops.append(crop[0])
        if len(crops) == count:
            break
    if not crops:
        raise ValueError("no face found in the calibration photos")
    return np.stack(crops)


def quantize_model(model_dir: Path, out_dir: Path, crops: np.ndarray) -> Path:
    """Write the int8 model folder ``out_dir`` from the float ``model_dir``; returns it."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    manifest = load_manifest(model_dir)
    both = np.concatenate([crops, crops[:, :, ::-1]])  # the embedder runs the mirror images too
    x = preprocess(both, manifest)
    session = ort.InferenceSession(str(model_dir / MODEL_NAME), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name

    class Reader(CalibrationDataReader):
        """One preprocessed batch of 8 crops at a time."""

        def __init__(self, batches: Iterator[np.ndarray]) -> None:
            self.batches = batches

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {input_name: batch}

    reader = Reader(x[i : i + 8] for i in range(0, len(x), 8))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(model_dir / MODEL_NAME), str(prepared))
        quantize_static(
            str(prepared),
            str(out_dir / MODEL_NAME),
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    data = json.loads((model_dir / MANIFEST_NAME).read_text())
    data["name"] = f"{manifest.name}{SUFFIX}"
    data["source"] = (
        f"{manifest.model_id} quantised to int8 by `sphereface quantize` (ONNX Runtime static quantisation, "
        f"QDQ, per-channel int8 weights, uint8 activations calibrated on {len(crops)} faces and their "
        f"mirror images); {manifest.source}"
    )
    for measured in ("thresholds", "calibration", "lfw"):
        data.pop(measured, None)
    (out_dir / MANIFEST_NAME).write_text(json.dumps(data, indent=2) + "\n")
    card = model_dir / "MODEL_CARD.md"
    if card.is_file():
        shutil.copy(card, out_dir / "FLOAT_MODEL_CARD.md")
    (out_dir / "MODEL_CARD.md").write_text(
        f"# {data['name']}: {manifest.name} in int8\n\n"
        f"- **What**: {data['source']}.\n"
        f"- **Training data and licence**: those of {manifest.model_id} (FLOAT_MODEL_CARD.md): "
        f"{manifest.licence}.\n"
        "- **Measured**: its LFW accuracy and calibrated thresholds are written beside this card by "
        "`make int8-model` (lfw_file.json, calibration.json); docs/results/face-path.md compares them "
        "with the float model's.\n"
    )
    return out_dir
