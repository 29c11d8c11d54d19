"""``sphereface serve``: run the API with uvicorn."""

from __future__ import annotations

from pathlib import Path

from service.settings import Settings


def serve(
    host: str | None = None, port: int | None = None, model: str | None = None, data_dir: str | None = None
) -> int:
    """Start the service; flags override ``SPHEREFACE_*`` environment variables."""
    import uvicorn

    from models.errors import ModelFolderError
    from models.manifest import load_manifest
    from service.app import create_app

    overrides = {k: v for k, v in {"host": host, "port": port, "model_dir": model}.items() if v is not None}
    settings = Settings(**overrides)
    if not Path(settings.model_dir).is_dir():
        raise ModelFolderError(
            f"model folder {settings.model_dir} not found: pass --model DIR, set SPHEREFACE_MODEL_DIR, "
            "or run `make models` to import the reference model"
        )
    load_manifest(settings.model_dir)  # fail before binding the port if the folder is broken
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0
