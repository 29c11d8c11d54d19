"""The model folder: ``model.onnx`` plus ``manifest.json`` describing how to feed it.

A manifest states everything a consumer must reproduce to feed the network as it was trained
and exported: input size and
alignment template, colour order, pixel normalisation, embedding size, flip fusion, the
calibrated thresholds, the training data and a version. Every gallery vector is tagged with
``model_id`` so vectors of different models are never compared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from models.align import get_template
from models.errors import ModelFolderError

MANIFEST_NAME = "manifest.json"
MODEL_NAME = "model.onnx"
#: The one input ``(N, C, H, W)`` float32 and the one output ``(N, D)`` of every model.onnx.
INPUT_NAME = "input"
OUTPUT_NAME = "embedding"
FORMAT_VERSION = 1
#: The fields that say what a model takes in (crop, pixels) and how it fuses a crop with its mirror.
INPUT_FIELDS = (
    "template",
    "input_height",
    "input_width",
    "color_order",
    "pixel_mean",
    "pixel_std",
    "flip_fusion",
)


@dataclass
class Threshold:
    """A cosine-similarity threshold on the model's flip-fused, L2-normalised embeddings.

    Two faces are declared the same person when ``cosine >= value``. ``far`` is the
    false-accept rate it was calibrated for (None for an accuracy-optimal threshold) and
    ``source`` says how it was measured (e.g. ``"lfw-10fold"``).
    """

    value: float
    far: float | None = None
    source: str = ""


@dataclass
class ModelManifest:
    """Everything needed to turn an aligned crop into an embedding with this model."""

    name: str
    version: str
    architecture: str
    embedding_size: int
    input_height: int = 112
    input_width: int = 96
    template: str = "sphereface_112x96"
    color_order: str = "RGB"
    #: ``(pixel - pixel_mean) / pixel_std``, pixels in ``color_order``; each a number or one per channel.
    pixel_mean: float | list[float] = 127.5
    pixel_std: float | list[float] = 128.0
    flip_fusion: str = "concat"
    training_data: str = ""
    licence: str = ""
    source: str = ""
    #: sha256 of the file the weights were converted from (third-party models), else empty.
    source_sha256: str = ""
    thresholds: dict[str, Threshold] = field(default_factory=dict)
    #: The impostor/genuine set the thresholds were calibrated on: name, pair counts, landmarks.
    calibration: dict[str, Any] = field(default_factory=dict)
    lfw: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def model_id(self) -> str:
        """Identifier stored with every vector: ``name@version``."""
        return f"{self.name}@{self.version}"

    @property
    def output_size(self) -> int:
        """Size of the fused embedding (doubled when the flipped crop is concatenated)."""
        return self.embedding_size * (2 if self.flip_fusion == "concat" else 1)

    def embedding_config(self) -> dict[str, Any]:
        """The fields besides the weights that decide which vector a photo gets (crop, pixels,
        flip fusion): two manifests with the same weights and config give the same embeddings."""
        return {k: getattr(self, k) for k in (*INPUT_FIELDS, "embedding_size")}

    def validate(self) -> None:
        template = get_template(self.template)
        if (template.height, template.width) != (self.input_height, self.input_width):
            raise ModelFolderError(
                f"template {self.template} is {template.height}x{template.width} but the model "
                f"input is {self.input_height}x{self.input_width}"
            )
        if self.color_order not in ("RGB", "BGR"):
            raise ModelFolderError(f"color_order must be RGB or BGR, not {self.color_order!r}")
        if self.flip_fusion not in ("concat", "sum", "none"):
            raise ModelFolderError(f"flip_fusion must be concat, sum or none, not {self.flip_fusion!r}")
        if self.embedding_size <= 0:
            raise ModelFolderError("embedding_size must be positive")
        for label, value in (("pixel_mean", self.pixel_mean), ("pixel_std", self.pixel_std)):
            values = value if isinstance(value, list) else [value]
            if len(values) not in (1, 3) or not all(isinstance(v, int | float) for v in values):
                raise ModelFolderError(
                    f"{label} must be a number or 3 numbers (one per channel), not {value!r}"
                )
        if 0 in (self.pixel_std if isinstance(self.pixel_std, list) else [self.pixel_std]):
            raise ModelFolderError("pixel_std must be non-zero")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelManifest:
        data = dict(data)
        data["thresholds"] = {k: Threshold(**v) for k, v in data.get("thresholds", {}).items()}
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ModelFolderError(f"unknown manifest fields: {sorted(unknown)}")
        try:
            manifest = cls(**data)
        except TypeError as exc:
            raise ModelFolderError(f"invalid manifest: {exc}") from exc
        manifest.validate()
        return manifest


def load_manifest_data(model_dir: str | Path) -> ModelManifest:
    """Read and validate ``model_dir/manifest.json`` (whether or not ``model.onnx`` is there)."""
    path = Path(model_dir) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{model_dir} is not a model folder: {MANIFEST_NAME} missing") from None
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} must hold a JSON object")
    return ModelManifest.from_dict(data)


def load_manifest(model_dir: str | Path) -> ModelManifest:
    """Read and validate ``model_dir/manifest.json`` of a model folder that has its ``model.onnx``."""
    manifest = load_manifest_data(model_dir)
    if not (Path(model_dir) / MODEL_NAME).is_file():
        raise ModelFolderError(f"{model_dir} is not a model folder: {MODEL_NAME} missing")
    return manifest


def save_manifest(model_dir: str | Path, manifest: ModelManifest) -> Path:
    manifest.validate()
    path = Path(model_dir) / MANIFEST_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest.to_json())
    return path
