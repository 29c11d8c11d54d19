"""Convert facenet-pytorch's MTCNN state dicts (P-Net, R-Net, O-Net) into ONNX files.

Source: the ``facenet-pytorch`` wheel on PyPI (``pip download --no-deps facenet-pytorch==2.6.0``),
files ``facenet_pytorch/data/{pnet,rnet,onet}.pt`` (MIT licence). Only the weight files are read;
the networks are our own definitions in :mod:`models.nets.mtcnn`.
"""

from __future__ import annotations

import io
import logging
import zipfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: Where the converted networks live inside the package.
DEFAULT_MTCNN_DIR = Path(__file__).resolve().parent / "weights" / "mtcnn"
NETWORKS = ("pnet", "rnet", "onet")
#: The converted nets' input: uint8 RGB pixels, ``(N, H, W, 3)``. Files written before it was
#: introduced take ``"image"``, float32 ``(x - 127.5) / 128`` NCHW (models.mtcnn reads both).
PIXELS_INPUT = "pixels"
_OUTPUTS = {"pnet": ["prob", "reg"], "rnet": ["prob", "reg"], "onet": ["prob", "reg", "landmarks"]}


def _read_state_dicts(source: str | Path) -> dict[str, dict]:
    import torch

    source = Path(source)
    blobs: dict[str, bytes] = {}
    if source.is_dir():
        for name in NETWORKS:
            path = source / f"{name}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found (expected pnet.pt, rnet.pt, onet.pt)")
            blobs[name] = path.read_bytes()
    elif source.is_file() and source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            for name in NETWORKS:
                member = f"facenet_pytorch/data/{name}.pt"
                try:
                    blobs[name] = wheel.read(member)
                except KeyError:
                    raise FileNotFoundError(f"{member} is not in {source}") from None
    else:
        raise FileNotFoundError(f"{source}: expected a facenet-pytorch .whl or a folder of .pt files")
    return {
        name: torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        for name, blob in blobs.items()
    }


#: ONNX Runtime's CPU provider runs a convolution in its blocked NCHWc layout only when its output
#: channels (and its input channels, from 8 up) are multiples of this.
NCHWC_BLOCK = 16


