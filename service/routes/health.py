"""Liveness and readiness probes (no API key needed)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is alive")
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, summary="The model is loaded", responses={503: {"model": Ready}})
def readyz(request: Request):
    pipeline = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        return JSONResponse(status_code=503, content={"status": "loading"})
    return Ready(status="ready", model_id=pipeline.manifest.model_id, provider=pipeline.embedder.provider)
