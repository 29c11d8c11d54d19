"""Weight initialisation as the authors' Caffe nets do it.

Caffe's ``xavier`` filler (``variance_norm: FAN_IN``, its default) draws from
``U(-sqrt(3 / fan_in), +sqrt(3 / fan_in))``: variance ``1 / fan_in``. PyTorch's
``xavier_uniform_`` uses ``sqrt(6 / (fan_in + fan_out))`` instead, which for SphereFace's
10,572-class classifier (fan_in 512) gives rows of norm ≈ 0.30 instead of ≈ 1.0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


@torch.no_grad()
def caffe_xavier_uniform_(weight: Tensor) -> Tensor:
    """Fill ``weight`` (out, in, *kernel) in place from ``U(±sqrt(3 / fan_in))``; returns it.

    ``fan_in`` is ``in * prod(kernel)`` (Caffe: ``count / num``). A (C, D) classifier then has
    rows of expected squared norm ``D * (3 / D) / 3 = 1``.
    """
    if weight.ndim < 2:
        raise ValueError(f"caffe_xavier_uniform_ needs 2+ dimensions, got shape {tuple(weight.shape)}")
    fan_in = weight[0].numel()
    bound = math.sqrt(3.0 / fan_in)
    return weight.uniform_(-bound, bound)
