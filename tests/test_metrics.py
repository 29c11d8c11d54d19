"""Prometheus metrics: request counts by route template, stage timing, gallery gauges."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from models.errors import NoFaceError, SphereFaceError
from service.errors import error_response
from service.metrics import (
    MULTIPROC_ENV,
    STAGES,
    Metrics,
    MetricsMiddleware,
    add_metrics_route,
    create_metrics,
    get_metrics,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition, keyed by (name, labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def make_app(metrics: Metrics, gallery_stats=None) -> FastAPI:
    app = FastAPI()
    app.state.metrics = metrics
    router = APIRouter()

    @router.get("/subjects/{subject_id}")
    def get_subject(subject_id: str, request: Request) -> dict:
        with get_metrics(request).stage("redis"):
            pass
        return {"subject_id": subject_id}

    @router.post("/embed")
    def embed(request: Request) -> dict:
        m = get_metrics(request)
        with m.stage("decode"), m.stage("embed"):
            pass
        m.observe_stage("detect", 0.003)
        m.count_faces(2)
        return {"faces": 2}

    @router.get("/boom")
    def boom() -> dict:
        raise RuntimeError("boom")

    @router.get("/no-face")
    def no_face(request: Request) -> dict:
        get_metrics(request).count_photo_error(NoFaceError.code)
        raise NoFaceError("no face was found in the photo")

    app.include_router(router, prefix="/v1")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.exception_handler(SphereFaceError)
    async def domain_error(_: Request, exc: SphereFaceError) -> JSONResponse:
        return error_response(exc)

    add_metrics_route(app, metrics, gallery_stats)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


@pytest.fixture
def metrics() -> Metrics:
    return create_metrics()


def scrape(client: TestClient) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return response.text


def test_requests_are_counted_by_route_template_and_status(metrics: Metrics) -> None:
    client = TestClient(make_app(metrics))
    for subject in ("alice", "bob", "carol"):
        assert client.get(f"/v1/subjects/{subject}").status_code == 200
    assert client.get("/healthz").status_code == 200
    assert client.post("/v1/subjects/alice").status_code == 405
    text = scrape(client)
    route = "/v1/subjects/{subject_id}"
    assert value(text, "sphereface_requests_total", method="GET", route=route, status="200") == 3
    assert value(text, "sphereface_requests_total", method="GET", route="/healthz", status="200") == 1
    assert value(text, "sphereface_requests_total", method="POST", route=route, status="405") == 1
    assert value(text, "sphereface_request_duration_seconds_count", method="GET", route=route) == 3
    assert (
        value(text, "sphereface_request_duration_seconds_bucket", method="GET", route=route, le="+Inf") == 3
    )
    # no series carries a concrete subject id
    assert "alice" not in text and "bob" not in text


def test_unmatched_paths_share_one_route_label(metrics: Metrics) -> None:
    client = TestClient(make_app(metrics))
    for path in ("/nope", "/v1/nope", "/wp-login.php", "/v1/subjects/a/b/c"):
        assert client.get(path).status_code == 404
    text = scrape(client)
    assert value(text, "sphereface_requests_total", method="GET", route="unmatched", status="404") == 4
    assert "wp-login" not in text


def test_exceptions_count_as_500_and_typed_errors_keep_their_status(metrics: Metrics) -> None:
    client = TestClient(make_app(metrics), raise_server_exceptions=False)
    assert client.get("/v1/boom").status_code == 500
    response = client.get("/v1/no-face")
    assert response.status_code == 422 and response.json()["code"] == "no_face"
    text = scrape(client)
    assert value(text, "sphereface_requests_total", method="GET", route="/v1/boom", status="500") == 1
    assert value(text, "sphereface_requests_total", method="GET", route="/v1/no-face", status="422") == 1
    assert value(text, "sphereface_photo_errors_total", code="no_face") == 1


def test_exceptions_propagate_through_the_middleware(metrics: Metrics) -> None:
    client = TestClient(make_app(metrics))  # raise_server_exceptions=True
    with pytest.raises(RuntimeError, match="boom"):
        client.get("/v1/boom")
    text = metrics.render().decode()
    assert value(text, "sphereface_requests_total", method="GET", route="/v1/boom", status="500") == 1


def test_stage_timing_and_faces_detected(metrics: Metrics) -> None:
    client = TestClient(make_app(metrics))
    assert client.post("/v1/embed").status_code == 200
    assert client.post("/v1/embed").status_code == 200
    text = scrape(client)
    for stage in ("decode", "embed", "detect"):
        assert value(text, "sphereface_stage_duration_seconds_count", stage=stage) == 2
    # 3 ms lies in the 5 ms bucket but not the 2.5 ms one
    assert value(text, "sphereface_stage_duration_seconds_bucket", stage="detect", le="0.0025") == 0
    assert value(text, "sphereface_stage_duration_seconds_bucket", stage="detect", le="0.005") == 2
    assert value(text, "sphereface_stage_duration_seconds_sum", stage="detect") == pytest.approx(0.006)
    # stages never used are present with zero counts; buckets go from 0.5 ms to 5 s
    assert value(text, "sphereface_stage_duration_seconds_count", stage="search") == 0
    assert value(text, "sphereface_stage_duration_seconds_bucket", stage="search", le="0.0005") == 0
    assert value(text, "sphereface_stage_duration_seconds_bucket", stage="search", le="5.0") == 0
    assert value(text, "sphereface_faces_detected_total") == 4


def test_stage_is_timed_when_the_block_raises_and_names_are_checked(metrics: Metrics) -> None:
    with pytest.raises(KeyError), metrics.stage("search"):
        raise KeyError("x")
    text = metrics.render().decode()
    assert value(text, "sphereface_stage_duration_seconds_count", stage="search") == 1
    with pytest.raises(ValueError, match="unknown stage"), metrics.stage("align"):
        pass
    with pytest.raises(ValueError, match="unknown stage"):
        metrics.observe_stage("align", 0.1)
    assert set(STAGES) == {"decode", "detect", "embed", "search", "redis"}


def test_gallery_gauges_come_from_the_callback(metrics: Metrics) -> None:
    stats = {"value": (3, 17, 42)}
    client = TestClient(make_app(metrics, gallery_stats=lambda: stats["value"]))
    text = scrape(client)
    assert value(text, "sphereface_gallery_subjects") == 3
    assert value(text, "sphereface_gallery_faces") == 17
    assert value(text, "sphereface_gallery_revision") == 42
    stats["value"] = (2, 10, 43)
    text = scrape(client)
    assert value(text, "sphereface_gallery_subjects") == 2
    assert value(text, "sphereface_gallery_revision") == 43


def test_metrics_answer_when_the_gallery_callback_fails(metrics: Metrics, caplog) -> None:
    calls = []

    def broken() -> tuple[int, int, int]:
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("Redis is down")
        return (5, 6, 7)

    client = TestClient(make_app(metrics, gallery_stats=broken))
    scrape(client)
    text = scrape(client)  # the callback raises: still 200, gauges keep their last values
    assert value(text, "sphereface_gallery_subjects") == 5
    assert "Redis is down" in caplog.text


def test_metrics_route_is_documented_without_auth(metrics: Metrics) -> None:
    schema = TestClient(make_app(metrics)).get("/openapi.json").json()
    operation = schema["paths"]["/metrics"]["get"]
    assert operation["summary"] == "Prometheus metrics"
    assert "security" not in operation


def test_two_apps_in_one_process_do_not_share_counts() -> None:
    first, second = create_metrics(), create_metrics()
    TestClient(make_app(first)).get("/healthz")
    text = TestClient(make_app(second)).get("/metrics").text
    assert value(text, "sphereface_requests_total", method="GET", route="/healthz", status="200") is None
    text = first.render().decode()
    assert value(text, "sphereface_requests_total", method="GET", route="/healthz", status="200") == 1


def test_middleware_streams_bodies_without_buffering(metrics: Metrics) -> None:
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        assert sent[-1]["body"] == b"one"  # already passed on before the app goes on
        await send({"type": "http.response.body", "body": b"two", "more_body": False})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "PUT", "path": "/x", "headers": []}
    asyncio.run(MetricsMiddleware(app, metrics)(scope, receive, send))
    assert [m.get("body") for m in sent] == [None, b"one", b"two"]
    text = metrics.render().decode()
    assert value(text, "sphereface_requests_total", method="PUT", route="unmatched", status="201") == 1


def test_non_http_scopes_pass_through(metrics: Metrics) -> None:
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["type"])

    asyncio.run(MetricsMiddleware(app, metrics)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]
    assert "sphereface_requests_total{" not in metrics.render().decode()


WORKER = textwrap.dedent(
    """
    import sys
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from service.metrics import MetricsMiddleware, add_metrics_route, create_metrics

    requests, subjects, show = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "show"
    metrics = create_metrics()
    app = FastAPI()

    @app.get("/items/{item_id}")
    def item(item_id: int) -> dict:
        with metrics.stage("search"):
            pass
        return {"item_id": item_id}

    add_metrics_route(app, metrics, lambda: (subjects, 2 * subjects, 1))
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    client = TestClient(app)
    for i in range(requests):
        assert client.get(f"/items/{i}").status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200
    if show:
        sys.stdout.write(response.text)
    """
)


def test_multiprocess_mode_sums_the_workers(tmp_path: Path) -> None:
    """Two worker processes write to PROMETHEUS_MULTIPROC_DIR; a scrape adds them up."""
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = {**os.environ, MULTIPROC_ENV: str(multiproc), "PYTHONPATH": str(REPO_ROOT)}
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    def worker(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    worker("2", "9", "quiet")  # scrapes too, setting the gauges to 9 subjects
    text = worker("3", "5", "show")
    route = "/items/{item_id}"
    assert value(text, "sphereface_requests_total", method="GET", route=route, status="200") == 5
    assert value(text, "sphereface_request_duration_seconds_count", method="GET", route=route) == 5
    assert value(text, "sphereface_stage_duration_seconds_count", stage="search") == 5
    # the gauges show the values set most recently (a gallery can shrink), not the largest
    assert value(text, "sphereface_gallery_subjects") == 5
    assert value(text, "sphereface_gallery_faces") == 10
    assert any(multiproc.iterdir())
