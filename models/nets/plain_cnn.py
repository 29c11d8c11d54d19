"""The plain CNN-N of SphereNet's CIFAR experiments (SphereNet §4.1, thesis Table B.1), width-scalable.

Layout for a ``(N, 3, 32, 32)`` input, ``n`` convolutions per stage (CNN-3/9/18/45/60/69 have
n = 1/3/6/15/20/23; the name counts the convolutions), widths ``(64, 96, 128)`` in the paper::

    stage 1   n x [3x3 conv w1, BN, ReLU], 2x2 max-pool      (N, w1, 16, 16)
    stage 2   n x [3x3 conv w2, BN, ReLU], 2x2 max-pool      (N, w2, 8, 8)
    stage 3   n x [3x3 conv w3, BN, ReLU], 2x2 max-pool      (N, w3, 4, 4)
    fc        Linear w3*4*4 -> embedding_size (256)          (N, 256) features for the loss head

BatchNorm and ReLU can be switched off (SphereNet Table 3 trains without ReLU; Fig. 3(d) and the
SphereNorm experiment vary the normalisation). The convolutions are ordinary ``nn.Conv2d`` with a
bias; :func:`models.nets.hyperspherical.convert_to_hyperspherical` turns them into SphereConv or a
decoupled operator. The features have no activation, as SphereFace's FC1 (thesis Table 2.7).
"""

from __future__ import annotations

import torch
from torch import nn

#: Convolutions per stage of the paper's CNN-N (Table B.1), keyed by N.
CNN_STAGE_CONVS: dict[int, int] = {3: 1, 9: 3, 18: 6, 45: 15, 60: 20, 69: 23}


class PlainCNN(nn.Module):
    """CNN-``3n``: three stages of ``n`` 3x3 convolutions, no shortcut; ``(N, 3, 32, 32)`` -> features."""

    def __init__(
        self,
        convs_per_stage: int = 3,
        widths: tuple[int, int, int] = (64, 96, 128),
        embedding_size: int = 256,
        batch_norm: bool = True,
        relu: bool = True,
    ) -> None:
        super().__init__()
        if convs_per_stage < 1:
            raise ValueError("convs_per_stage must be at least 1")
        if len(widths) != 3 or min(widths) < 1:
            raise ValueError(f"widths must be three positive channel counts, got {widths}")
        self.embedding_size = embedding_size
        layers: list[nn.Module] = []
        in_channels = 3
        for width in widths:
            for _ in range(convs_per_stage):
                layers.append(nn.Conv2d(in_channels, width, 3, padding=1, bias=not batch_norm))
                if batch_norm:
                    layers.append(nn.BatchNorm2d(width))
                if relu:
                    layers.append(nn.ReLU(inplace=True))
                in_channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(widths[-1] * 4 * 4, embedding_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, 3, 32, 32)`` normalised RGB -> ``(N, embedding_size)`` features."""
        return self.fc(torch.flatten(self.features(x), 1))
