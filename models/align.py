"""Face alignment: 5-point templates, the least-squares similarity transform, and the warp.

This is the one function every component uses to crop a face: training, evaluation and serving
align identically, since a crop that differs between them costs accuracy.
Coordinates are 0-based pixel centres: pixel (x, y) of an image covers [x-0.5, x+0.5].
Landmark order everywhere: left eye, right eye, nose tip, left mouth corner, right mouth
corner ("left" as seen in the image), as ``(5, 2)`` arrays of (x, y).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlignmentTemplate:
    """Reference landmark positions in a ``height x width`` crop."""

    name: str
    height: int
    width: int
    points: tuple[tuple[float, float], ...]

    def as_array(self) -> np.ndarray:
        return np.asarray(self.points, dtype=np.float64)


#: The SphereFace template (preprocess/code/face_align_demo.m): 112 high, 96 wide.
SPHEREFACE_TEMPLATE_112x96 = AlignmentTemplate(
    name="sphereface_112x96",
    height=112,
    width=96,
    points=(
        (30.2946, 51.6963),
        (65.5318, 51.5014),
        (48.0252, 71.7366),
        (33.5493, 92.3655),
        (62.7299, 92.2041),
    ),
)

#: The ArcFace / InsightFace template: the SphereFace points shifted +8 px in x, 112 x 112.
ARCFACE_TEMPLATE_112x112 = AlignmentTemplate(
    name="arcface_112x112",
    height=112,
    width=112,
    points=tuple((x + 8.0, y) for x, y in SPHEREFACE_TEMPLATE_112x96.points),
)

#: MTCNN's 5 points onto the 150x150 chips of dlib's face-recognition ResNet (dlib cuts them with its
#: own 5-point model, padding 0.25). Fitted on 6,002 faces of celeba_faces by
#: ``python -m training.dlib_template`` (docs/results/dlib_template.json;
#: docs/reference/model-folder.md explains the fit and why the two eye points sit close together),
#: not set by hand.
DLIB_TEMPLATE_150x150 = AlignmentTemplate(
    name="dlib_150x150",
    height=150,
    width=150,
    points=(
        (69.8515, 27.3690),
        (80.1492, 32.1494),
        (71.4609, 93.2856),
        (53.2541, 112.6500),
        (96.5306, 107.0005),
    ),
)

TEMPLATES = {t.name: t for t in (SPHEREFACE_TEMPLATE_112x96, ARCFACE_TEMPLATE_112x112, DLIB_TEMPLATE_150x150)}


def get_template(name: str) -> AlignmentTemplate:
    """Look a template up by name (``sphereface_112x96``, ``arcface_112x112`` or ``dlib_150x150``)."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown alignment template {name!r}; known: {sorted(TEMPLATES)}") from None


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Least-squares similarity transform (rotation, uniform scale, translation) src -> dst.

    Solves ``x' = a*x - b*y + tx``, ``y' = b*x + a*y + ty`` in the least-squares sense (the
    non-reflective similarity of MATLAB's ``cp2tform(..., 'similarity')``).

    Args:
        src: ``(K, 2)`` source points (x, y), K >= 2.
        dst: ``(K, 2)`` destination points.

    Returns:
        ``(2, 3)`` float64 matrix ``M`` with ``dst ~= M[:, :2] @ src + M[:, 2]``.
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or src.shape[0] < 2:
        raise ValueError(f"need two (K>=2, 2) point arrays, got {src.shape} and {dst.shape}")
    k = src.shape[0]
    x, y = src[:, 0], src[:, 1]
    design = np.zeros((2 * k, 4))
    design[:k] = np.stack([x, -y, np.ones(k), np.zeros(k)], axis=1)
    design[k:] = np.stack([y, x, np.zeros(k), np.ones(k)], axis=1)
    target = np.concatenate([dst[:, 0], dst[:, 1]])
    (a, b, tx, ty), *_ = np.linalg.lstsq(design, target, rcond=None)
    return np.array([[a, -b, tx], [b, a, ty]])


def warp_affine(image: np.ndarray, matrix: np.ndarray, height: int, width: int) -> np.ndarray:
    """Warp ``image`` by the forward affine ``matrix`` (src -> dst) into a ``height x width`` crop.

    Bilinear interpolation; pixels that fall outside the source are black (0), as in
    ``cv2.warpAffine`` with its default border.

    Args:
        image: ``(H, W, C)`` uint8 array.
        matrix: ``(2, 3)`` forward transform, source pixel coordinates -> crop coordinates.

    Returns:
        ``(height, width, C)`` uint8 array.
    """
    inverse = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    src_x = inverse[0, 0] * xs + inverse[0, 1] * ys + inverse[0, 2]
    src_y = inverse[1, 0] * xs + inverse[1, 1] * ys + inverse[1, 2]
    return _bilinear_sample(image, src_x, src_y)


def _bilinear_sample(image: np.ndarray, src_x: np.ndarray, src_y: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    x0 = np.floor(src_x)
    y0 = np.floor(src_y)
    fx = (src_x - x0)[..., None].astype(np.float32)
    fy = (src_y - y0)[..., None].astype(np.float32)
    # Indices into the image padded by one black pixel on each side (so out-of-image neighbours
    # read 0 without per-pixel branches); anything beyond one pixel outside clamps onto the border.
    xi = np.clip(x0.astype(np.int64) + 1, 0, w + 1)
    yi = np.clip(y0.astype(np.int64) + 1, 0, h + 1)
    xj = np.clip(x0.astype(np.int64) + 2, 0, w + 1)
    yj = np.clip(y0.astype(np.int64) + 2, 0, h + 1)
    # Only the window the samples read is padded, not the whole photo (a face crop reads a few
    # hundred pixels across; a phone photo has millions), and only the pixels read become floats.
    top, left = int(yi.min()), int(xi.min())
    window = np.zeros((int(yj.max()) - top + 1, int(xj.max()) - left + 1) + image.shape[2:], image.dtype)
    rows = slice(max(top, 1), min(top + window.shape[0], h + 1))
    cols = slice(max(left, 1), min(left + window.shape[1], w + 1))
    window[rows.start - top : rows.stop - top, cols.start - left : cols.stop - left] = image[
        rows.start - 1 : rows.stop - 1, cols.start - 1 : cols.stop - 1
    ]
    stride = window.shape[1]
    pixels = window.reshape(window.shape[0] * stride, -1)
    xi, xj, yi, yj = xi - left, xj - left, (yi - top) * stride, (yj - top) * stride

    def read(y: np.ndarray, x: np.ndarray) -> np.ndarray:
        return pixels.take(y + x, axis=0).astype(np.float32)

    upper = read(yi, xi) * (1 - fx) + read(yi, xj) * fx
    lower = read(yj, xi) * (1 - fx) + read(yj, xj) * fx
    out = upper * (1 - fy) + lower * fy
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def align_face(
    image: np.ndarray,
    landmarks: np.ndarray,
    template: AlignmentTemplate = SPHEREFACE_TEMPLATE_112x96,
) -> np.ndarray:
    """Crop one face: map its 5 landmarks onto ``template`` and warp.

    Args:
        image: ``(H, W, 3)`` uint8 RGB photo.
        landmarks: ``(5, 2)`` landmark (x, y) pixel coordinates in ``image``.

    Returns:
        ``(template.height, template.width, 3)`` uint8 RGB crop.
    """
    landmarks = np.asarray(landmarks, dtype=np.float64)
    if landmarks.shape != (5, 2):
        raise ValueError(f"landmarks must have shape (5, 2), got {landmarks.shape}")
    matrix = similarity_transform(landmarks, template.as_array())
    return warp_affine(image, matrix, template.height, template.width)


def align_faces(
    image: np.ndarray,
    landmarks: np.ndarray,
    template: AlignmentTemplate = SPHEREFACE_TEMPLATE_112x96,
) -> np.ndarray:
    """Crop every face of one photo: ``landmarks`` ``(N, 5, 2)`` -> ``(N, H, W, 3)`` uint8."""
    landmarks = np.asarray(landmarks, dtype=np.float64).reshape(-1, 5, 2)
    out = np.empty((len(landmarks), template.height, template.width, 3), dtype=np.uint8)
    for i, points in enumerate(landmarks):
        out[i] = align_face(image, points, template)
    return out
