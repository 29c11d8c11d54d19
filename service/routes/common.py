"""What the routes share: app state, bodies that are photos or JSON (strictly read), photos to
faces, and the face-path turns (detection and embedding) apart from the Redis work."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from models.embedder import l2_normalize
from models.errors import FacePathError, ImageTooLargeError, SphereFaceError
from models.image import DecodedPhoto, decode_photo, image_size
from models.mtcnn import DetectedFace
from models.pipeline import FacePipeline
from models.quality import FaceQuality, face_quality
from service.admission import PixelBudget, Ticket
from service.errors import InvalidRequestError, ServiceError, TooManyPhotosError
from service.gallery.face_images import REGION_MAX_SIDE, REGION_SCALE, FaceRegion, cut_face_region
from service.memory import IDLE_TRIM
from service.metrics import Metrics
from service.schemas import Face
from service.settings import Settings

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class UnsupportedMediaTypeError(ServiceError):
    code = "unsupported_media_type"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json.loads`` object_pairs_hook)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise InvalidRequestError(
            f"the JSON body holds the key {repeated[:64]!r} more than once in one object; "
            "each key may appear once (which one counts would depend on the parser)"
        )
    return found


def parse_json(body: bytes) -> Any:
    """A JSON body as Python values; an object with a repeated key is refused (422
    ``invalid_request``). Raises ``ValueError`` (``json.JSONDecodeError``) for text that is not
    JSON."""
    return json.loads(body, object_pairs_hook=_unique_keys)


class StrictJsonRequest(Request):
    """A request whose ``json()`` refuses repeated keys (:func:`parse_json`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictRoute(APIRoute):
    """The route class of every router of the API: JSON bodies FastAPI reads go through
    :func:`parse_json`, and a multipart form FastAPI reads with more parts than Starlette's limit
    is 413 ``too_many_photos`` like a form over the service's own limit (not Starlette's 400)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            try:
                return await handler(StrictJsonRequest(request.scope, request.receive))
            except StarletteHTTPException as exc:
                limit = request.app.state.settings.max_photos_per_request
                error = form_limit_error(exc, f"at most {limit} photos per request")
                if error is None:
                    raise
                raise error from exc

        return strict


def form_limit_error(exc: StarletteHTTPException, photos: str) -> ServiceError | None:
    """The 413 ``too_many_photos`` of Starlette's error for a form over its part limits, or None."""
    detail = str(exc.detail)
    if exc.status_code != 400 or not detail.startswith(("Too many files", "Too many fields")):
        return None
    return TooManyPhotosError(f"{photos}; the form has too many parts ({detail})")


def face_schema(face: DetectedFace, quality: FaceQuality | None = None) -> Face:
    return Face(
        box=face.box.tolist(),
        landmarks=face.landmarks.tolist(),
        detection_score=face.score,
        quality=None if quality is None else round(quality.score, 4),
    )


async def read_body(request: Request, model: type[BaseModel], *, max_files: int) -> BaseModel | FormData:
    """The request's JSON body validated as ``model``, or its multipart form (photos)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        return validate_json(model, await request.body())
    if content_type == "multipart/form-data":
        try:
            return await request.form(max_files=max_files, max_fields=max_files + 64)
        except StarletteHTTPException as exc:  # Starlette's 400 for a form over its limits
            limit_error = form_limit_error(exc, f"at most {max_files} photos per request")
            if limit_error is not None:
                raise limit_error from exc
            raise InvalidRequestError(f"the multipart form could not be read: {exc.detail}") from exc
    raise UnsupportedMediaTypeError(
        "send photos as multipart/form-data or embeddings as application/json, "
        f"not {content_type or 'nothing'!r}"
    )


async def read_form(request: Request, *, max_files: int, what: str) -> FormData:
    """The request's multipart form, for a route that takes files only (415 otherwise)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise UnsupportedMediaTypeError(
            f"send {what} as multipart/form-data, not {content_type or 'nothing'!r}"
        )
    return await read_body(request, BaseModel, max_files=max_files)


def validate_json(model: type[M], raw: bytes) -> M:
    """A JSON body (:func:`parse_json`: no repeated keys) validated as ``model``; every problem is
    422 ``invalid_request`` with the fields at fault named."""
    try:
        return model.model_validate(parse_json(raw))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ())) or 'body'}: {err.get('msg')}"
            for err in exc.errors()
        )
        raise InvalidRequestError(problems) from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise InvalidRequestError(f"the request body is not JSON: {exc}") from exc


def form_files(form: FormData, name: str, *, required: bool = True) -> list[UploadFile]:
    files = [f for f in form.getlist(name) if isinstance(f, UploadFile)]
    if required and not files:
        raise InvalidRequestError(f"the form has no file field {name!r}")
    return files


