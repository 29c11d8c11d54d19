"""Prometheus metrics of the service, served at ``GET /metrics``.

* ``sphereface_requests_total{method, route, status}`` and
  ``sphereface_request_duration_seconds{method, route}``: every HTTP request, counted and timed
  by :class:`MetricsMiddleware`. ``route`` is the route template (``/v1/subjects/{subject_id}``),
  or ``unmatched`` when no route matched, so the number of series stays bounded.
* ``sphereface_stage_duration_seconds{stage}``: the stages of the face path (:data:`STAGES`),
  timed with :meth:`Metrics.stage`.
* ``sphereface_gallery_subjects``, ``sphereface_gallery_faces``, ``sphereface_gallery_revision``:
  gauges set from a callback just before each scrape.
* ``sphereface_faces_detected_total`` and ``sphereface_photo_errors_total{code}``.
* ``sphereface_events_published_total{type}``, ``sphereface_events_dropped_total`` and
  ``sphereface_webhook_deliveries_total{webhook, outcome}``: events out (:mod:`service.events`).

Each :class:`Metrics` has its own registry, so several apps can live in one process. With
several workers, set ``PROMETHEUS_MULTIPROC_DIR`` to an empty folder before the workers start:
each worker then writes its values there and a scrape adds up every worker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prometheus_multiprocess

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The stages of the face path that :meth:`Metrics.stage` times.
STAGES = ("decode", "detect", "embed", "search", "redis")
#: ``route`` label of requests that matched no route.
UNMATCHED = "unmatched"
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: ``gallery_stats()`` answers (subjects, faces, revision).
GalleryStats = Callable[[], tuple[int, int, int]]


def multiprocess_dir() -> str | None:
    """The folder of multi-worker metrics (``PROMETHEUS_MULTIPROC_DIR``), or None."""
    return os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower()) or None


class Metrics:
    """The service's metrics, registered in ``registry`` (a new one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "sphereface_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=reg,
        )
        self.request_seconds = Histogram(
            "sphereface_request_duration_seconds",
            "HTTP request duration by method and route template",
            ["method", "route"],
            buckets=REQUEST_BUCKETS,
            registry=reg,
        )
        self.stage_seconds = Histogram(
            "sphereface_stage_duration_seconds",
            "Duration of the stages of the face path: " + ", ".join(STAGES),
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=reg,
        )
        # Gauges: with several workers, the value set most recently by a live worker wins.
        self.gallery_subjects = Gauge(
            "sphereface_gallery_subjects",
            "Subjects in the gallery",
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.gallery_faces = Gauge(
            "sphereface_gallery_faces",
            "Faces enrolled in the gallery",
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.gallery_revision = Gauge(
            "sphereface_gallery_revision",
            "Revision of the gallery, raised by every change",
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.faces_detected = Counter("sphereface_faces_detected", "Faces found in photos", registry=reg)
        self.photo_errors = Counter(
            "sphereface_photo_errors", "Photos rejected, by error code", ["code"], registry=reg
        )
        self.events_published = Counter(
            "sphereface_events_published", "Events added to the event stream, by type", ["type"], registry=reg
        )
        self.events_dropped = Counter(
            "sphereface_events_dropped", "Events lost: Redis refused their XADD to the stream", registry=reg
        )
        self.webhook_deliveries = Counter(
            "sphereface_webhook_deliveries",
            "Webhook delivery attempts by webhook and outcome: delivered, failed, dead_letter",
            ["webhook", "outcome"],
            registry=reg,
        )
        for stage in STAGES:  # every stage shows up, with zero counts, from the start
            self.stage_seconds.labels(stage=stage)

    # -- recording --------------------------------------------------------------------------

    def observe_stage(self, name: str, seconds: float) -> None:
        """Record that the stage ``name`` (one of :data:`STAGES`) took ``seconds``."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}: use one of {', '.join(STAGES)}")
        self.stage_seconds.labels(stage=name).observe(seconds)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as the stage ``name``, also when it raises."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}: use one of {', '.join(STAGES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds.labels(stage=name).observe(time.perf_counter() - start)

    def count_faces(self, n: int) -> None:
        """Add ``n`` faces found in photos."""
        if n > 0:
            self.faces_detected.inc(n)

    def count_photo_error(self, code: str) -> None:
        """Count a photo rejected with the error ``code`` (e.g. ``no_face``)."""
        self.photo_errors.labels(code=code).inc()

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method=method, route=route, status=str(status)).inc()
        self.request_seconds.labels(method=method, route=route).observe(seconds)

    def set_gallery(self, subjects: int, faces: int, revision: int) -> None:
        self.gallery_subjects.set(subjects)
        self.gallery_faces.set(faces)
        self.gallery_revision.set(revision)

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition: of every worker when ``PROMETHEUS_MULTIPROC_DIR``
        is set, else of this object's registry."""
        path = multiprocess_dir()
        if path:
            registry = CollectorRegistry()
            prometheus_multiprocess.MultiProcessCollector(registry, path=path)
            return generate_latest(registry)
        return generate_latest(self.registry)


def create_metrics() -> Metrics:
    """A new :class:`Metrics` with its own registry, one per app."""
    return Metrics()


def get_metrics(request: Request) -> Metrics:
    """The app's metrics (``app.state.metrics``); usable as ``Depends(get_metrics)``.

    An app without metrics gets a private, unexposed instance, so code can time stages always.
    """
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is None:
        metrics = Metrics()
        request.app.state.metrics = metrics
    return metrics


# -- HTTP -----------------------------------------------------------------------------------


def route_template(scope: dict[str, Any]) -> str:
    """The template of the route that handled ``scope`` (after routing), or ``unmatched``.

    Recent FastAPI versions keep included routers unflattened, so ``scope["route"].path`` lacks
    the router's prefix; the full template is then in FastAPI's effective route context.
    """
    route = scope.get("route")
    if route is None:
        return UNMATCHED
    fastapi_scope = scope.get("fastapi")
    if isinstance(fastapi_scope, dict):
        context = fastapi_scope.get("effective_route_context")
        if getattr(context, "original_route", None) is route:
            path = getattr(context, "path_format", None)
            if isinstance(path, str) and path:
                return path
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP request (bodies pass through).

    The status is the one of ``http.response.start``; a request whose app raises counts as
    500 and the exception goes on up.
    """

    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_and_watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            status = 500
            raise
        finally:
            self.metrics.observe_request(
                scope.get("method", "GET"), route_template(scope), status, time.perf_counter() - start
            )


def add_metrics_route(
    app: FastAPI, metrics: Metrics, gallery_stats: GalleryStats | None = None, path: str = "/metrics"
) -> None:
    """Add ``GET /metrics`` (no API key) to ``app``; it sets the gallery gauges from
    ``gallery_stats()`` first, and still answers when that fails (Redis down)."""

    def scrape() -> Response:
        if gallery_stats is not None:
            try:
                metrics.set_gallery(*gallery_stats())
            except Exception as exc:  # a scrape must not fail
                log.warning("gallery statistics for /metrics failed: %s", exc)
        return Response(content=metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(
        path,
        scrape,
        methods=["GET"],
        operation_id="metrics",
        tags=["health"],
        summary="Prometheus metrics",
        description="Prometheus text exposition of request, stage and gallery metrics (no API key needed).",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}},
    )
