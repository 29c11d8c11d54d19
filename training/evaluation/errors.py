"""The evaluation jobs' errors: input data (LFW files, probe and distractor sets, caches, reports)
that cannot be used. The message names the file, and the line where there is one."""

from __future__ import annotations

from models.errors import SphereFaceError


class LFWDataError(SphereFaceError):
    """An LFW file is missing or malformed; the message names the file and the line."""

    code = "invalid_lfw_data"


class MegaFaceDataError(SphereFaceError):
    """A probe or distractor set, a list file or a cache that cannot be used."""

    code = "megaface_data"


class VerificationSetError(SphereFaceError):
    """A verification set (an insightface ``.bin`` file, IJB meta files) that cannot be used; the
    message names the file, and the line or the image where there is one."""

    code = "invalid_verification_set"
