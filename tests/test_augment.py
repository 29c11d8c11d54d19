"""Training augmentation (training/augment.py): each transform does what its option says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.augment import ERASE_AREA, AugmentOptions, BatchAugment, to_network_input
from training.config import ConfigError, load_config

H, W = 112, 96


def _faces(n: int = 8, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, size=(n, H, W, 3), dtype=np.uint8))


def _dot(row: int, col: int, n: int = 1) -> torch.Tensor:
    """Black crops with one white 3x3 dot centred on (row, col)."""
    images = torch.zeros((n, H, W, 3), dtype=torch.uint8)
    images[:, row - 1 : row + 2, col - 1 : col + 2] = 255
    return images


def _centroid(x: torch.Tensor) -> tuple[float, float]:
    """Brightness-weighted (row, col) of a normalised ``(3, H, W)`` image."""
    weight = (x.mean(0) * 128 + 127.5).clamp(min=0)
    rows = torch.arange(H, dtype=torch.float32)[:, None]
    cols = torch.arange(W, dtype=torch.float32)[None, :]
    total = weight.sum()
    return float((weight * rows).sum() / total), float((weight * cols).sum() / total)


def _augment(options: dict, flip: bool = False, seed: int = 0) -> BatchAugment:
    return BatchAugment(torch.device("cpu"), flip, seed, 0, AugmentOptions.from_options(options))


def test_with_every_option_off_the_batches_are_the_flip_only_loaders_bit_for_bit():
    images = _faces(16)
    augment = BatchAugment(torch.device("cpu"), True, seed=7, rank=1)
    generator = torch.Generator().manual_seed(7 * 1000 + 1)
    for _ in range(3):
        mask = torch.rand(16, generator=generator) < 0.5
        assert torch.equal(augment(images), to_network_input(images, mask))


def test_a_moved_crop_with_no_movement_is_the_crop_and_its_mirror():
    images = _faces(32)
    # shift drawn in [-1e-6, 1e-6] of the width: the affine path with an identity map.
    augment = _augment({"shift": 1e-6}, flip=True, seed=3)
    generator = torch.Generator().manual_seed(3000)
    mask = torch.rand(32, generator=generator) < 0.5
    assert 0 < int(mask.sum()) < 32
    torch.testing.assert_close(augment(images), to_network_input(images, mask), atol=1e-3, rtol=0)


def test_shift_moves_the_face_by_at_most_the_fraction_it_names():
    augment = _augment({"shift": 0.1})
    out = augment(_dot(56, 48, n=64))
    moves = np.array([_centroid(x) for x in out]) - np.array([56.0, 48.0])
    assert np.abs(moves[:, 0]).max() <= 0.1 * H + 0.5
    assert np.abs(moves[:, 1]).max() <= 0.1 * W + 0.5
    # drawn uniformly: some move far, in both directions
    assert moves[:, 1].max() > 0.06 * W and moves[:, 1].min() < -0.06 * W
    assert moves[:, 0].max() > 0.06 * H and moves[:, 0].min() < -0.06 * H


def test_rotation_keeps_pixel_distances_on_the_non_square_crop():
    # A dot 24 px right of the centre: rotated by up to 90 degrees it stays 24 px from the centre,
    # in pixels (a rotation in the crop's [-1, 1] coordinates would stretch it by 112/96).
    augment = _augment({"rotate": 90})
    centre_row, centre_col = (H - 1) / 2, (W - 1) / 2
    out = augment(_dot(56, 72, n=48))
    angles = []
    for x in out:
        row, col = _centroid(x)
        assert math.hypot(row - centre_row, col - centre_col) == pytest.approx(
            math.hypot(56 - centre_row, 72 - centre_col), abs=0.6
        )
        angles.append(math.degrees(math.atan2(row - centre_row, col - centre_col)))
    assert max(angles) > 45 and min(angles) < -45


def test_scale_zooms_about_the_centre_within_its_range():
    augment = _augment({"scale": 0.25})
    centre_row, centre_col = (H - 1) / 2, (W - 1) / 2
    before = math.hypot(56 - centre_row, 80 - centre_col)
    ratios = []
    for x in augment(_dot(56, 80, n=48)):
        row, col = _centroid(x)
        ratios.append(math.hypot(row - centre_row, col - centre_col) / before)
    assert min(ratios) >= 1 / 1.25 - 0.02 and max(ratios) <= 1.25 + 0.02
    assert min(ratios) < 0.9 and max(ratios) > 1.1


def test_grayscale_gives_equal_channels_in_the_chosen_share_of_images():
    augment = _augment({"grayscale": 0.5})
    out = augment(_faces(400))
    grey = (out[:, 0] == out[:, 1]).all((1, 2)) & (out[:, 1] == out[:, 2]).all((1, 2))
    assert 0.4 < float(grey.float().mean()) < 0.6
    images = _faces(400)
    weights = torch.tensor([0.299, 0.587, 0.114])
    expected = ((images.float() * weights).sum(-1) - 127.5) / 128
    torch.testing.assert_close(out[grey][:, 0], expected[grey], atol=1e-4, rtol=0)


def test_brightness_contrast_and_saturation_stay_in_range_and_change_the_pixels():
    images = _faces(64)
    plain = to_network_input(images)
    for option in ("brightness", "contrast", "saturation"):
        out = _augment({option: 0.4})(images)
        assert out.min() >= -127.5 / 128 - 1e-6 and out.max() <= 127.5 / 128 + 1e-6
        assert (out - plain).abs().amax((1, 2, 3)).min() > 0  # every image recoloured
    # brightness scales every pixel of an image by one factor in [0.6, 1.4] (before clipping)
    dim = torch.full((4, H, W, 3), 100, dtype=torch.uint8)
    out = _augment({"brightness": 0.4})(dim) * 128 + 127.5
    per_image = out.amax((1, 2, 3))
    assert torch.allclose(out.amin((1, 2, 3)), per_image, atol=1e-3)
    assert ((per_image >= 60 - 1e-3) & (per_image <= 140 + 1e-3)).all()


def test_erasing_fills_one_rectangle_with_mid_grey_in_the_chosen_images():
    images = torch.full((300, H, W, 3), 255, dtype=torch.uint8)
    out = _augment({"erase": 0.5})(images)
    erased = out == 0.0  # 127.5 normalised
    share = erased[:, 0].float().mean((1, 2))
    touched = share > 0
    assert 0.4 < float(touched.float().mean()) < 0.6
    assert share[touched].min() >= ERASE_AREA[0] * 0.5 and share[touched].max() <= ERASE_AREA[1] * 1.1
    for mask in erased[touched][:20, 0]:  # one axis-aligned rectangle: rows x columns
        rows, cols = mask.any(1), mask.any(0)
        assert int(mask.sum()) == int(rows.sum()) * int(cols.sum())
    assert (out[~touched] == 127.5 / 128).all()


def test_the_same_seed_draws_the_same_batches_and_another_seed_others():
    options = {"shift": 0.05, "rotate": 5, "brightness": 0.2, "grayscale": 0.2, "erase": 0.3}
    images = _faces(8)
    a, b, c = _augment(options, True, 1), _augment(options, True, 1), _augment(options, True, 2)
    for _ in range(2):
        x, y, z = a(images), b(images), c(images)
        assert torch.equal(x, y) and not torch.equal(x, z)


def test_a_config_checks_its_augment_table():
    config = load_config(None, ["augment={ shift = 0.04, rotate = 5 }", "augment.grayscale=0.1"])
    assert config.augment_options() == AugmentOptions(shift=0.04, rotate=5.0, grayscale=0.1)
    assert config.augment_options().as_dict() == {"shift": 0.04, "rotate": 5.0, "grayscale": 0.1}
    with pytest.raises(ConfigError, match="unknown augment options \\['shfit'\\]"):
        load_config(None, ["augment={ shfit = 0.04 }"])
    with pytest.raises(ConfigError, match="grayscale = 1.5 is outside"):
        load_config(None, ["augment.grayscale=1.5"])
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(None, ["augment.erase=true"])
