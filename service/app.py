"""The FastAPI application: routers, shared state, typed error answers."""

from __future__ import annotations

import logging
import re
from contextlib import asynccontextmanager

import redis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.cluster import RedisCluster
from starlette.exceptions import HTTPException as StarletteHTTPException

from models.errors import SphereFaceError
from models.pipeline import FacePipeline
from models.runtime import use_cpu_memory_arena
from service.admission import Admission, PixelBudget, default_face_limit
from service.auth import AuthGate, require_read
from service.errors import (
    REDIS_DOWN_ERRORS,
    InvalidRequestError,
    RedisSetupError,
    RedisUnavailableError,
    RequestTooLargeError,
    error_response,
    redis_unavailable,
)
from service.events.delivery import WebhookDelivery, WebhookWorker
from service.events.stream import EventStream
from service.gallery.index import LiveIndex
from service.gallery.redis_search import RedisKnnSearch
from service.gallery.store import GalleryStore
from service.gallery.writes import WritePolicy
from service.memory import limit_malloc_arenas
from service.metrics import Metrics, MetricsMiddleware, add_metrics_route, create_metrics
from service.openapi import install_openapi
from service.redis_clients import gallery_client, redis_client  # noqa: F401  (redis_client: for callers)
from service.routes import events, faces, gallery, health, identify, unknowns, video
from service.routes.common import reject_unknown_query
from service.routes.page import add_page
from service.settings import Settings
from service.unknowns.pool import pool_for

log = logging.getLogger(__name__)

DESCRIPTION = """
Face verification, enrollment and identification with SphereFace-style models on ONNX Runtime,
with the gallery in Redis.

* Scores are **cosine similarities in [-1, 1]** of L2-normalised, flip-fused embeddings.
* `same_person` / `known` compare the score with the model's calibrated thresholds (manifest):
  `verification` is set for a false-accept rate of 1e-3 per pair, `identification` for 1e-4.
* Send the API key in the header `X-API-Key` (scope `read`: verify, embed, identify, read the
  gallery; scope `admin`: also change it). `/healthz`, `/readyz` and `/metrics` are open.
* A page to try it in the browser is at `/`; this reference is also at `/redoc`.
* Every error is JSON `{"code": ..., "message": ...}` with a 4xx status (503 when Redis is down).
"""

HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes (413), by Content-Length or while streaming."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = error_response(RequestTooLargeError(f"the request body is over {self.limit} bytes"))
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise RequestTooLargeError(f"the request body is over {self.limit} bytes")
            return message

        return await self.app(scope, counted, send)


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method the API answers at ``path``, from the paths of its OpenAPI document (for the
    ``Allow`` of a 405; Starlette names only the methods of the first route that matched)."""
    methods: set[str] = set()
    for template, item in app.openapi().get("paths", {}).items():
        pattern = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            methods |= {method.upper() for method in item}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def make_search(settings: Settings, store: GalleryStore, model_id: str, dim: int):
    """The identification search the settings ask for (numpy in process, or Redis KNN)."""
    if settings.search == "redis":
        if store.cluster:
            raise RedisSetupError(
                "SPHEREFACE_SEARCH=redis is not available with a Redis Cluster: use SPHEREFACE_SEARCH=numpy"
            )
        search = RedisKnnSearch(store.redis, model_id=model_id, dim=dim, prefix=settings.redis_prefix)
        search.ensure_index()
        return search
    return LiveIndex(store, model_id, dim, snapshots=settings.gallery_snapshot_dir)


def load_pipeline(settings: Settings) -> FacePipeline:
    """The face pipeline of ``settings.model_dir`` (detector, aligner, embedder)."""
    return FacePipeline(
        settings.model_dir,
        settings.providers,
        min_face_size=settings.min_face_size,
        intra_op_threads=settings.intra_op_threads,
        max_image_side=settings.detect_max_side,
        largest_face_search=settings.largest_face_search,
    )


def connect_gallery(app: FastAPI, settings: Settings) -> redis.Redis | RedisCluster:
    """Connect the gallery's Redis (or Redis Cluster) and the identification search into
    ``app.state``; returns the client to close at shutdown. A Redis that does not answer yet is
    logged, not fatal: ``/readyz`` says so until it answers (a cluster must answer at start: its
    client learns the slots from it)."""
    manifest = app.state.pipeline.manifest
    client = gallery_client(settings)
    app.state.redis = client
    app.state.redis_probe = gallery_client(settings, min(0.5, settings.redis_timeout / 2))
    app.state.store = store = GalleryStore(
        client,
        settings.redis_prefix,
        max_faces_per_subject=settings.max_faces_per_subject,
        policy=WritePolicy.from_settings(settings),
    )
    app.state.search = make_search(settings, store, manifest.model_id, manifest.output_size)
    app.state.unknowns = pool_for(settings, manifest, client)
    try:
        store.ensure_schema()  # a gallery written by an older version (readyz retries it)
        if isinstance(app.state.search, LiveIndex):
            app.state.search.refresh()  # load the gallery before the first request
    except RedisUnavailableError as exc:
        log.warning("gallery not loaded yet (%s); /readyz says so until Redis answers", exc.message)
    return client


def start_events(app: FastAPI, settings: Settings, client: redis.Redis | RedisCluster) -> WebhookDelivery:
    """The event stream the routes append to (``app.state.events``), and this process's delivery
    of it to every webhook of the settings, started on the running event loop."""
    metrics = app.state.metrics
    app.state.events = EventStream(
        client,
        settings.redis_prefix,
        maxlen=settings.events_stream_maxlen,
        identification=settings.events_identification,
        metrics=metrics,
    )
    webhooks = app.state.webhooks
    # one client for every webhook of this process; its reads block up to 1 s
    reader = gallery_client(settings, settings.redis_timeout + 1.0) if webhooks else None
    workers = [
        WebhookWorker(
            reader,
            settings.redis_prefix,
            endpoint,
            settings.retry_policy(),
            claim_idle=settings.webhook_claim_idle,
            metrics=metrics,
        )
        for endpoint in webhooks
    ]
    delivery = WebhookDelivery(workers, reader)
    delivery.start()
    return delivery


def make_lifespan(settings: Settings, pipeline: FacePipeline | None):
    """The app's lifespan: load the model (unless ``pipeline`` is given), connect the gallery,
    and close the Redis clients at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limit_malloc_arenas()  # before the model's threads allocate (service.memory)
        use_cpu_memory_arena(False)  # a worker's memory goes back after large photos
        app.state.pipeline = pipeline or load_pipeline(settings)
        manifest = app.state.pipeline.manifest
        log.info("model %s on %s", manifest.model_id, app.state.pipeline.embedder.provider)
        client = connect_gallery(app, settings)
        delivery = start_events(app, settings, client)
        yield
        await delivery.stop()
        client.close()
        app.state.redis_probe.close()

    return lifespan


