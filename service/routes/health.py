"""Liveness and readiness probes (no API key needed)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.errors import RedisUnavailableError, redis_unavailable
from service.schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="health", response_model=Health, summary="The process is alive")
async def healthz() -> Health:
    # async: it waits on nothing, so it needs no thread of the pool that Redis calls may fill
    return Health(status="ok")


@router.get(
    "/readyz",
    operation_id="readiness",
    response_model=Ready,
    summary="The model is loaded and the gallery's Redis answers",
    responses={503: {"model": Ready}},
)
def readyz(request: Request):
    state = request.app.state
    pipeline = getattr(state, "pipeline", None)
    if pipeline is None:
        return JSONResponse(status_code=503, content={"status": "loading", "message": "the model is loading"})
    ready = Ready(status="ready", model_id=pipeline.manifest.model_id, provider=pipeline.embedder.provider)
    try:
        state.redis_probe.ping()  # a short timeout of its own: a stalled Redis answers 503 fast
        state.store.ensure_schema()
        refresh = getattr(state.search, "refresh", None)
        ready.gallery_revision = refresh() if refresh else None
        ready.gallery_faces = len(state.search)
    except Exception as exc:  # any Redis failure means not ready
        error = exc if isinstance(exc, RedisUnavailableError) else redis_unavailable(exc, "check the gallery")
        ready.status, ready.message = (
            "redis_unavailable",
            f"the gallery's Redis does not answer: {error.message}",
        )
        return JSONResponse(status_code=503, content=ready.model_dump())
    return ready
