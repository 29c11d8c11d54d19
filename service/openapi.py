"""The OpenAPI document as the handlers really behave (checked by schemathesis in the tests).

FastAPI's generated document is completed once, on first request, with what the routes cannot
declare themselves:

* every `/v1` operation documents the answers every keyed route can give: 401 (the key is
  checked before anything else), 413 when it takes a body, 422, 429 (the key's rate limit, with
  ``Retry-After``) and 503 (Redis, or ``overloaded`` for the face path);
* the embeddings in JSON bodies have exactly the served model's size;
* multipart photo arrays take at least one photo and at most the service's limit.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.admission import FACE_PATHS
from service.settings import Settings

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_WORDS = {
    401: "No API key, or one that is malformed, unknown or revoked (missing_api_key, invalid_api_key)",
    403: "The key's scope does not allow this (insufficient_scope)",
    413: "The request is too large (request_too_large, image_too_large, too_many_photos)",
    422: "The request could not be read or is not valid (invalid_request, and the face-path codes)",
    429: "The key made more requests than its scope's rate limit allows (rate_limited, with Retry-After)",
    503: "Redis does not answer (redis_unavailable), a gallery write reached too few replicas "
    "(not_replicated), or the face path is full (overloaded, with Retry-After)",
}
METHODS = ("get", "post", "put", "patch", "delete")


def _error(status: int) -> dict[str, Any]:
    return {"description": ERROR_WORDS[status], "content": {"application/json": {"schema": ERROR_REF}}}


def _document_errors(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    needed = [401, 403, 422, 429, 503]
    if "requestBody" in operation or method in ("post", "patch", "put"):
        needed.append(413)
    for status in needed:
        responses.setdefault(str(status), _error(status))
    responses["429"]["headers"] = {
        "Retry-After": {
            "description": "whole seconds until the key may send its next request",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        }
    }
    if method == "post" and FACE_PATHS.match(path.replace("{subject_id}", "x")):
        responses["503"]["headers"] = {
            "Retry-After": {"description": "seconds to wait when overloaded", "schema": {"type": "integer"}}
        }


def _is_file(schema: dict[str, Any]) -> bool:
    return schema.get("format") == "binary" or "contentMediaType" in schema


def _file_counts(operation: dict[str, Any], components: dict[str, Any], most: int) -> None:
    """Multipart photo arrays: at least one photo, at most ``most``."""
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("multipart/form-data", {}).get("schema", {})
    if "$ref" in schema:  # FastAPI's own body models live in the components
        schema = components.get(schema["$ref"].rsplit("/", 1)[-1], {})
    for prop in schema.get("properties", {}).values():
        if prop.get("type") == "array" and _is_file(prop.get("items", {})):
            prop["minItems"], prop["maxItems"] = 1, most


def _embedding_size(operation: dict[str, Any], components: dict[str, Any], size: int) -> None:
    """Embedding arrays of a JSON body: exactly ``size`` numbers each."""
    schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = components.get(schema["$ref"].rsplit("/", 1)[-1], {})
    props = schema.get("properties", {})
    vector = {"type": "array", "items": {"type": "number"}, "minItems": size, "maxItems": size}
    for name in ("embedding1", "embedding2"):
        if name in props:
            props[name] = {**vector, "title": props[name].get("title", name)}
    if "embeddings" in props:
        props["embeddings"]["items"] = dict(vector)


def build_openapi(app: FastAPI, embedding_size: int | None, settings: Settings) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.get("components", {}).get("schemas", {})
    for path, item in schema.get("paths", {}).items():
        if not path.startswith("/v1/"):
            continue
        for method in METHODS:
            if method in item:
                _document_errors(path, method, item[method])
                most = settings.max_photos_per_request if path == "/v1/embed" else settings.max_bulk_items
                _file_counts(item[method], components, most)
                if embedding_size:
                    _embedding_size(item[method], components, embedding_size)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve :func:`build_openapi` at ``/openapi.json`` (built once, after the model has loaded)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            pipeline = getattr(app.state, "pipeline", None)
            size = pipeline.manifest.output_size if pipeline is not None else None
            built = build_openapi(app, size, app.state.settings)
            if size is None:
                return built  # not kept: the model's size is not known yet
            app.openapi_schema = built
        return app.openapi_schema

    app.openapi = openapi
