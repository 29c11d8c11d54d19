"""Service settings from flags or environment variables (prefix ``SPHEREFACE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.image import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS

#: The model ``sphereface serve`` uses when none is given: the project's own model, trained by
#: ``sphereface train`` on celeba_faces and shipped in ``models/default`` (see its MODEL_CARD.md).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"


class Settings(BaseSettings):
    """Every setting can be given as ``SPHEREFACE_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="SPHEREFACE_", protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: Path = DEFAULT_MODEL_DIR
    providers: str = Field("cpu", description="ONNX Runtime providers, e.g. 'cuda,cpu'")
    intra_op_threads: int = 0
    min_face_size: float = Field(20.0, ge=12)
    max_upload_bytes: int = Field(MAX_IMAGE_BYTES, gt=0, description="per photo")
    max_image_pixels: int = Field(MAX_IMAGE_PIXELS, gt=0)
    max_photos_per_request: int = Field(16, gt=0)
