"""The model folder: ``model.onnx`` plus ``manifest.json`` describing how to feed it.

A manifest states everything a consumer must reproduce (ANCHORS.md C2, C5): input size and
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
FORMAT_VERSION = 1


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
    pixel_mean: float = 127.5
    pixel_std: float = 128.0
    flip_fusion: str = "concat"
    training_data: str = ""
    licence: str = ""
    source: str = ""
    thresholds: dict[str, Threshold] = field(default_factory=dict)
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
        if self.embedding_size <= 0 or self.pixel_std == 0:
            raise ModelFolderError("embedding_size must be positive and pixel_std non-zero")

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


def load_manifest(model_dir: str | Path) -> ModelManifest:
    """Read and validate ``model_dir/manifest.json``."""
    path = Path(model_dir) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{model_dir} is not a model folder: {MANIFEST_NAME} missing") from None
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not valid JSON: {exc}") from exc
    if not (Path(model_dir) / MODEL_NAME).is_file():
        raise ModelFolderError(f"{model_dir} is not a model folder: {MODEL_NAME} missing")
    return ModelManifest.from_dict(data)


def save_manifest(model_dir: str | Path, manifest: ModelManifest) -> Path:
    manifest.validate()
    path = Path(model_dir) / MANIFEST_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest.to_json())
    return path
