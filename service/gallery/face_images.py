"""The face region kept with an enrolled face, so a gallery can be re-embedded for another model.

A face enrolled from a photo keeps a JPEG of the region around it (a square of
:data:`REGION_SCALE` times the detected box, at most :data:`REGION_MAX_SIDE` pixels a side; about
15-30 KB) and its 5 landmarks in that region's pixels. Any model's template can be cut from it
later (``sphereface gallery reembed``), and it can be shown as a thumbnail. The photo itself is
never stored. ``SPHEREFACE_STORE_FACE_IMAGES=false`` turns this off.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

#: Side of the stored square region, as a multiple of the detected box's larger side: enough
#: context for every template (dlib's 150x150 chip spans about 1.5 box widths).
REGION_SCALE = 2.2
#: Largest side of the stored region, pixels (a 150-pixel chip never needs more than 2x this).
REGION_MAX_SIDE = 320
JPEG_QUALITY = 90


@dataclass
class FaceRegion:
    """A JPEG of the region around a face and the face's landmarks in the region's pixels."""

    jpeg: bytes
    landmarks: np.ndarray  # (5, 2) float

    def image(self) -> np.ndarray:
        """The region as an RGB uint8 array."""
        with Image.open(io.BytesIO(self.jpeg)) as img:
            return np.asarray(img.convert("RGB"))


def cut_face_region(image: np.ndarray, box: np.ndarray, landmarks: np.ndarray) -> FaceRegion:
    """The stored region of one face of ``image`` (RGB uint8, (H, W, 3)).

    The square is centred on the box; parts outside the photo are black. It is scaled down (never
    up) to :data:`REGION_MAX_SIDE`, with a box filter first when it shrinks by 2x or more, then
    the bilinear warp of :func:`models.align.warp_affine` (the same pixel-centre convention as the
    crops, so the stored landmarks are exact).
    """
    from models.align import warp_affine

    x1, y1, x2, y2 = (float(v) for v in np.asarray(box).ravel()[:4])
    side = REGION_SCALE * max(x2 - x1, y2 - y1, 1.0)
    left, top = (x1 + x2) / 2 - side / 2, (y1 + y2) / 2 - side / 2
    scale = min(1.0, REGION_MAX_SIDE / side)
    out = max(1, int(round(side * scale)))
    height, width = image.shape[:2]
    # The part of the photo under the square (whole pixels), reduced by k with a box filter.
    cx0, cy0 = max(0, int(np.floor(left))), max(0, int(np.floor(top)))
    cx1, cy1 = min(width, int(np.ceil(left + side)) + 1), min(height, int(np.ceil(top + side)) + 1)
    k = max(1, int(1.0 / scale)) if scale < 0.5 else 1
    source = image[cy0:cy1, cx0:cx1]
    if k > 1 and min(source.shape[:2]) >= k:
        source = np.asarray(Image.fromarray(np.ascontiguousarray(source)).reduce(k))
    else:
        k = 1
    # Reduced pixel r sits at photo point (cx0, cy0) + (k - 1) / 2 + k * r; the region is
    # (photo point - (left, top)) * scale.
    offset = (np.array([cx0, cy0]) + (k - 1) / 2.0 - [left, top]) * scale
    matrix = np.array([[k * scale, 0.0, offset[0]], [0.0, k * scale, offset[1]]])
    region = warp_affine(source, matrix, out, out) if source.size else np.zeros((out, out, 3), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(region).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    points = (np.asarray(landmarks, dtype=np.float64).reshape(5, 2) - [left, top]) * scale
    return FaceRegion(buffer.getvalue(), points)
