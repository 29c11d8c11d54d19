"""Typed errors of the project, each with a stable machine-readable ``code`` and a human message.

They say what went wrong, not how to answer it: the service maps each ``code`` to an HTTP status
(``service.errors.HTTP_STATUS_BY_CODE``); the CLI prints ``error [code]: message`` and exits
non-zero.
"""

from __future__ import annotations


class SphereFaceError(Exception):
    """Base class of the project's errors: ``code`` is a stable machine-readable identifier,
    ``message`` a sentence for people (it names the file, field or photo at fault)."""

    code = "sphereface_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def as_dict(self) -> dict[str, str]:
        """``{"code": ..., "message": ...}``: the JSON body of an error answer."""
        return {"code": self.code, "message": self.message}


class FacePathError(SphereFaceError):
    """An error of the face path: reading a photo, finding, aligning and embedding its faces, or
    loading the models that do it."""

    code = "face_path_error"


class UnreadableImageError(FacePathError):
    code = "unreadable_image"


class ImageTooLargeError(FacePathError):
    code = "image_too_large"


class ModelFolderError(FacePathError):
    """A model folder is missing files or its manifest is invalid."""

    code = "invalid_model"


class ProviderUnavailableError(FacePathError):
    """ONNX Runtime did not give the execution provider that was asked for."""

    code = "provider_unavailable"


class NoFaceError(FacePathError):
    """No face was found in a photo that needs one."""

    code = "no_face"


class MultipleFacesError(FacePathError):
    """A photo that must show one face shows several (policy ``reject``)."""

    code = "multiple_faces"
