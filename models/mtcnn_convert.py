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
    first pyramid level (docs/face_path.md).
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


def convert_mtcnn(source: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``pnet.onnx``, ``rnet.onnx``, ``onet.onnx`` into ``out_dir`` and check each one.

    P-Net gets dynamic batch, height and width axes; R-Net and O-Net a dynamic batch axis. The first
    block is padded to ONNX Runtime's channel block (:func:`pad_first_block_for_nchwc`).
    Every file is checked against the PyTorch network on random input (max abs diff < 1e-4).
    """
    import torch
    from torch.export import Dim

    from models.nets.mtcnn import ONet, PNet, RNet
    from models.onnx_export import for_onnx_export

    out = Path(out_dir) if out_dir else DEFAULT_MTCNN_DIR
    out.mkdir(parents=True, exist_ok=True)
    state_dicts = _read_state_dicts(source)
    nets = {"pnet": PNet(), "rnet": RNet(), "onet": ONet()}
    examples = {"pnet": (1, 3, 48, 64), "rnet": (2, 3, 24, 24), "onet": (2, 3, 48, 48)}
    # Parity inputs differ from the export examples, so the dynamic axes are exercised too.
    checks = {"pnet": (3, 3, 53, 71), "rnet": (5, 3, 24, 24), "onet": (5, 3, 48, 48)}
    for noisy in ("onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    batch = Dim("batch", min=1, max=4096)
    shapes = {
        "pnet": {0: batch, 2: Dim("height", min=12, max=8192), 3: Dim("width", min=12, max=8192)},
        "rnet": {0: batch},
        "onet": {0: batch},
    }
    written = []
    for name, net in nets.items():
        net.load_state_dict(state_dicts[name], strict=True)
        net.eval()
        path = out / f"{name}.onnx"
        program = torch.onnx.export(
            for_onnx_export(pad_first_block_for_nchwc(net)),
            (torch.zeros(examples[name]),),
            input_names=["image"],
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
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(shape, generator=generator) * 2 - 1
    with torch.no_grad():
        expected = [t.numpy() for t in net(x)]
    got = session.run(None, {"image": x.numpy()})
    diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True))
    if diff > 1e-4:
        raise RuntimeError(f"{path.name}: ONNX output differs from PyTorch by {diff:.3g}")
    return diff
