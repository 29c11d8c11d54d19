"""Training-time augmentation of aligned face crops, as batched tensor ops on the training device.

The papers train with one augmentation, the horizontal flip. On a small training set (the 13k
faces of celeba_faces + celeba_small) a network fits every face long before it generalises
(docs/results/sphereface-celeba.md), and the usual remedy is to show it a slightly different crop each time.
Each option is off at 0, so a config that sets none of them trains exactly as before:

* ``shift``: translation up to this fraction of the crop's width and height, each axis drawn
  uniformly in ``[-shift, shift]`` (0.04 is about 4 px of the 96x112 crop);
* ``scale``: zoom by a factor drawn log-uniformly in ``[1 / (1 + scale), 1 + scale]``;
* ``rotate``: in-plane rotation, degrees drawn uniformly in ``[-rotate, rotate]``;
* ``brightness``, ``contrast``, ``saturation``: multiply the pixels, their spread around the
  image's mean grey level, or their colour around the pixel's grey level, by a factor drawn
  uniformly in ``[1 - v, 1 + v]``;
* ``grayscale``: probability of replacing the colour by its grey level (ITU-R 601 weights);
* ``erase``: probability of filling one rectangle (2-20% of the crop, aspect 0.5-2) with the
  mean grey 127.5 (random erasing).

The geometric options run as one bilinear ``grid_sample`` per batch (the flip folded into the
same affine map); pixels the moved crop leaves uncovered repeat the crop's border. Every draw
comes from one seeded generator, in a fixed order, so a resumed run draws exactly what an
uninterrupted one does (its state is checkpointed as the flip generator's was).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

PIXEL_MEAN = 127.5
PIXEL_STD = 128.0


def to_network_input(batch: torch.Tensor, flip_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H, W, 3)`` uint8 RGB -> ``(B, 3, H, W)`` float32 ``(x - 127.5) / 128``, on its device.

    ``flip_mask`` ``(B,)`` bool mirrors the chosen images horizontally. The result is laid out
    channels-last (the permute of the NHWC input), which is what cuDNN's fastest kernels read.
    """
    x = batch.permute(0, 3, 1, 2).float()
    if flip_mask is not None:
        x = torch.where(flip_mask[:, None, None, None], x.flip(3), x)
    return x.sub_(PIXEL_MEAN).div_(PIXEL_STD)


#: Grey level of an RGB pixel (ITU-R BT.601 luma weights).
GREY_WEIGHTS = (0.299, 0.587, 0.114)
#: Fill of erased rectangles: 127.5 is 0 after the network's normalisation.
ERASE_FILL = 127.5
ERASE_AREA = (0.02, 0.2)
ERASE_ASPECT = (0.5, 2.0)


