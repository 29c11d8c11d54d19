"""SphereFace-4/10/20/36/64 residual CNNs (Liu et al., 2017, Table 2.7) for 112x96 faces.

Layout for a ``(N, 3, 112, 96)`` input (``C`` channels, ``n`` residual units per stage)::

    stages.0   3x3/2 conv 3->64,    PReLU, n x residual unit    (N, 64, 56, 48)
    stages.1   3x3/2 conv 64->128,  PReLU, n x residual unit    (N, 128, 28, 24)
    stages.2   3x3/2 conv 128->256, PReLU, n x residual unit    (N, 256, 14, 12)
    stages.3   3x3/2 conv 256->512, PReLU, n x residual unit    (N, 512, 7, 6)
    fc1        Linear 512*7*6=21504 -> embedding_size           (N, embedding_size)

A residual unit is ``x + prelu2(conv2(prelu1(conv1(x))))`` with two 3x3/1 convolutions of ``C``
filters and an identity shortcut. There is no BatchNorm and no activation after ``fc1``; every
PReLU has one slope per channel. Initialisation follows the authors' Caffe prototxt: the
stage-opening convolutions and ``fc1`` get Xavier-uniform weights and a zero bias, the
convolutions inside residual units Gaussian (std 0.01) weights and no bias.
"""

from __future__ import annotations

import torch
from torch import nn

from models.nets.init import caffe_xavier_uniform_

# Table 2.7: residual units in each of the four stages, keyed by the number of conv layers
# (4 stage-opening convs + 2 per residual unit).
SPHEREFACE_UNITS: dict[int, tuple[int, int, int, int]] = {
    4: (0, 0, 0, 0),
    10: (0, 1, 2, 0),
    20: (1, 2, 4, 1),
    36: (2, 4, 8, 2),
    64: (3, 8, 16, 3),
}

#: Output channels of the four stages (Table 2.7).
SPHEREFACE_CHANNELS: tuple[int, int, int, int] = (64, 128, 256, 512)

#: Spatial size of the last stage's map for a 112x96 input (four stride-2 convs).
FEATURE_MAP_SIZE: tuple[int, int] = (7, 6)

#: Standard deviation of the Gaussian weights of the residual-unit convolutions.
RESIDUAL_INIT_STD = 0.01


class ResidualUnit(nn.Module):
    """Two bias-free 3x3/1 convs, each followed by a PReLU, plus an identity shortcut.

    Submodules: ``conv1``, ``prelu1``, ``conv2``, ``prelu2``.
    ``(N, C, H, W)`` -> ``(N, C, H, W)``.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.prelu1 = nn.PReLU(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.prelu2 = nn.PReLU(channels)
        for conv in (self.conv1, self.conv2):
            nn.init.normal_(conv.weight, mean=0.0, std=RESIDUAL_INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` -> ``(N, C, H, W)``."""
        return x + self.prelu2(self.conv2(self.prelu1(self.conv1(x))))


class SphereFaceStage(nn.Module):
    """One stage: a 3x3/2 conv with bias (down-sampling, channel change), PReLU, residual units.

    Submodules: ``conv``, ``prelu`` and ``units`` (a Sequential of :class:`ResidualUnit`, empty
    when ``num_units`` is 0). ``(N, in_channels, H, W)`` -> ``(N, out_channels, H/2, W/2)``
    (rounded up).
    """

    def __init__(self, in_channels: int, out_channels: int, num_units: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=True)
        self.prelu = nn.PReLU(out_channels)
        self.units = nn.Sequential(*(ResidualUnit(out_channels) for _ in range(num_units)))
        caffe_xavier_uniform_(self.conv.weight)  # Caffe 'xavier': U(±sqrt(3 / fan_in))
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, H, W)`` -> ``(N, out_channels, ceil(H/2), ceil(W/2))``."""
        return self.units(self.prelu(self.conv(x)))


class SphereFaceNet(nn.Module):
    """SphereFace-``depth`` embedding network (``depth`` = number of conv layers: 4/10/20/36/64).

    Input: ``(N, 3, 112, 96)`` float32 RGB crops aligned on the SphereFace template and
    normalised as ``(x - 127.5) / 128``. Output: ``(N, embedding_size)`` raw (not normalised)
    FC1 features; compare them by cosine.
    """

    input_size: tuple[int, int] = (112, 96)

    def __init__(self, depth: int, embedding_size: int = 512) -> None:
        super().__init__()
        if depth not in SPHEREFACE_UNITS:
            allowed = ", ".join(str(d) for d in SPHEREFACE_UNITS)
            raise ValueError(f"unsupported SphereFace depth {depth!r}; allowed depths: {allowed}")
        self.depth = depth
        self.embedding_size = embedding_size
        stages: list[nn.Module] = []
        in_channels = 3
        # Table 2.7: channels and residual units of the four stages.
        for out_channels, num_units in zip(SPHEREFACE_CHANNELS, SPHEREFACE_UNITS[depth], strict=True):
            stages.append(SphereFaceStage(in_channels, out_channels, num_units))
            in_channels = out_channels
        self.stages = nn.Sequential(*stages)
        height, width = FEATURE_MAP_SIZE
        self.fc1 = nn.Linear(in_channels * height * width, embedding_size)
        caffe_xavier_uniform_(self.fc1.weight)
        nn.init.zeros_(self.fc1.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, 3, 112, 96)`` normalised RGB -> ``(N, embedding_size)`` features."""
        x = self.stages(x)  # (N, 512, 7, 6)
        x = torch.flatten(x, 1)  # (N, 21504)
        return self.fc1(x)  # (N, embedding_size), no activation
