"""Typed errors of the service beyond the face path (gallery, auth, Redis), and the one table
that turns an error's ``code`` into the HTTP status of its answer.

Every :class:`models.errors.SphereFaceError` the app meets is answered the same way: HTTP
``http_status_of(error)`` with the JSON body ``{"code": ..., "message": ...}``.
"""

from __future__ import annotations

import logging

import redis
from fastapi.responses import JSONResponse

from models.errors import SphereFaceError

log = logging.getLogger(__name__)

#: The HTTP status of every error code. The project's own decision: 4xx for what the client can
#: fix (401/403 keys, 404/409 gallery state, 413 sizes, 415 media types, 422 content, 429 a key
#: over its rate), 503 for what passes with time (Redis, load), 500 for a model or server set up
#: wrongly. A code that is missing here is answered 500 and logged (tests/test_error_codes.py
#: checks none is missing).
HTTP_STATUS_BY_CODE: dict[str, int] = {
    # any domain error, face path included
    "sphereface_error": 400,
    "face_path_error": 400,
    "unreadable_image": 422,
    "image_too_large": 413,
    "unreadable_video": 422,
    "video_too_large": 413,
    "video_too_long": 422,
    "missing_dependency": 500,  # an optional package (e.g. PyAV for video) is not installed
    "no_face": 422,
    "multiple_faces": 422,
    "invalid_model": 500,
    "provider_unavailable": 500,
    "dlib_format": 500,
    "dlib_parity": 500,
    "ensemble_mismatch": 500,
    "onnx_parity": 500,
    # training and evaluation inputs
    "invalid_config": 400,
    "dataset_error": 400,
    "dataset_mismatch": 400,
    "damaged_recordio": 400,
    "worker_died": 500,
    "megaface_data": 422,
    "invalid_lfw_data": 400,
    "invalid_verification_set": 400,
    # the command line
    "invalid_arguments": 400,
    # the service
    "service_error": 400,
    "missing_api_key": 401,
    "invalid_api_key": 401,
    "insufficient_scope": 403,
    "subject_not_found": 404,
    "face_not_found": 404,
    "webhook_not_found": 404,
    "dead_letter_not_found": 404,
    "no_face_image": 404,
    "unknown_cluster_not_found": 404,
    "unknown_face_not_found": 404,
    "unknowns_off": 404,  # SPHEREFACE_KEEP_UNKNOWN is off: no unknown faces are kept
    "subject_exists": 409,
    "duplicate_photo": 409,
    "request_too_large": 413,
    "too_many_photos": 413,
    "unsupported_media_type": 415,
    "invalid_embedding": 422,
    "invalid_request": 422,
    "no_threshold": 422,
    "low_quality": 422,
    "rate_limited": 429,
    "redis_setup_failed": 500,
    "invalid_webhooks": 500,  # SPHEREFACE_WEBHOOKS is wrong: the service refuses to start
    "serve_running": 409,  # `sphereface serve` only: another serve holds the data folder
    "migration_refused": 409,  # `sphereface gallery migrate` only: the source or the cluster is not fit
    "migration_mismatch": 409,  # `sphereface gallery migrate` only: the copy differs from the source
    "redis_unavailable": 503,
    "not_replicated": 503,
    "overloaded": 503,
}


def http_status_of(error: SphereFaceError) -> int:
    """The HTTP status that answers ``error``, from :data:`HTTP_STATUS_BY_CODE` (500 for a code
    the table lacks)."""
    status = HTTP_STATUS_BY_CODE.get(error.code)
    if status is None:
        log.error("error code %r has no HTTP status; answering 500", error.code)
        return 500
    return status