@dataclass
class PhotoFaces:
    """One uploaded photo after decoding and detection (before embedding). The full-size photo is
    not kept: only the aligned crops and, when asked for, the stored region of the first face.
    ``qualities``: one per embedded face, set by :meth:`FaceWork.embed_photos`."""

    sha256: str
    faces: list[DetectedFace]
    crops: np.ndarray
    region: FaceRegion | None = None
    qualities: list[FaceQuality] = field(default_factory=list)
    #: the stored region of every face, in order (``detect(regions=True)``)
    regions: list[FaceRegion] | None = None


#: Threads that detect the photos of one request side by side (shared by the worker's requests).
_PHOTO_THREADS = ThreadPoolExecutor(2, thread_name_prefix="photo")


class FaceWork:
    """Photos to faces to embeddings, each stage timed in the metrics."""

    def __init__(
        self,
        pipeline: FacePipeline,
        settings: Settings,
        metrics: Metrics,
        budget: PixelBudget | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.metrics = metrics
        self.budget = budget or PixelBudget(2 * settings.max_image_pixels)
        self.ticket = ticket or Ticket(None)

    async def in_turn(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` (decoding, detection, embedding: no Redis) on a face thread, during one
        of the worker's face-path turns (:mod:`service.admission`; 503 ``overloaded`` when none
        comes in time)."""
        return await self.ticket.run(work, *args)

    async def off_turn(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` (Redis work) in the thread pool, holding no turn nor a place in the
        queue: a stalled Redis holds back only the requests that need it."""
        async with self.ticket.aside():
            return await run_in_threadpool(call, *args)

    def read(self, upload: UploadFile) -> tuple[np.ndarray, str]:
        """Read and decode an upload within the limits; returns the image and the bytes' SHA-256."""
        photo, sha = self._decode(upload, None)
        return photo.image, sha

    def _decode(self, upload: UploadFile, min_side: int | None) -> tuple[DecodedPhoto, str]:
        """:meth:`read`, a JPEG at the smallest DCT scale with ``min_side`` pixels on its longer side."""
        limit = self.settings.max_upload_bytes
        name = upload.filename or "photo"
        with self.metrics.stage("decode"):
            upload.file.seek(0)
            data = upload.file.read(limit + 1)
            if len(data) > limit:
                raise ImageTooLargeError(f"{name} is larger than {limit} bytes")
            try:
                photo = decode_photo(
                    data, max_bytes=limit, max_pixels=self.settings.max_image_pixels, min_side=min_side
                )
            except FacePathError as exc:
                exc.message = f"{name}: {exc.message}"
                raise
        return photo, hashlib.sha256(data).hexdigest()

    def detect(
        self, upload: UploadFile, policy: str, *, region: bool = False, regions: bool = False
    ) -> PhotoFaces:
        """Decode, detect, select (policy) and align, within the worker's pixel budget; typed
        errors name the photo. ``region``: also cut the stored region of the first face;
        ``regions``: of every face.

        A JPEG is decoded at the scale detection needs (:attr:`FacePipeline.decode_side`) and its
        crops cut at the scale they need (:meth:`FacePipeline.photo_crops`; the region too)."""
        side = self.pipeline.decode_side
        with IDLE_TRIM.working(), self.budget.hold(self._pixels(upload, side)):
            photo, sha = self._decode(upload, side)
            try:
                with self.metrics.stage("detect"):
                    found = self.pipeline.photo_crops(
                        photo,
                        policy,
                        min_face_side=REGION_MAX_SIDE / REGION_SCALE if region or regions else 0.0,
                    )
            except FacePathError as exc:
                exc.message = f"{upload.filename or 'photo'}: {exc.message}"
                raise
            faces, crops, source = found.faces, found.crops, found.source
            cuts = [
                cut_face_region(
                    source.image, source.box_from_full(face.box), source.from_full(face.landmarks)
                )
                for face in (faces if regions else faces[:1] if region else [])
            ]
            del photo, source, found  # the decoded photo goes before the budget is handed on
        self.metrics.count_faces(len(faces))
        return PhotoFaces(
            sha, faces, crops, cuts[0] if region and cuts else None, regions=cuts if regions else None
        )

    def detect_each(self, uploads: list[UploadFile], policy: str) -> list[PhotoFaces]:
        """:meth:`detect` for several photos at once, two at a time (decoding, PIL and ONNX Runtime
        release the GIL, so a two-photo verify uses both cores); the first photo's error wins, as
        when they are detected one after the other."""
        if len(uploads) < 2:
            return [self.detect(u, policy) for u in uploads]
        return list(_PHOTO_THREADS.map(lambda u: self.detect(u, policy), uploads))

    def read_aligned(self, upload: UploadFile) -> tuple[np.ndarray, str]:
        """Decode a photo that is already an aligned crop, within the pixel budget."""
        with IDLE_TRIM.working(), self.budget.hold(self._pixels(upload)):
            return self.read(upload)

    def _pixels(self, upload: UploadFile, min_side: int | None = None) -> int:
        """The pixels the photo decodes to, from its header (0 when unreadable: decoding will say why)."""
        upload.file.seek(0)
        size = image_size(upload.file, min_side)
        upload.file.seek(0)
        return size[0] * size[1] if size else 0

    def embed(self, crops: list[np.ndarray] | np.ndarray, *, normalize: bool = True) -> np.ndarray:
        """Embed aligned crops in batches (one array per photo, or one stacked array);
        ``normalize=False``: the fused raw output (its norm is a quality ingredient)."""
        if isinstance(crops, list):
            if not crops:
                return np.zeros((0, self.pipeline.manifest.output_size), np.float32)
            crops = np.concatenate(crops)
        with IDLE_TRIM.working(), self.metrics.stage("embed"):
            return self.pipeline.embedder.embed(crops, normalize=normalize)

    def embed_photos(self, photos: list[PhotoFaces], *, first_only: bool = False) -> np.ndarray:
        """The unit embeddings of the faces of ``photos`` (of each one's first face only with
        ``first_only``), in order; sets each photo's ``qualities``. A photo without detected faces
        is an aligned crop: the whole crop is the face."""
        crops = [p.crops[:1] if first_only else p.crops for p in photos]
        raw = self.embed(crops, normalize=False)
        template = self.pipeline.template
        model_id = self.pipeline.manifest.model_id
        row = 0
        for photo, cut in zip(photos, crops, strict=True):
            faces = photo.faces[: len(cut)] or [
                DetectedFace(
                    np.array([0.0, 0.0, template.width - 1.0, template.height - 1.0]),
                    1.0,
                    template.as_array(),
                )
            ]
            photo.qualities = [
                face_quality(f.score, f.box, f.landmarks, crop, raw[row + i], model_id=model_id)
                for i, (f, crop) in enumerate(zip(faces, cut, strict=True))
            ]
            row += len(cut)
        return l2_normalize(raw)

    def error(self, exc: SphereFaceError) -> dict[str, Any]:
        """The status and message of one photo that failed (counted in the metrics by its code)."""
        self.metrics.count_photo_error(exc.code)
        return {"status": exc.code, "message": exc.message}


async def get_face_work(request: Request) -> FaceWork:
    """The face work of a request, with its place in the face-path queue (a dependency; async:
    it waits on nothing, so it takes no thread)."""
    state = request.app.state
    ticket = getattr(request.state, "face_ticket", None)
    return FaceWork(state.pipeline, state.settings, state.metrics, state.pixel_budget, ticket)


def openapi_body(
    files: dict[str, str],
    json_model: type[BaseModel] | None = None,
    *,
    many: str = "",
    text_lists: dict[str, str] | None = None,
) -> dict:
    """``openapi_extra`` documenting a body that is photos (multipart) or, optionally, JSON.

    ``files`` maps each file field to its description; the field named ``many`` takes several;
    ``text_lists`` are repeated text fields.
    """
    properties: dict[str, Any] = {
        name: {"type": "array", "items": {"type": "string"}, "description": description}
        for name, description in (text_lists or {}).items()
    }
    for name, description in files.items():
        one = {"type": "string", "format": "binary"}
        properties[name] = (
            {"type": "array", "items": one, "description": description}
            if name == many
            else {**one, "description": description}
        )
    content: dict[str, Any] = {
        "multipart/form-data": {
            "schema": {"type": "object", "properties": properties, "required": list(properties)}
        }
    }
    if json_model is not None:
        content["application/json"] = {"schema": json_model.model_json_schema()}
    return {"requestBody": {"required": True, "content": content}}


async def reject_unknown_query(request: Request) -> None:
    """A dependency of every ``/v1`` route: a query parameter the route does not take is a 422
    that names it (a typo such as ``?thresold=`` must not pass unnoticed)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None or not request.query_params:
        return
    known = getattr(route, "_query_names", None)
    if known is None:  # worked out once per route, not per request
        known = route._query_names = frozenset(_query_names(dependant))
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise InvalidRequestError(f"unknown query parameter {unknown[0]!r}; this operation takes: {takes}")


def _query_names(dependant) -> set[str]:
    """The query parameters a route and its dependencies take (by the name clients send)."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


#: The OpenAPI answer of a route that returns a stored face region (JPEG).
FACE_IMAGE_RESPONSES: dict = {
    200: {
        "content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}},
        "description": "the region around the face",
    }
}


def face_image_response(region) -> Response:
    """A stored face region as a JPEG answer, cacheable by this client only."""
    return Response(
        content=region.jpeg, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"}
    )
