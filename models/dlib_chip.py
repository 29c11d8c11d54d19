"""dlib's face chips as similarity transforms, so they can be compared with our alignment.

dlib's ``get_face_chip_details(shape, size, padding)`` describes a chip by a rectangle in the photo
(centre, side) and an angle; ``extract_image_chip`` samples chip pixel ``p`` (0-based column, row)
at photo point ``centre + k * R(angle) @ (p - (size - 1) / 2)`` with ``k = (side - 1) / (size - 1)``
(bilinear). This module turns that description into the ``(2, 3)`` photo -> chip matrix our
:func:`models.align.warp_affine` takes, which is what the template fit
(:mod:`training.dlib_template`) and the comparison with dlib's own pipeline need.
"""

from __future__ import annotations

import math

import numpy as np


def chip_matrix(center: tuple[float, float], side: float, angle: float, size: int) -> np.ndarray:
    """Photo -> chip similarity ``(2, 3)`` of a dlib chip.

    Args:
        center: centre of the chip's rectangle in the photo, (x, y) pixels.
        side: the rectangle's width (dlib's ``drectangle.width()``: right - left + 1).
        angle: the chip's rotation, radians (dlib's ``chip_details.angle``).
        size: chip side in pixels (150 for the face-recognition ResNet).
    """
    k = (side - 1.0) / (size - 1.0)
    cos, sin = math.cos(angle), math.sin(angle)
    # chip -> photo: q = c + k R p' with p' = p - h; photo -> chip: p = h + R^T (q - c) / k.
    rotation_t = np.array([[cos, sin], [-sin, cos]]) / k
    half = (size - 1.0) / 2.0
    offset = np.array([half, half]) - rotation_t @ np.asarray(center, dtype=np.float64)
    return np.hstack([rotation_t, offset[:, None]])


def dlib_chip_matrix(chip_details) -> np.ndarray:  # noqa: ANN001 - a dlib.chip_details
    """:func:`chip_matrix` of a ``dlib.chip_details`` object (``rect``, ``angle``, ``cols``)."""
    rect = chip_details.rect
    center = ((rect.left() + rect.right()) / 2.0, (rect.top() + rect.bottom()) / 2.0)
    return chip_matrix(center, rect.width(), chip_details.angle, int(chip_details.cols))


def apply_matrix(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``(K, 2)`` points through a ``(2, 3)`` affine matrix."""
    points = np.asarray(points, dtype=np.float64)
    return points @ matrix[:, :2].T + matrix[:, 2]
