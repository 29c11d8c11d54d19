"""Typed errors of the face path, each with a machine-readable ``code`` and a human message.

The service maps them to HTTP 4xx answers; the CLI prints them and exits non-zero.
"""

from __future__ import annotations


class FacePathError(Exception):
    """Base class: ``code`` is a stable machine-readable identifier."""

    code = "face_path_error"
    http_status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class UnreadableImageError(FacePathError):
    code = "unreadable_image"
    http_status = 422


class ImageTooLargeError(FacePathError):
    code = "image_too_large"
    http_status = 413


class ModelFolderError(FacePathError):
    """A model folder is missing files or its manifest is invalid."""

    code = "invalid_model"
    http_status = 500


class ProviderUnavailableError(FacePathError):
    """ONNX Runtime did not give the execution provider that was asked for."""

    code = "provider_unavailable"
    http_status = 500


class NoFaceError(FacePathError):
    """No face was found in a photo that needs one."""

    code = "no_face"
    http_status = 422


class MultipleFacesError(FacePathError):
    """A photo that must show one face shows several (policy ``reject``)."""

    code = "multiple_faces"
    http_status = 422
