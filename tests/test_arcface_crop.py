"""Crops of other templates cut from ArcFace-aligned faces (models.arcface_crop)."""

from __future__ import annotations

import numpy as np
import pytest

from models.align import (
    AlignmentTemplate,
    ARCFACE_TEMPLATE_112x112,
    DLIB_TEMPLATE_150x150,
    SPHEREFACE_TEMPLATE_112x96,
    align_face,
)
from models.arcface_crop import crop_from_arcface, padding_share, whole_pixel_shift


def _photo_and_points(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    photo = rng.integers(0, 256, size=(250, 250, 3), dtype=np.uint8)
    points = SPHEREFACE_TEMPLATE_112x96.as_array() * 1.3 + [60.0, 40.0] + rng.normal(0, 1.5, (5, 2))
    return photo, points


def test_sphereface_crop_is_columns_8_to_103_and_the_photo_crop() -> None:
    photo, points = _photo_and_points()
    face = align_face(photo, points, ARCFACE_TEMPLATE_112x112)
    crop = crop_from_arcface(face, SPHEREFACE_TEMPLATE_112x96)
    assert whole_pixel_shift(SPHEREFACE_TEMPLATE_112x96) == (-8, 0)
    np.testing.assert_array_equal(crop, face[:, 8:104])
    # the same pixels the photo would have given with the same landmarks
    np.testing.assert_array_equal(crop, align_face(photo, points, SPHEREFACE_TEMPLATE_112x96))
    assert padding_share(SPHEREFACE_TEMPLATE_112x96) == 0.0


def test_arcface_template_is_the_face_itself_and_a_copy() -> None:
    faces = np.random.default_rng(1).integers(0, 256, size=(2, 112, 112, 3), dtype=np.uint8)
    crops = crop_from_arcface(faces, ARCFACE_TEMPLATE_112x112)
    np.testing.assert_array_equal(crops, faces)
    crops[0, 0, 0, 0] ^= 1
    assert crops[0, 0, 0, 0] != faces[0, 0, 0, 0]


def test_other_templates_are_rewarped_close_to_the_photo_crop() -> None:
    # a smooth photo, so a re-warp and a direct warp differ only by interpolation
    ys, xs = np.mgrid[0:250, 0:250]
    photo = np.stack([xs, ys, (xs + ys) // 2], axis=-1).astype(np.uint8)
    points = ARCFACE_TEMPLATE_112x112.as_array() + [70.0, 60.0]
    face = align_face(photo, points, ARCFACE_TEMPLATE_112x112)
    crop = crop_from_arcface(face, DLIB_TEMPLATE_150x150)
    direct = align_face(photo, points, DLIB_TEMPLATE_150x150)
    assert crop.shape == (150, 150, 3)
    # dlib's chip reaches about 10 px below the ArcFace face (the chin): black there, the same
    # pixels as the photo's crop (up to interpolation) everywhere else
    inside = crop.any(axis=-1)
    assert 0.85 < inside.mean() < 0.92
    assert padding_share(DLIB_TEMPLATE_150x150) == pytest.approx(1 - inside.mean(), abs=0.01)
    core = inside[2:-2, 2:-2] & inside[4:, 2:-2] & inside[:-4, 2:-2]  # off the border's blend
    diff = np.abs(crop[2:-2, 2:-2].astype(int) - direct[2:-2, 2:-2].astype(int))
    assert diff[core].max() <= 2


def test_padding_share_counts_the_black_border() -> None:
    # a template twice as wide around the same points: the ArcFace face fills its middle only
    wide = AlignmentTemplate(
        "wide", 112, 224, tuple((x + 56.0, y) for x, y in ARCFACE_TEMPLATE_112x112.points)
    )
    assert whole_pixel_shift(wide) is None
    assert padding_share(wide) == pytest.approx(0.5, abs=0.01)
    crop = crop_from_arcface(np.full((112, 112, 3), 200, np.uint8), wide)
    assert crop[:, :50].max() == 0 and crop[:, 60:160].min() == 200


def test_refuses_faces_that_are_not_112x112() -> None:
    with pytest.raises(ValueError, match="112"):
        crop_from_arcface(np.zeros((1, 112, 96, 3), np.uint8), SPHEREFACE_TEMPLATE_112x96)
