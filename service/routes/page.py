"""The browser page at ``/``, its static files, and the API docs served without any CDN.

The page (``service/static``) is plain HTML, CSS and JavaScript modules that call the REST API
from the same origin; nothing is loaded from another host. Swagger UI and ReDoc come from the
PyPI package ``fastapi-offline`` (MIT; it bundles Swagger UI, Apache-2.0, and ReDoc, MIT), so
``/docs`` and ``/redoc`` work on a machine with no internet.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from service.auth import Principal, require_read

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
PAGE_URL = "/"
STATIC_URL = "/static"
DOCS_ASSETS_URL = "/docs-assets"

#: The page runs only its own scripts and talks only to this service; photos are shown from
#: blob: URLs and the camera's stream from mediastream:.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
        "media-src 'self' blob: mediastream:; connect-src 'self'; object-src 'none'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Permissions-Policy": "camera=(self), microphone=()",
    "Cache-Control": "no-cache",
}

#: The API docs pages: their own inline start-up script (allowed by its hash), the bundles from
#: /docs-assets, and no other host.
DOCS_POLICY = (
    "default-src 'self'; script-src 'self' {scripts}; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
#: ReDoc's sidebar shows a logo from Redocly's CDN; ours is served in its place.
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)

router = APIRouter(tags=["auth"])


class KeyInfo(BaseModel):
    key_id: str = Field(
        description="the key's public id; `env` for SPHEREFACE_API_KEY, `auth-off` without keys"
    )
    scope: str = Field(description="read, or admin (may change the gallery)")


def docs_assets_dir() -> Path:
    """The folder of Swagger UI's and ReDoc's files, from the installed ``fastapi-offline``."""
    return Path(str(files("fastapi_offline") / "static"))


@router.get(PAGE_URL, include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get(
    "/v1/key",
    operation_id="get_key",
    response_model=KeyInfo,
    summary="The API key of the request: its id and scope",
)
def key_info(principal: Annotated[Principal, Depends(require_read)]) -> KeyInfo:
    """The page asks this to tell a read key from an admin key. Errors as for every keyed route:
    `missing_api_key`, `invalid_api_key` (401)."""
    return KeyInfo(key_id=principal.key_id, scope=principal.scope)


@lru_cache(maxsize=1)
def redoc_bundle(logo_url: str) -> bytes:
    """ReDoc's standalone bundle with its one reference to another host pointed at ``logo_url``."""
    text = (docs_assets_dir() / "redoc.standalone.js").read_text(encoding="utf-8")
    return text.replace(REDOC_LOGO, logo_url).encode("utf-8")


def with_docs_policy(page: HTMLResponse) -> HTMLResponse:
    """``page`` with :data:`DOCS_POLICY`, allowing its inline scripts by their SHA-256."""
    hashes = [
        "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"
        for script in _INLINE_SCRIPT.findall(page.body.decode())
    ]
    page.headers["Content-Security-Policy"] = DOCS_POLICY.format(scripts=" ".join(hashes))
    page.headers["X-Content-Type-Options"] = "nosniff"
    return page


def add_page(app: FastAPI) -> None:
    """Serve the page at ``/``, its files at ``/static`` and the API docs at ``/docs``, ``/redoc``.

    The app must be built with ``docs_url=None, redoc_url=None`` (FastAPI's own pages load their
    scripts from a CDN).
    """
    app.include_router(router)

    @app.get(f"{DOCS_ASSETS_URL}/redoc.standalone.js", include_in_schema=False)
    def redoc_script(request: Request) -> Response:
        logo = f"{request.scope.get('root_path', '')}{STATIC_URL}/favicon.svg"
        return Response(
            redoc_bundle(logo),
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=86400"},
        )

    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=docs_assets_dir()), name="docs-assets")
    title = app.title

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return with_docs_policy(
            get_swagger_ui_html(
                openapi_url=root + app.openapi_url,
                title=f"{title}: API",
                swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
                swagger_favicon_url=f"{root}{STATIC_URL}/favicon.svg",
            )
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return with_docs_policy(
            get_redoc_html(
                openapi_url=root + app.openapi_url,
                title=f"{title}: API reference",
                redoc_js_url=f"{root}{DOCS_ASSETS_URL}/redoc.standalone.js",
                redoc_favicon_url=f"{root}{STATIC_URL}/favicon.svg",
                with_google_fonts=False,
            )
        )
