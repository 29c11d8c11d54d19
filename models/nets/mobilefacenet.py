"""MobileFaceNet (Chen et al., 2018) for 112x96 SphereFace-aligned faces.

Our own definition, laid out so that the state dict of the externally trained CASIA-WebFace
model (``reference_models/mobilefacenet_casia/068.ckpt``, see ../shared/data/README.md) loads
with ``strict=True``. Parameter prefixes::

    conv1       3x3/2 conv 3->64, BN, PReLU               (N, 64, 56, 48)
    dw_conv1    3x3 depthwise conv 64, BN, PReLU          (N, 64, 56, 48)
    blocks.0-14 inverted-residual bottlenecks             (N, 128, 7, 6)
    conv2       1x1 conv 128->512, BN, PReLU              (N, 512, 7, 6)
    linear7     7x6 depthwise conv 512 (global), BN       (N, 512, 1, 1)
    linear1     1x1 conv 512->128, BN                     (N, 128, 1, 1)

Every convolution is bias-free; every PReLU has one slope per channel.
"""

from __future__ import annotations

import torch
from torch import nn

#: Bottleneck stages: (expansion t, output channels c, repeats n, stride of the first repeat s).
MOBILEFACENET_STAGES: tuple[tuple[int, int, int, int], ...] = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)


class ConvBNAct(nn.Module):
    """Bias-free conv, BatchNorm and (optionally) a per-channel PReLU.

    Submodules are named ``conv``, ``bn`` and ``prelu`` (absent when ``activation`` is False),
    matching the checkpoint's ``conv1``/``dw_conv1``/``conv2``/``linear7``/``linear1`` prefixes.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        activation: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, groups=groups, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels)
        self.prelu: nn.Module | None = nn.PReLU(out_channels) if activation else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, H, W)`` -> ``(N, out_channels, H', W')``."""
        x = self.bn(self.conv(x))
        if self.prelu is not None:
            x = self.prelu(x)
        return x


class InvertedResidual(nn.Module):
    """MobileNetV2 bottleneck: 1x1 expand, 3x3 depthwise (stride ``s``), 1x1 linear projection.

    ``conv`` is a Sequential of 8 modules (``conv.0`` .. ``conv.7``): conv, BN, PReLU,
    depthwise conv, BN, PReLU, conv, BN. The input is added back when the stride is 1 and the
    channel count does not change.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        self.residual = stride == 1 and in_channels == out_channels
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.PReLU(hidden),
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.PReLU(hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, H, W)`` -> ``(N, out_channels, H / stride, W / stride)``."""
        out = self.conv(x)
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """MobileFaceNet embedding network.

    Input: ``(N, 3, 112, 96)`` float32 RGB crops aligned on the SphereFace template and
    normalised as ``(x - 127.5) / 128``. Output: ``(N, embedding_size)`` raw (not normalised)
    embeddings; compare them by cosine.
    """

    input_size: tuple[int, int] = (112, 96)

    def __init__(self, embedding_size: int = 128) -> None:
        super().__init__()
        self.embedding_size = embedding_size
        self.conv1 = ConvBNAct(3, 64, 3, stride=2, padding=1)
        self.dw_conv1 = ConvBNAct(64, 64, 3, padding=1, groups=64)
        blocks: list[nn.Module] = []
        channels = 64
        for expansion, out_channels, repeats, first_stride in MOBILEFACENET_STAGES:
            for i in range(repeats):
                stride = first_stride if i == 0 else 1
                blocks.append(InvertedResidual(channels, out_channels, stride, expansion))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.conv2 = ConvBNAct(channels, 512, 1)
        # After three stride-2 stages and conv1, a 112x96 input is a 7x6 map: this depthwise
        # conv is the learned global pooling ("global depthwise convolution" of the paper).
        self.linear7 = ConvBNAct(512, 512, (7, 6), groups=512, activation=False)
        self.linear1 = ConvBNAct(512, embedding_size, 1, activation=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, 3, 112, 96)`` normalised RGB -> ``(N, embedding_size)`` embeddings."""
        x = self.conv1(x)  # (N, 64, 56, 48)
        x = self.dw_conv1(x)  # (N, 64, 56, 48)
        x = self.blocks(x)  # (N, 128, 7, 6)
        x = self.conv2(x)  # (N, 512, 7, 6)
        x = self.linear7(x)  # (N, 512, 1, 1)
        x = self.linear1(x)  # (N, embedding_size, 1, 1)
        return torch.flatten(x, 1)


def load_mobilefacenet(state_dict: dict[str, torch.Tensor], embedding_size: int = 128) -> MobileFaceNet:
    """Build a :class:`MobileFaceNet`, load ``state_dict`` strictly and put it in eval mode."""
    net = MobileFaceNet(embedding_size)
    net.load_state_dict(state_dict, strict=True)
    return net.eval()