@dataclass(frozen=True)
class AugmentOptions:
    """What :class:`BatchAugment` does besides the flip (every option off at 0)."""

    shift: float = 0.0
    scale: float = 0.0
    rotate: float = 0.0
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    grayscale: float = 0.0
    erase: float = 0.0

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> AugmentOptions:
        """Checked options of a config's ``augment`` table (ValueError names the bad key)."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown augment options {unknown}; known: {sorted(known)}")
        values = {}
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"augment option {key} must be a number, not {value!r}")
            values[key] = float(value)
        made = cls(**values)
        made._check()
        return made

    def _check(self) -> None:
        limits = {
            "shift": (0.0, 0.5),
            "scale": (0.0, 1.0),
            "rotate": (0.0, 180.0),
            "brightness": (0.0, 1.0),
            "contrast": (0.0, 1.0),
            "saturation": (0.0, 1.0),
            "grayscale": (0.0, 1.0),
            "erase": (0.0, 1.0),
        }
        for key, (low, high) in limits.items():
            value = getattr(self, key)
            if not low <= value <= high:
                raise ValueError(f"augment option {key} = {value} is outside [{low}, {high}]")

    @property
    def geometric(self) -> bool:
        return bool(self.shift or self.scale or self.rotate)

    @property
    def photometric(self) -> bool:
        return bool(self.brightness or self.contrast or self.saturation or self.grayscale)

    def as_dict(self) -> dict[str, float]:
        """The options that are on (what a config's ``augment`` table holds)."""
        return {k: v for k, v in asdict(self).items() if v}


def affine_matrices(
    flip: torch.Tensor, shift: torch.Tensor, zoom: torch.Tensor, angle: torch.Tensor, aspect: float
) -> torch.Tensor:
    """``(B, 2, 3)`` maps from output to input coordinates, for ``F.affine_grid`` (normalised
    coordinates in [-1, 1], ``align_corners=False``).

    The output shows the input mirrored when ``flip`` (bool ``(B,)``), zoomed by ``zoom`` (> 1
    enlarges the face), rotated by ``angle`` radians and moved by ``shift`` ``(B, 2)`` (fractions
    of the width and height). ``aspect`` is the crop's height / width: rotation happens in pixels,
    not in the non-square normalised coordinates.
    """
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    mirror = torch.where(flip, -1.0, 1.0).to(cos.dtype)
    theta = torch.zeros((len(flip), 2, 3), dtype=cos.dtype, device=cos.device)
    # output (u, v) in pixels-proportional units -> input: mirror(R(angle)^-1 (p - t) / zoom)
    theta[:, 0, 0] = mirror * cos
    theta[:, 0, 1] = mirror * sin * aspect
    theta[:, 1, 0] = -sin / aspect
    theta[:, 1, 1] = cos
    tx, ty = -2.0 * shift[:, 0], -2.0 * shift[:, 1]
    theta[:, 0, 2] = theta[:, 0, 0] * tx + theta[:, 0, 1] * ty
    theta[:, 1, 2] = theta[:, 1, 0] * tx + theta[:, 1, 1] * ty
    return theta


class BatchAugment:
    """uint8 NHWC batch on the device -> augmented network input ``(B, 3, H, W)``.

    The flip mask is drawn first, as the flip-only loader always drew it, so with every option
    off the batches are bit-identical to that loader's. Seeded per process (``seed * 1000 +
    rank``) so ranks augment independently and runs repeat.
    """

    def __init__(
        self,
        device: torch.device,
        flip: bool,
        seed: int,
        rank: int,
        options: AugmentOptions | None = None,
    ) -> None:
        self.device = device
        self.flip = flip
        self.options = options or AugmentOptions()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed * 1000 + rank)

    def _uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, device=self.device, generator=self.generator)

    def _symmetric(self, n: int, half_width: float) -> torch.Tensor:
        return self._uniform(n, -half_width, half_width)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n = len(images)
        flip = torch.zeros(n, dtype=torch.bool, device=self.device)
        if self.flip:
            flip = torch.rand(n, device=self.device, generator=self.generator) < 0.5
        opts = self.options
        if not (opts.geometric or opts.photometric or opts.erase):
            return to_network_input(images, flip if self.flip else None)
        x = images.permute(0, 3, 1, 2).float()
        if opts.geometric:
            x = self._move(x, flip)
        elif self.flip:
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        if opts.photometric:
            x = self._recolour(x)
        if opts.erase:
            x = self._erase(x)
        return x.sub_(PIXEL_MEAN).div_(PIXEL_STD)

    def _move(self, x: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        n, _, height, width = x.shape
        opts = self.options
        shift = torch.stack([self._symmetric(n, opts.shift), self._symmetric(n, opts.shift)], dim=1)
        log_zoom = self._symmetric(n, math.log1p(opts.scale))
        angle = self._symmetric(n, math.radians(opts.rotate))
        theta = affine_matrices(flip, shift, log_zoom.exp(), angle, height / width)
        grid = F.affine_grid(theta, [n, 3, height, width], align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def _recolour(self, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        opts = self.options
        weights = torch.tensor(GREY_WEIGHTS, device=x.device).view(1, 3, 1, 1)
        if opts.brightness:
            x = x * self._uniform(n, 1 - opts.brightness, 1 + opts.brightness).view(n, 1, 1, 1)
        if opts.contrast:
            mean = (x * weights).sum(1, keepdim=True).mean((2, 3), keepdim=True)
            factor = self._uniform(n, 1 - opts.contrast, 1 + opts.contrast).view(n, 1, 1, 1)
            x = mean + factor * (x - mean)
        if opts.saturation:
            grey = (x * weights).sum(1, keepdim=True)
            factor = self._uniform(n, 1 - opts.saturation, 1 + opts.saturation).view(n, 1, 1, 1)
            x = grey + factor * (x - grey)
        if opts.grayscale:
            to_grey = torch.rand(n, device=self.device, generator=self.generator) < opts.grayscale
            grey = (x * weights).sum(1, keepdim=True).expand_as(x)
            x = torch.where(to_grey.view(n, 1, 1, 1), grey, x)
        return x.clamp_(0.0, 255.0)

    def _erase(self, x: torch.Tensor) -> torch.Tensor:
        """One rectangle per chosen image, filled with mid-grey (random erasing)."""
        n, _, height, width = x.shape
        chosen = torch.rand(n, device=self.device, generator=self.generator) < self.options.erase
        area = self._uniform(n, *ERASE_AREA) * height * width
        aspect = torch.exp(self._uniform(n, math.log(ERASE_ASPECT[0]), math.log(ERASE_ASPECT[1])))
        box_h = (area * aspect).sqrt().clamp(max=height)
        box_w = (area / aspect).sqrt().clamp(max=width)
        top = self._uniform(n, 0.0, 1.0) * (height - box_h)
        left = self._uniform(n, 0.0, 1.0) * (width - box_w)
        rows = torch.arange(height, device=x.device, dtype=x.dtype).view(1, height, 1)
        cols = torch.arange(width, device=x.device, dtype=x.dtype).view(1, 1, width)
        inside = (
            (rows >= top.view(n, 1, 1))
            & (rows < (top + box_h).view(n, 1, 1))
            & (cols >= left.view(n, 1, 1))
            & (cols < (left + box_w).view(n, 1, 1))
            & chosen.view(n, 1, 1)
        )
        return x.masked_fill_(inside.unsqueeze(1), ERASE_FILL)
