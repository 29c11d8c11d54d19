"""The similarity transform and the warp: exact on synthetic points and images."""

import numpy as np
import pytest

from models.align import (
    ARCFACE_TEMPLATE_112x112,
    SPHEREFACE_TEMPLATE_112x96,
    align_face,
    align_faces,
    get_template,
    similarity_transform,
    warp_affine,
)


def _similarity(scale: float, angle: float, shift: tuple[float, float]) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[scale * c, -scale * s, shift[0]], [scale * s, scale * c, shift[1]]])


def _apply(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points @ matrix[:, :2].T + matrix[:, 2]


@pytest.mark.parametrize(
    "scale,angle,shift", [(1.0, 0.0, (0, 0)), (2.5, 0.4, (13, -7)), (0.3, -2.9, (100, 250))]
)
def test_similarity_transform_recovers_an_exact_similarity(scale, angle, shift):
    truth = _similarity(scale, angle, shift)
    src = np.random.default_rng(0).uniform(-50, 300, size=(5, 2))
    estimated = similarity_transform(src, _apply(truth, src))
    np.testing.assert_allclose(estimated, truth, atol=1e-9)


def test_similarity_transform_maps_points_onto_the_template_exactly_when_they_are_similar():
    template = SPHEREFACE_TEMPLATE_112x96.as_array()
    photo_points = _apply(np.linalg.inv(np.vstack([_similarity(0.4, 0.2, (-5, 3)), [0, 0, 1]]))[:2], template)
    matrix = similarity_transform(photo_points, template)
    np.testing.assert_allclose(_apply(matrix, photo_points), template, atol=1e-9)


def test_similarity_transform_is_least_squares_for_noisy_points():
    rng = np.random.default_rng(1)
    src = rng.uniform(0, 100, size=(5, 2))
    dst = _apply(_similarity(1.3, 0.5, (4, 9)), src) + rng.normal(0, 1.0, size=(5, 2))
    best = similarity_transform(src, dst)
    residual = np.sum((_apply(best, src) - dst) ** 2)
    for _ in range(50):  # no nearby similarity fits better
        a, b = best[0, 0] + rng.normal(0, 1e-3), best[1, 0] + rng.normal(0, 1e-3)
        other = np.array([[a, -b, best[0, 2]], [b, a, best[1, 2]]])
        assert np.sum((_apply(other, src) - dst) ** 2) >= residual


def test_similarity_transform_rejects_mismatched_point_sets():
    with pytest.raises(ValueError, match="point arrays"):
        similarity_transform(np.zeros((5, 2)), np.zeros((4, 2)))


def test_warp_with_identity_returns_the_image():
    image = np.random.default_rng(2).integers(0, 256, size=(40, 30, 3), dtype=np.uint8)
    out = warp_affine(image, np.array([[1.0, 0, 0], [0, 1.0, 0]]), 40, 30)
    np.testing.assert_array_equal(out, image)


def test_warp_with_integer_shift_moves_pixels_and_fills_black():
    image = np.random.default_rng(3).integers(1, 256, size=(20, 20, 3), dtype=np.uint8)
    out = warp_affine(image, np.array([[1.0, 0, 5], [0, 1.0, -3]]), 20, 20)
    np.testing.assert_array_equal(out[0:17, 5:20], image[3:20, 0:15])
    assert not out[:, :5].any() and not out[17:].any()


def test_warp_interpolates_bilinearly_between_pixels():
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    image[:, 2] = 200  # a vertical stripe at x = 2
    out = warp_affine(image, np.array([[1.0, 0, -0.5], [0, 1.0, 0]]), 4, 4)
    # Output x = 1.5 - 0.5 -> samples source x = 1.5 and 2.5: half of the stripe each.
    assert out[1, 1, 0] == 100 and out[1, 2, 0] == 100


def test_align_face_puts_the_landmarks_on_the_template():
    # A synthetic face: five bright dots at similar-transformed template positions.
    template = SPHEREFACE_TEMPLATE_112x96
    photo_from_crop = _similarity(2.0, 0.3, (60, 40))
    landmarks = _apply(photo_from_crop, template.as_array())
    image = np.zeros((400, 400, 3), dtype=np.uint8)
    for x, y in np.rint(landmarks).astype(int):
        image[y - 3 : y + 4, x - 3 : x + 4] = 255
    crop = align_face(image, landmarks)
    assert crop.shape == (112, 96, 3)
    for x, y in template.as_array():
        assert crop[int(round(y)), int(round(x))].min() == 255


def test_align_faces_batches_one_crop_per_face():
    image = np.full((200, 200, 3), 128, dtype=np.uint8)
    marks = np.stack([SPHEREFACE_TEMPLATE_112x96.as_array() + d for d in (0, 50)])
    crops = align_faces(image, marks, ARCFACE_TEMPLATE_112x112)
    assert crops.shape == (2, 112, 112, 3)


def test_arcface_template_is_the_sphereface_template_shifted_8px():
    shift = ARCFACE_TEMPLATE_112x112.as_array() - SPHEREFACE_TEMPLATE_112x96.as_array()
    np.testing.assert_allclose(shift, [[8, 0]] * 5)
    assert get_template("arcface_112x112") is ARCFACE_TEMPLATE_112x112
    with pytest.raises(ValueError, match="unknown alignment template"):
        get_template("nope")


def _bilinear_reference(image: np.ndarray, matrix: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear warp one crop pixel at a time: outside pixels read 0 (float64, then rounded)."""
    inverse = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]
    h, w = image.shape[:2]

    def pixel(y: int, x: int) -> np.ndarray:
        return image[y, x].astype(np.float64) if 0 <= y < h and 0 <= x < w else np.zeros(image.shape[2])

    out = np.zeros((height, width, image.shape[2]))
    for v in range(height):
        for u in range(width):
            sx, sy = inverse @ np.array([u, v, 1.0])
            x0, y0 = int(np.floor(sx)), int(np.floor(sy))
            fx, fy = sx - x0, sy - y0
            top = pixel(y0, x0) * (1 - fx) + pixel(y0, x0 + 1) * fx
            bottom = pixel(y0 + 1, x0) * (1 - fx) + pixel(y0 + 1, x0 + 1) * fx
            out[v, u] = top * (1 - fy) + bottom * fy
    return out


def test_warp_reads_only_the_window_it_needs_and_matches_a_pixel_by_pixel_warp():
    """Crops inside a large photo, across its border and wholly outside it: the windowed warp
    gives a per-pixel bilinear warp's values (float32 against float64: within one grey level)."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    for scale, angle, shift in [(0.5, 0.3, (-20, -30)), (2.0, -1.0, (10, 350)), (1.0, 0.0, (-500, -500))]:
        c, s = scale * np.cos(angle), scale * np.sin(angle)
        matrix = np.array([[c, -s, shift[0]], [s, c, shift[1]]])
        got = warp_affine(image, matrix, 28, 24).astype(int)
        want = _bilinear_reference(image, matrix, 28, 24)
        assert np.abs(got - want).max() <= 1
        assert np.mean(got == np.rint(want)) > 0.99
    assert not warp_affine(image, np.array([[1.0, 0, -1000], [0, 1.0, -1000]]), 8, 8).any()