def error_response(error: SphereFaceError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON answer to ``error``: its status from the table, body ``{"code", "message"}``."""
    return JSONResponse(status_code=http_status_of(error), content=error.as_dict(), headers=headers)


class ServiceError(SphereFaceError):
    """An error of the service itself: keys, the gallery, requests, Redis."""

    code = "service_error"


class MissingApiKeyError(ServiceError):
    code = "missing_api_key"


class InvalidApiKeyError(ServiceError):
    code = "invalid_api_key"


class InsufficientScopeError(ServiceError):
    code = "insufficient_scope"


class SubjectNotFoundError(ServiceError):
    code = "subject_not_found"


class SubjectExistsError(ServiceError):
    code = "subject_exists"


class FaceNotFoundError(ServiceError):
    code = "face_not_found"


class WebhookNotFoundError(ServiceError):
    """No webhook of that name is configured (``SPHEREFACE_WEBHOOKS``)."""

    code = "webhook_not_found"


class DeadLetterNotFoundError(ServiceError):
    code = "dead_letter_not_found"


class NoFaceImageError(ServiceError):
    """The face exists but no image of it is stored."""

    code = "no_face_image"


class DuplicatePhotoError(ServiceError):
    """The same photo (same bytes, same model) is already enrolled."""

    code = "duplicate_photo"


class InvalidEmbeddingError(ServiceError):
    code = "invalid_embedding"


class LowQualityError(ServiceError):
    """A face under the enrollment floor (``SPHEREFACE_MIN_QUALITY``); ``reason`` says what lowers
    its quality most: ``too_small``, ``blurred``, ``turned_away`` or ``unclear_face``."""

    code = "low_quality"

    def __init__(self, message: str, reason: str | None = None, quality: float | None = None) -> None:
        super().__init__(message)
        self.reason, self.quality = reason, quality

    def as_dict(self) -> dict:
        """``{"code", "message"}`` and, when known, ``reason`` and ``quality``."""
        extra = {"reason": self.reason, "quality": self.quality}
        return {**super().as_dict(), **{k: v for k, v in extra.items() if v is not None}}


class InvalidRequestError(ServiceError):
    code = "invalid_request"


class RequestTooLargeError(ServiceError):
    code = "request_too_large"


class TooManyPhotosError(ServiceError):
    """More photos (or items) in one request than the service takes."""

    code = "too_many_photos"


class RedisUnavailableError(ServiceError):
    code = "redis_unavailable"


class NotReplicatedError(ServiceError):
    """A gallery write that the Redis primary applied but fewer replicas than required confirmed
    in time (``WAIT``): it is not acknowledged."""

    code = "not_replicated"

    @classmethod
    def of(cls, acknowledged: int, required: int, wait_ms: int) -> NotReplicatedError:
        log.warning("a gallery write reached %d of %d replicas within %d ms", acknowledged, required, wait_ms)
        return cls(
            f"the gallery's Redis confirmed this change on {acknowledged} of the {required} replicas "
            f"required within {wait_ms} ms, so it is not acknowledged: it may or may not be kept. "
            "Retrying is safe: a repeated enrollment of the same photo answers duplicate_photo with "
            "the face it made, a repeated subject creation subject_exists, a repeated deletion "
            "face_not_found or subject_not_found"
        )


class RedisSetupError(ServiceError):
    """The gallery's Redis could not be set up: a local redis-server not found or not started, a
    cluster that does not answer, or a contradictory choice of Redis."""

    code = "redis_setup_failed"


class MigrationRefusedError(ServiceError):
    """``sphereface gallery migrate`` will not start: the source is empty or cannot be reached,
    or the cluster holds another gallery."""

    code = "migration_refused"


class MigrationMismatchError(ServiceError):
    """``sphereface gallery migrate`` read the copy back and it differs from the source."""

    code = "migration_mismatch"


#: Failures of a Redis (or Redis Cluster) that pass: answered 503 ``redis_unavailable``. Besides
#: a connection refused or a timeout, a cluster may be down (no primary for a slot yet, during a
#: failover: CLUSTERDOWN, MASTERDOWN), ask for a retry (TRYAGAIN, while a slot migrates) or have
#: a slot no node serves; so is a redirection (MOVED, ASK) the client gave up following.
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.AskError,  # and MovedError, its subclass
)


def redis_unavailable(exc: BaseException, doing: str = "") -> RedisUnavailableError:
    """The 503 answer for a Redis that fails: the details (hosts, socket paths) go to the log only,
    never to the client, who may not even have a key."""
    kind = "did not answer in time" if isinstance(exc, redis.TimeoutError) else "cannot be reached"
    log.warning("Redis %s%s: %s: %s", kind, f" ({doing})" if doing else "", type(exc).__name__, exc)
    what = f", so the service cannot {doing}" if doing else ""
    return RedisUnavailableError(f"the gallery's Redis {kind}{what}; try again shortly")