def add_routes(app: FastAPI, metrics: Metrics) -> None:
    """The probes, the ``/v1`` API (every route refuses unknown query parameters), the page and
    its docs, the OpenAPI document and ``/metrics``."""
    app.include_router(health.router)
    strict = Depends(reject_unknown_query)
    app.include_router(faces.router, prefix="/v1", dependencies=[Depends(require_read), strict])
    app.include_router(identify.router, prefix="/v1", dependencies=[strict])
    app.include_router(video.router, prefix="/v1", dependencies=[strict])
    app.include_router(gallery.router, prefix="/v1", dependencies=[strict])
    app.include_router(events.router, prefix="/v1", dependencies=[strict])
    app.include_router(unknowns.router, prefix="/v1", dependencies=[strict])
    add_page(app)
    install_openapi(app)

    def gallery_stats() -> tuple[int, int, int]:
        stats = app.state.store.stats(app.state.pipeline.manifest.model_id)
        return stats.subjects, stats.faces, stats.revision

    add_metrics_route(app, metrics, gallery_stats)


def add_middleware(app: FastAPI, settings: Settings, metrics: Metrics) -> None:
    """The middleware, outermost last: metrics, admission (load shedding), the key check, the
    body limit; and the worker's pixel budget for decoding."""
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(AuthGate)  # runs before BodyLimit and the routes: keys before bodies
    face_limit = settings.max_face_requests or default_face_limit()
    app.add_middleware(
        Admission,
        limit=face_limit,
        queue=settings.max_queued_requests if settings.max_queued_requests is not None else 4 * face_limit,
        wait=settings.queue_wait,
    )  # before the key check: an overloaded worker sheds load without a Redis round trip
    app.state.pixel_budget = PixelBudget(settings.decode_pixel_budget or 2 * settings.max_image_pixels)
    app.add_middleware(MetricsMiddleware, metrics=metrics)


def add_error_handlers(app: FastAPI) -> None:
    """Every error is answered as JSON ``{"code", "message"}``: domain errors with the status of
    their code (:func:`service.errors.http_status_of`), Redis failures as 503, Starlette's and
    FastAPI's own errors with codes of their own."""

    @app.exception_handler(SphereFaceError)
    async def domain_error(_: Request, exc: SphereFaceError) -> JSONResponse:
        return error_response(exc, headers=getattr(exc, "headers", None))  # e.g. Retry-After

    async def redis_down(_: Request, exc: Exception) -> JSONResponse:
        return error_response(redis_unavailable(exc))

    for error in REDIS_DOWN_ERRORS:
        app.add_exception_handler(error, redis_down)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(app, request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()
        )
        return JSONResponse(status_code=422, content={"code": "invalid_request", "message": problems})


def http_error_response(app: FastAPI, request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The answer to Starlette's HTTP errors (404, 405, ...): a body FastAPI could not read is the
    documented 422 (or the domain error that stopped it), a 405 names every method of the path."""
    if isinstance(exc.__cause__, SphereFaceError):  # FastAPI's 400 for a body it could not read
        return error_response(exc.__cause__)
    if exc.status_code == 400:  # a body that is not JSON, or a broken form: the documented 422
        return error_response(InvalidRequestError(f"the request body could not be read: {exc.detail}"))
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # Starlette names the methods of one route; a path may have several
        headers["Allow"] = ", ".join(allowed_methods(app, request.url.path))
    code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return JSONResponse(
        status_code=exc.status_code, content={"code": code, "message": str(exc.detail)}, headers=headers
    )


def create_app(settings: Settings | None = None, pipeline: FacePipeline | None = None) -> FastAPI:
    """Build the app; the model and Redis connect in the lifespan (``pipeline`` may be given)."""
    settings = settings or Settings()
    metrics = create_metrics()
    app = FastAPI(
        title="SphereFace face service",
        version="0.2.0",
        description=DESCRIPTION,
        lifespan=make_lifespan(settings, pipeline),
        docs_url=None,  # add_page serves /docs and /redoc from local files, not a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.webhooks = settings.webhook_endpoints()  # a bad entry refuses the start
    add_routes(app, metrics)
    add_middleware(app, settings, metrics)
    add_error_handlers(app)
    return app
