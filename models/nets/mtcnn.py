"""PyTorch definitions of the three MTCNN networks (Zhang et al. 2016), for ONNX conversion only.

Layer names follow the state dicts shipped in facenet-pytorch's wheel (``pnet.pt``, ``rnet.pt``,
``onet.pt``) so they load strictly. Inputs are RGB, ``(x - 127.5) / 128``, NCHW. The weights come
from MATLAB Caffe models: R-Net and O-Net flatten their last feature map in (N, W, H, C) order.
"""

from __future__ import annotations

import torch
from torch import nn


class PNet(nn.Module):
    """Proposal net, fully convolutional: (N, 3, H, W) -> face prob (N, H', W'), box reg (N, 4, H', W').

    One output cell covers a 12x12 window with stride 2.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, kernel_size=3)
        self.prelu1 = nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(10, 16, kernel_size=3)
        self.prelu2 = nn.PReLU(16)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=3)
        self.prelu3 = nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """The 32-channel map both heads read."""
        x = self.pool1(self.prelu1(self.conv1(x)))
        return self.prelu3(self.conv3(self.prelu2(self.conv2(x))))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.trunk(x)
        prob = torch.softmax(self.conv4_1(x), dim=1)[:, 1]
        return prob, self.conv4_2(x)


class OneHeadPNet(nn.Module):
    """P-Net whose two 1x1 heads are one convolution of 5 channels: the difference of the two face
    logits, then the 4 box offsets. ``prob`` is the sigmoid of that difference, which is
    ``softmax(logits)[:, 1]``: the outputs are P-Net's, without ONNX Runtime's Softmax over the
    channel axis of the whole map and with one head pass instead of two."""

    def __init__(self, pnet: PNet) -> None:
        super().__init__()
        self.body = pnet
        face, box = pnet.conv4_1, pnet.conv4_2
        self.head = nn.Conv2d(face.in_channels, 1 + box.out_channels, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.cat([face.weight[1:2] - face.weight[0:1], box.weight]))
            self.head.bias.copy_(torch.cat([face.bias[1:2] - face.bias[0:1], box.bias]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.body.trunk(x))
        return torch.sigmoid(out[:, 0]), out[:, 1:]


class RNet(nn.Module):
    """Refinement net: 24x24 crops (N, 3, 24, 24) -> face prob (N,), box reg (N, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 28, kernel_size=3)
        self.prelu1 = nn.PReLU(28)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(28, 48, kernel_size=3)
        self.prelu2 = nn.PReLU(48)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3 = nn.Conv2d(48, 64, kernel_size=2)
        self.prelu3 = nn.PReLU(64)
        self.dense4 = nn.Linear(576, 128)
        self.prelu4 = nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu3(self.conv3(x))
        x = x.permute(0, 3, 2, 1).flatten(1)  # Caffe order (N, W, H, C)
        x = self.prelu4(self.dense4(x))
        prob = torch.softmax(self.dense5_1(x), dim=1)[:, 1]
        return prob, self.dense5_2(x)


class ONet(nn.Module):
    """Output net: 48x48 crops -> face prob (N,), box reg (N, 4), landmarks (N, 10).

    Landmarks are 5 x-offsets then 5 y-offsets, as fractions of the input box width/height.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3)
        self.prelu1 = nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.prelu2 = nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3)
        self.prelu3 = nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4 = nn.Conv2d(64, 128, kernel_size=2)
        self.prelu4 = nn.PReLU(128)
        self.dense5 = nn.Linear(1152, 256)
        self.prelu5 = nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = x.permute(0, 3, 2, 1).flatten(1)  # Caffe order (N, W, H, C)
        x = self.prelu5(self.dense5(x))
        prob = torch.softmax(self.dense6_1(x), dim=1)[:, 1]
        return prob, self.dense6_2(x), self.dense6_3(x)


class PixelInput(nn.Module):
    """An MTCNN net on uint8 ``(N, H, W, 3)`` RGB pixels: the cast and the NCHW transpose happen
    inside (in the exported graph: one ONNX Runtime pass instead of NumPy's over every level).
    The net must take pixel values, e.g. after models.mtcnn_convert.fold_input_normalisation."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixels: torch.Tensor):
        return self.net(pixels.permute(0, 3, 1, 2).float())
