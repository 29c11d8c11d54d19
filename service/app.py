"""The FastAPI application: routers, shared state, typed error answers."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from models.errors import FacePathError
from models.pipeline import FacePipeline
from service.routes import faces, health
from service.settings import Settings

log = logging.getLogger(__name__)

DESCRIPTION = """
Face verification and embedding with SphereFace-style models on ONNX Runtime.

* Scores are **cosine similarities in [-1, 1]** of L2-normalised, flip-fused embeddings.
* `same_person` compares the score with the model's calibrated threshold (from its manifest).
* Every error is JSON `{"code": ..., "message": ...}` with a 4xx status.
"""


def create_app(settings: Settings | None = None, pipeline: FacePipeline | None = None) -> FastAPI:
    """Build the app; the model is loaded in the lifespan unless a ``pipeline`` is given."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.pipeline = pipeline or FacePipeline(
            settings.model_dir,
            settings.providers,
            min_face_size=settings.min_face_size,
            intra_op_threads=settings.intra_op_threads,
        )
        log.info("model %s on %s", app.state.pipeline.manifest.model_id, app.state.pipeline.embedder.provider)
        yield

    app = FastAPI(
        title="SphereFace face service", version="0.1.0", description=DESCRIPTION, lifespan=lifespan
    )
    app.include_router(health.router)
    app.include_router(faces.router, prefix="/v1")

    @app.exception_handler(FacePathError)
    async def face_path_error(_: Request, exc: FacePathError) -> JSONResponse:
        return JSONResponse(status_code=exc.http_status, content=exc.as_dict())

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
        )
        return JSONResponse(status_code=422, content={"code": "invalid_request", "message": problems})

    return app
