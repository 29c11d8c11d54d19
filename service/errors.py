"""Typed errors of the service beyond the face path (gallery, auth, Redis).

They derive from :class:`models.errors.FacePathError`, so the app answers every one of them
the same way: HTTP ``http_status`` with JSON ``{"code": ..., "message": ...}``.
"""

from __future__ import annotations

import logging

import redis

from models.errors import FacePathError

log = logging.getLogger(__name__)


class ServiceError(FacePathError):
    code = "service_error"
    http_status = 400


class MissingApiKeyError(ServiceError):
    code = "missing_api_key"
    http_status = 401


class InvalidApiKeyError(ServiceError):
    code = "invalid_api_key"
    http_status = 401


class InsufficientScopeError(ServiceError):
    code = "insufficient_scope"
    http_status = 403


class SubjectNotFoundError(ServiceError):
    code = "subject_not_found"
    http_status = 404


class SubjectExistsError(ServiceError):
    code = "subject_exists"
    http_status = 409


class FaceNotFoundError(ServiceError):
    code = "face_not_found"
    http_status = 404


class NoFaceImageError(ServiceError):
    """The face exists but no image of it is stored."""

    code = "no_face_image"
    http_status = 404


class DuplicatePhotoError(ServiceError):
    """The same photo (same bytes, same model) is already enrolled."""

    code = "duplicate_photo"
    http_status = 409


class InvalidEmbeddingError(ServiceError):
    code = "invalid_embedding"
    http_status = 422


class InvalidRequestError(ServiceError):
    code = "invalid_request"
    http_status = 422


class RequestTooLargeError(ServiceError):
    code = "request_too_large"
    http_status = 413


class TooManyPhotosError(ServiceError):
    """More photos (or items) in one request than the service takes."""

    code = "too_many_photos"
    http_status = 413


class RedisUnavailableError(ServiceError):
    code = "redis_unavailable"
    http_status = 503


class RedisSetupError(ServiceError):
    """A local redis-server could not be found or started."""

    code = "redis_setup_failed"
    http_status = 500


def redis_unavailable(exc: BaseException, doing: str = "") -> RedisUnavailableError:
    """The 503 answer for a Redis that fails: the details (hosts, socket paths) go to the log only,
    never to the client, who may not even have a key."""
    kind = "did not answer in time" if isinstance(exc, redis.TimeoutError) else "cannot be reached"
    log.warning("Redis %s%s: %s: %s", kind, f" ({doing})" if doing else "", type(exc).__name__, exc)
    what = f", so the service cannot {doing}" if doing else ""
    return RedisUnavailableError(f"the gallery's Redis {kind}{what}; try again shortly")
