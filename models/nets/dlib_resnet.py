"""dlib's face-recognition ResNet (``dlib_face_recognition_resnet_model_v1``) rebuilt in PyTorch.

The network of dlib's ``dnn_face_recognition_ex.cpp`` (``anet_type``): a ResNet-34 with some
layers removed and half the filters, 29 convolutions, 150x150 RGB input, a 128-d output that
dlib compares by Euclidean distance (0.6 = same person). Weights come from our own reader of
dlib's file format (:mod:`models.dlib_format`); the mapping is in
:func:`models.importers.import_dlib`.

Layers, input to output, with the sizes for a 150x150 input::

    stem    7x7/2 conv 3->32 (no padding), affine, ReLU          (N, 32, 72, 72)
            3x3/2 max pool (no padding)                          (N, 32, 35, 35)
    level4  3 residual blocks, 32                                (N, 32, 35, 35)
    level3  down-sampling block 32->64, 3 residual blocks, 64    (N, 64, 17, 17)
    level2  down-sampling block 64->128, 2 residual blocks       (N, 128, 8, 8)
    level1  down-sampling block 128->256, 2 residual blocks      (N, 256, 4, 4)
    level0  down-sampling block 256->256                         (N, 256, 2, 2)
            global average pool, fully connected 256->128 (no bias)  (N, 128)

(dlib numbers its levels from the output, so ``level4`` is the first.) A residual block is
``relu(x + affine(conv3x3(relu(affine(conv3x3(x))))))``. A down-sampling block's first convolution
has stride 2 and no padding, and its shortcut is a 2x2/2 average pool of the input. When the two
branches differ in size, dlib's ``add_prev`` adds them as zero-extended tensors: the sum has the
larger channel count and the larger height and width, each tensor anchored at channel 0 and at
the top-left corner. This happens in ``level1`` (the convolution branch is 3x3, the pooled
shortcut 4x4) and wherever the channel count doubles.

dlib's per-channel ``affine`` layers (frozen batch norm: ``y = gamma * x + beta``) are folded into
the convolution before them when the weights are loaded, so every convolution here has a bias.

Input: ``(N, 3, 150, 150)`` RGB, each channel ``(pixel - mean_c) / 256`` with the means stored
in the file (122.782, 117.001, 104.298), as dlib's ``input_rgb_image_sized<150>`` does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.dlib_format import FACE_RESNET_STAGES, DlibNetwork

#: Input side and output size of dlib's face ResNet.
DLIB_INPUT_SIZE = 150
DLIB_EMBEDDING_SIZE = 128
#: ``architecture`` in the manifest of the converted model (``sphereface import dlib``).
DLIB_ARCHITECTURE = "dlib_resnet29"


def add_zero_extended(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dlib's ``add_prev``: ``a + b`` where each is zero-extended to the larger channel count,
    height and width (anchored at channel 0, row 0, column 0). ``(N, C, H, W)`` tensors."""
    channels, height, width = (max(a.shape[i], b.shape[i]) for i in (1, 2, 3))

    def extend(t: torch.Tensor) -> torch.Tensor:
        pad = (0, width - t.shape[3], 0, height - t.shape[2], 0, channels - t.shape[1])
        return F.pad(t, pad) if any(pad) else t

    return extend(a) + extend(b)


class DlibResidualBlock(nn.Module):
    """``relu(shortcut(x) (+) conv2(relu(conv1(x))))``, ``(+)`` as :func:`add_zero_extended`.

    ``downsample``: ``conv1`` has stride 2 and no padding, the shortcut is a 2x2/2 average pool.
    Otherwise both convolutions have stride 1 and padding 1 and the shortcut is ``x``.
    """

    def __init__(self, in_channels: int, out_channels: int, downsample: bool) -> None:
        super().__init__()
        self.downsample = downsample
        stride, padding = (2, 0) if downsample else (1, 1)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=padding)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.conv2(F.relu(self.conv1(x)))
        shortcut = F.avg_pool2d(x, 2, 2) if self.downsample else x
        return F.relu(add_zero_extended(branch, shortcut))


class DlibFaceResNet(nn.Module):
    """dlib's face-recognition ResNet: ``(N, 3, 150, 150)`` -> ``(N, 128)`` (not normalised)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 7, stride=2, padding=0)
        stages = []
        for _, cin, cout, down, repeats in FACE_RESNET_STAGES:
            blocks = [DlibResidualBlock(cin, cout, downsample=down)] if down else []
            blocks += [DlibResidualBlock(cout, cout, downsample=False) for _ in range(repeats)]
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(256, DLIB_EMBEDDING_SIZE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2)
        x = self.stages(x)
        return self.fc(x.mean(dim=(2, 3)))

    def convolutions(self) -> list[nn.Conv2d]:
        """Every convolution in dlib's order, input to output (stem, then conv1, conv2 per block)."""
        convs = [self.stem]
        for stage in self.stages:
            for block in stage:
                convs += [block.conv1, block.conv2]
        return convs

    @classmethod
    def from_dlib(cls, network: DlibNetwork) -> DlibFaceResNet:
        """The network with the weights read from a dlib file, each ``affine`` folded into the
        convolution before it (``w' = gamma * w``, ``b' = gamma * b + beta``, in float64)."""
        net = cls()
        convs = net.convolutions()
        if len(network.convs) != len(convs) or len(network.affines) != len(convs):
            raise ValueError(
                f"the file has {len(network.convs)} convolutions and {len(network.affines)} affine layers, "
                f"the network {len(convs)}"
            )
        with torch.no_grad():
            for conv, source, affine in zip(convs, network.convs, network.affines, strict=True):
                _check_conv(conv, source.weight.shape, source.stride, source.padding)
                gamma = affine.gamma.astype(np.float64)
                weight = source.weight.astype(np.float64) * gamma[:, None, None, None]
                bias = source.bias.astype(np.float64) * gamma + affine.beta.astype(np.float64)
                conv.weight.copy_(torch.from_numpy(weight.astype(np.float32)))
                conv.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
            if network.fc.bias is not None or network.fc.weight.shape != (256, DLIB_EMBEDDING_SIZE):
                raise ValueError(
                    f"fully connected layer {network.fc.weight.shape}, expected 256 -> 128 without bias"
                )
            net.fc.weight.copy_(torch.from_numpy(network.fc.weight.T.copy()))
        return net.eval()


def _check_conv(
    conv: nn.Conv2d, shape: tuple[int, ...], stride: tuple[int, int], padding: tuple[int, int]
) -> None:
    if tuple(conv.weight.shape) != tuple(shape) or conv.stride != stride or conv.padding != padding:
        raise ValueError(
            f"convolution {tuple(shape)} stride {stride} padding {padding} does not fit the network's "
            f"{tuple(conv.weight.shape)} stride {conv.stride} padding {conv.padding}"
        )
