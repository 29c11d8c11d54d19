"""Typed errors of the service beyond the face path (gallery, auth, Redis).

They derive from :class:`models.errors.FacePathError`, so the app answers every one of them
the same way: HTTP ``http_status`` with JSON ``{"code": ..., "message": ...}``.
"""

from __future__ import annotations

from models.errors import FacePathError


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


class RedisUnavailableError(ServiceError):
    code = "redis_unavailable"
    http_status = 503


class RedisSetupError(ServiceError):
    """A local redis-server could not be found or started."""

    code = "redis_setup_failed"
    http_status = 500
