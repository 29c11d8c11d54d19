"""Crops of any alignment template cut from ArcFace-aligned 112x112 faces.

Face sets distributed for ArcFace (insightface's RecordIO training sets and ``.bin`` verification
sets) hold faces already aligned onto :data:`models.align.ARCFACE_TEMPLATE_112x112`; the photos and
their landmarks are gone. A model of another template gets its crop from the aligned face:

* a template whose points are those of the ArcFace template shifted by whole pixels (the
  SphereFace 112x96 template is the ArcFace one 8 px to the left, so its crop is columns 8 to 103)
  gets exactly those pixels, the very crop :func:`models.align.align_face` would have cut from the
  photo with the same landmarks;
* any other template is re-warped by the least-squares similarity from the ArcFace points onto its
  points (:func:`models.align.similarity_transform`, bilinear, as every crop is made). The face's
  own landmarks in the aligned image are unknown, so the ArcFace points stand for them; where the
  template's crop reaches beyond the 112x112 face its pixels are black (0), the padding
  :func:`padding_share` states.
"""

from __future__ import annotations

import numpy as np

from models.align import AlignmentTemplate, ARCFACE_TEMPLATE_112x112, similarity_transform, warp_affine

#: Height and width of an ArcFace-aligned face.
ARCFACE_SIZE = (ARCFACE_TEMPLATE_112x112.height, ARCFACE_TEMPLATE_112x112.width)


def arcface_to_template(template: AlignmentTemplate) -> np.ndarray:
    """The ``(2, 3)`` similarity taking ArcFace-crop pixel coordinates to ``template``'s crop."""
    return similarity_transform(ARCFACE_TEMPLATE_112x112.as_array(), template.as_array())


def whole_pixel_shift(template: AlignmentTemplate) -> tuple[int, int] | None:
    """``(dx, dy)`` when ``template``'s points are the ArcFace points moved by whole pixels
    (``template = arcface + (dx, dy)``) and its crop lies inside the ArcFace crop; else None."""
    offset = template.as_array() - ARCFACE_TEMPLATE_112x112.as_array()
    dx, dy = np.rint(offset[0])
    if not np.allclose(offset, (dx, dy), atol=1e-9):
        return None
    top, left = -int(dy), -int(dx)
    height, width = ARCFACE_SIZE
    if top < 0 or left < 0 or top + template.height > height or left + template.width > width:
        return None
    return int(dx), int(dy)


def crop_from_arcface(faces: np.ndarray, template: AlignmentTemplate) -> np.ndarray:
    """``template``'s crops of ArcFace-aligned faces.

    Args:
        faces: ``(N, 112, 112, 3)`` (or one ``(112, 112, 3)``) uint8 RGB faces aligned onto the
            ArcFace template.
        template: the crop wanted (e.g. the model's ``manifest.template``).

    Returns:
        ``(N, template.height, template.width, 3)`` uint8 (one crop without the leading axis when
        one face was given); a new array, never a view of ``faces``.
    """
    faces = np.asarray(faces)
    single = faces.ndim == 3
    batch = faces[None] if single else faces
    if batch.ndim != 4 or batch.shape[1:3] != ARCFACE_SIZE:
        raise ValueError(f"faces must be (N, 112, 112, C) ArcFace-aligned crops, got {faces.shape}")
    shift = whole_pixel_shift(template)
    if shift is not None:
        top, left = -shift[1], -shift[0]
        out = batch[:, top : top + template.height, left : left + template.width].copy()
    else:
        matrix = arcface_to_template(template)
        out = np.stack([warp_affine(face, matrix, template.height, template.width) for face in batch])
    return out[0] if single else out


def padding_share(template: AlignmentTemplate) -> float:
    """The share (0 to 1) of ``template``'s crop that lies outside the ArcFace 112x112 face, and so
    is black in :func:`crop_from_arcface` (pixel centres mapped back into the ArcFace crop)."""
    if whole_pixel_shift(template) is not None:
        return 0.0
    inverse = np.linalg.inv(np.vstack([arcface_to_template(template), [0.0, 0.0, 1.0]]))[:2]
    ys, xs = np.mgrid[0 : template.height, 0 : template.width].astype(np.float64)
    src_x = inverse[0, 0] * xs + inverse[0, 1] * ys + inverse[0, 2]
    src_y = inverse[1, 0] * xs + inverse[1, 1] * ys + inverse[1, 2]
    height, width = ARCFACE_SIZE
    outside = (src_x < -0.5) | (src_x > width - 0.5) | (src_y < -0.5) | (src_y > height - 0.5)
    return float(outside.mean())