def pad_first_block_for_nchwc(net, block: int = NCHWC_BLOCK):
    """A copy of an MTCNN net whose ``conv1`` has its output channels padded to a multiple of
    ``block`` with zero filters (P-Net 10 -> 16, R-Net 28 -> 32; O-Net's 32 stay), and ``conv2``
    matching zero input weights.

    The outputs are the same numbers: a zero filter with zero bias gives 0, PReLU and max-pooling
    keep 0, and its zero weights in ``conv2`` add exactly 0. What changes is that ONNX Runtime can
    keep the whole network in its NCHWc layout instead of running ``conv1`` and ``conv2`` as
    im2col + GEMM with reorders between: about 20% less CPU time for P-Net on a phone photo's
    first pyramid level (docs/results/face-path.md).
    """
    import copy

    import torch

    padded = copy.deepcopy(net)
    conv1, prelu1, conv2 = net.conv1, net.prelu1, net.conv2
    channels = -(-conv1.out_channels // block) * block
    if channels == conv1.out_channels:
        return padded
    new1 = torch.nn.Conv2d(conv1.in_channels, channels, conv1.kernel_size, conv1.stride)
    new_prelu = torch.nn.PReLU(channels)
    new2 = torch.nn.Conv2d(channels, conv2.out_channels, conv2.kernel_size, conv2.stride)
    kept = conv1.out_channels
    with torch.no_grad():
        for tensor in (new1.weight, new1.bias, new2.weight):
            tensor.zero_()
        new1.weight[:kept] = conv1.weight
        new1.bias[:kept] = conv1.bias
        new_prelu.weight.fill_(0.0)
        new_prelu.weight[:kept] = prelu1.weight
        new2.weight[:, :kept] = conv2.weight
        new2.bias.copy_(conv2.bias)
    padded.conv1, padded.prelu1, padded.conv2 = new1, new_prelu, new2
    return padded.eval()


def fold_input_normalisation(net):
    """A copy of an MTCNN net whose ``conv1`` takes pixel values (0-255) instead of MTCNN's
    ``(x - 127.5) / 128``: its weights divided by 128, its bias less ``127.5 / 128`` times each
    filter's sum. Exact up to float rounding because ``conv1`` has no padding (R-Net's and O-Net's
    zero-padded crops are padded with pixel 0 before the network, as before)."""
    import copy

    import torch

    folded = copy.deepcopy(net)
    with torch.no_grad():
        weight = folded.conv1.weight
        folded.conv1.bias -= 127.5 / 128 * weight.sum(dim=(1, 2, 3))
        weight *= 1 / 128
    return folded.eval()


def network_for_export(name: str, net):
    """The network as it is written to ONNX: the same outputs as ``net`` on normalised input, from
    uint8 pixels, in a form ONNX Runtime runs fast (see the functions it calls)."""
    from models.nets.mtcnn import OneHeadPNet, PixelInput
    from models.onnx_export import for_onnx_export

    net = pad_first_block_for_nchwc(fold_input_normalisation(net))
    if name == "pnet":  # the sigmoid of one logit instead of a Softmax over the map (13% of P-Net)
        net = OneHeadPNet(net)
    return for_onnx_export(PixelInput(net).eval())


def convert_mtcnn(source: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``pnet.onnx``, ``rnet.onnx``, ``onet.onnx`` into ``out_dir`` and check each one.

    Each takes :data:`PIXELS_INPUT`, uint8 ``(N, H, W, 3)`` RGB. P-Net gets dynamic batch, height
    and width axes; R-Net and O-Net a dynamic batch axis. :func:`network_for_export` says what is
    changed from the PyTorch definitions. Every file is checked against the PyTorch network on
    random pixels (max abs diff < 1e-4).
    """
    import torch
    from torch.export import Dim

    from models.nets.mtcnn import ONet, PNet, RNet

    out = Path(out_dir) if out_dir else DEFAULT_MTCNN_DIR
    out.mkdir(parents=True, exist_ok=True)
    state_dicts = _read_state_dicts(source)
    nets = {"pnet": PNet(), "rnet": RNet(), "onet": ONet()}
    examples = {"pnet": (2, 48, 64, 3), "rnet": (2, 24, 24, 3), "onet": (2, 48, 48, 3)}
    # Parity inputs differ from the export examples, so the dynamic axes are exercised too.
    checks = {"pnet": (3, 53, 71, 3), "rnet": (5, 24, 24, 3), "onet": (5, 48, 48, 3)}
    for noisy in ("onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    batch = Dim("batch", min=1, max=4096)
    shapes = {
        "pnet": {0: batch, 1: Dim("height", min=12, max=8192), 2: Dim("width", min=12, max=8192)},
        "rnet": {0: batch},
        "onet": {0: batch},
    }
    written = []
    for name, net in nets.items():
        net.load_state_dict(state_dicts[name], strict=True)
        net.eval()
        path = out / f"{name}.onnx"
        program = torch.onnx.export(
            network_for_export(name, net),
            (torch.zeros(examples[name], dtype=torch.uint8),),
            input_names=[PIXELS_INPUT],
            output_names=_OUTPUTS[name],
            dynamic_shapes=(shapes[name],),
            dynamo=True,
            opset_version=18,
            verbose=False,
        )
        program.save(str(path))
        diff = _parity(net, path, checks[name])
        log.info("%s: ONNX vs PyTorch max abs diff %.2e", path.name, diff)
        written.append(path)
    return written


def _parity(net, path: Path, shape: tuple[int, ...]) -> float:
    """Max abs difference between the ONNX file on random pixels and ``net`` on them normalised."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    with torch.no_grad():
        expected = [t.numpy() for t in net(normalise_pixels(pixels))]
    got = session.run(None, {PIXELS_INPUT: pixels.numpy()})
    diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True))
    if diff > 1e-4:
        raise RuntimeError(f"{path.name}: ONNX output differs from PyTorch by {diff:.3g}")
    return diff


def normalise_pixels(pixels):
    """uint8 ``(N, H, W, 3)`` pixels (a tensor) -> the float NCHW ``(x - 127.5) / 128`` the
    PyTorch definitions take."""
    return (pixels.permute(0, 3, 1, 2).float() - 127.5) / 128
