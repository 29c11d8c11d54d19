"""A reader of dlib's DNN serialisation format, for dlib's face-recognition ResNet.

Our own reader (no dlib needed), written from the format as dlib's sources define it:

* **Integers**: one control byte (bit 7: negative; bits 0-3: number of value bytes, at least 1),
  then the absolute value, least-significant byte first. ``01 00`` is 0, ``02 80 12`` is 4736.
* **bool**: the ASCII byte ``'1'`` or ``'0'``. **string**: length (integer), then the bytes.
* **float / double**: two integers, mantissa then exponent: value = mantissa * 2**exponent.
* **tensor**: version 2, then ``num_samples, k, nr, nc`` (integers), then that many raw
  little-endian float32 values. **alias tensor** (a view into a layer's parameters, no data):
  version 1 and the four dimensions.
* **Networks**: ``add_loss_layer`` writes its version (1), the loss details, then the network.
  Every ``add_layer`` writes its version (2; 3 for the innermost, which holds the input layer) and
  then its sub-network *before* its own details; tag and skip layers write only a version (1).
  So a file holds every container's version outer to inner, then the input layer, then every
  layer's details inner to outer, each followed by three bools and three (empty) run-time tensors;
  the innermost layer adds its sample-expansion factor.

The topology is not in the file (no tag numbers, no skip targets): like dlib itself, a reader must
know the network type. :func:`face_resnet_layers` spells out dlib's ``anet_type`` of
``dnn_face_recognition_ex.cpp``, and :func:`read_dlib_face_resnet` checks the file against it
record by record, so a file of another network is refused with the offset and what was found.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from models.errors import ModelFolderError

#: The file inside the PyPI sdist ``face_recognition_models==0.3.0`` (CC0 1.0).
DLIB_RESNET_FILE = "dlib_face_recognition_resnet_model_v1.dat"
#: sha256 of that file, as published in face_recognition_models 0.3.0.
DLIB_RESNET_SHA256 = "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30"

#: Stages of dlib's face ResNet from input to output: (dlib's level name, input channels,
#: output channels, starts with a down-sampling block, residual blocks after it).
FACE_RESNET_STAGES: tuple[tuple[str, int, int, bool, int], ...] = (
    ("level4", 32, 32, False, 3),
    ("level3", 32, 64, True, 3),
    ("level2", 64, 128, True, 2),
    ("level1", 128, 256, True, 2),
    ("level0", 256, 256, True, 0),
)

#: Container kinds that write only a version int (no details record).
_MARKERS = ("tag", "skip")


class DlibFormatError(ModelFolderError):
    """The file is not a dlib face-recognition ResNet as this reader knows it."""

    code = "dlib_format"


# --------------------------------------------------------------------------------------------
# Primitive values
# --------------------------------------------------------------------------------------------


class _Stream:
    """Sequential reader over the file's bytes; every error names the byte offset."""

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.pos = 0
        self.name = name

    def fail(self, message: str) -> DlibFormatError:
        return DlibFormatError(f"{self.name}: at byte {self.pos}: {message}")

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise self.fail(f"file ends after {len(self.data)} bytes, {n} more needed")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def integer(self) -> int:
        control = self._take(1)[0]
        size = control & 0x0F
        if control & 0x70 or not 1 <= size <= 8:
            self.pos -= 1
            raise self.fail(f"byte 0x{control:02x} does not start an integer")
        value = int.from_bytes(self._take(size), "little")
        return -value if control & 0x80 else value

    def boolean(self) -> bool:
        byte = self._take(1)
        if byte not in (b"0", b"1"):
            self.pos -= 1
            raise self.fail(f"expected a bool ('0' or '1'), found byte 0x{byte[0]:02x}")
        return byte == b"1"

    def string(self, limit: int = 256) -> str:
        length = self.integer()
        if not 0 <= length <= limit:
            raise self.fail(f"implausible string length {length}")
        try:
            return self._take(length).decode("ascii")
        except UnicodeDecodeError:
            raise self.fail("a layer name that is not ASCII") from None

    def real(self) -> float:
        """A float or double (mantissa, exponent); dlib's codes for inf and NaN included."""
        mantissa, exponent = self.integer(), self.integer()
        special = {32000: np.inf, 32001: -np.inf, 32002: np.nan}
        if exponent in special:
            return float(special[exponent])
        return float(mantissa) * 2.0**exponent

    def version(self, expected: int, what: str) -> None:
        start = self.pos
        got = self.integer()
        if got != expected:
            self.pos = start
            raise self.fail(f"{what}: version {got}, expected {expected}")

    def tensor(self) -> np.ndarray:
        """A tensor: ``(num_samples, k, nr, nc)`` float32 (a copy, native byte order)."""
        self.version(2, "tensor")
        shape = tuple(self.integer() for _ in range(4))
        if min(shape) < 0:
            raise self.fail(f"negative tensor dimension {shape}")
        count = int(np.prod(shape))
        raw = self._take(4 * count)
        return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)

    def alias(self) -> tuple[int, int, int, int]:
        self.version(1, "alias tensor")
        return tuple(self.integer() for _ in range(4))  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Layer records
# --------------------------------------------------------------------------------------------


@dataclass
class DlibConv:
    """``con_``: ``weight`` ``(filters, in_channels, rows, cols)`` (correlation, as PyTorch),
    ``bias`` ``(filters,)``; zero padding ``padding`` (rows, cols), ``stride`` (rows, cols)."""

    weight: np.ndarray
    bias: np.ndarray
    stride: tuple[int, int]
    padding: tuple[int, int]


@dataclass
class DlibAffine:
    """``affine_`` in conv mode: ``y[c] = gamma[c] * x[c] + beta[c]`` (a frozen batch norm)."""

    gamma: np.ndarray
    beta: np.ndarray


@dataclass
class DlibPool:
    """``max_pool_`` / ``avg_pool_``; ``size`` (0, 0) means the whole input (global pooling)."""

    kind: str
    size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]


@dataclass
class DlibFullyConnected:
    """``fc_``: ``weight`` ``(inputs, outputs)``, output = x @ weight (+ ``bias`` when present)."""

    weight: np.ndarray
    bias: np.ndarray | None


@dataclass
class DlibInput:
    """``input_rgb_image_sized``: channel planes R, G, B, each ``(pixel - mean) / 256``."""

    mean_rgb: tuple[float, float, float]
    rows: int
    cols: int


@dataclass
class DlibNetwork:
    """What :func:`read_dlib_face_resnet` found, in the network's order from input to output."""

    input: DlibInput
    convs: list[DlibConv]
    affines: list[DlibAffine]
    pools: list[DlibPool]
    fc: DlibFullyConnected
    loss: dict[str, float]
    sha256: str
    layer_names: list[str] = field(default_factory=list)


def _read_con(s: _Stream) -> DlibConv:
    params = s.tensor().reshape(-1)
    filters, rows, cols = s.integer(), s.integer(), s.integer()
    stride = (s.integer(), s.integer())
    padding = (s.integer(), s.integer())
    weight_shape, bias_shape = s.alias(), s.alias()
    for _ in range(4):  # learning-rate and weight-decay multipliers (training only)
        s.real()
    n_weights = int(np.prod(weight_shape))
    if weight_shape[0] != filters or weight_shape[2:] != (rows, cols) or bias_shape != (1, filters, 1, 1):
        raise s.fail(
            f"convolution shapes disagree: {filters} filters, weights {weight_shape}, bias {bias_shape}"
        )
    if params.size != n_weights + filters:
        raise s.fail(f"convolution has {params.size} parameters, expected {n_weights} + {filters}")
    return DlibConv(
        weight=params[:n_weights].reshape(weight_shape).copy(),
        bias=params[n_weights:].copy(),
        stride=stride,
        padding=padding,
    )


def _read_affine(s: _Stream) -> DlibAffine:
    params = s.tensor().reshape(-1)
    gamma_shape, beta_shape = s.alias(), s.alias()
    mode = s.integer()
    channels = gamma_shape[1]
    if mode != 0 or gamma_shape != (1, channels, 1, 1) or beta_shape != gamma_shape:
        raise s.fail(
            f"affine layer in mode {mode} with shapes {gamma_shape}, {beta_shape}; expected conv mode"
        )
    if params.size != 2 * channels:
        raise s.fail(f"affine layer has {params.size} parameters for {channels} channels")
    return DlibAffine(gamma=params[:channels].copy(), beta=params[channels:].copy())


def _read_pool(s: _Stream, kind: str) -> DlibPool:
    size = (s.integer(), s.integer())
    stride = (s.integer(), s.integer())
    padding = (s.integer(), s.integer())
    return DlibPool(kind=kind, size=size, stride=stride, padding=padding)


def _read_fc(s: _Stream) -> DlibFullyConnected:
    outputs, inputs = s.integer(), s.integer()
    params = s.tensor().reshape(-1)
    weight_shape, _ = s.alias(), s.alias()  # the bias alias says nothing bias_mode does not
    bias_mode = s.integer()  # 0: with bias, 1: without
    for _ in range(4):
        s.real()
    if weight_shape[:2] != (inputs, outputs) or bias_mode not in (0, 1):
        raise s.fail(
            f"fully connected layer {inputs}->{outputs} with weights {weight_shape}, bias mode {bias_mode}"
        )
    rows = inputs + (1 if bias_mode == 0 else 0)
    if params.size != rows * outputs:
        raise s.fail(f"fully connected layer has {params.size} parameters, expected {rows * outputs}")
    matrix = params.reshape(rows, outputs)
    bias = matrix[inputs].copy() if bias_mode == 0 else None
    return DlibFullyConnected(weight=matrix[:inputs].copy(), bias=bias)


def _read_input(s: _Stream) -> DlibInput:
    name = s.string()
    if name != "input_rgb_image_sized":
        raise s.fail(f"input layer {name!r}, expected 'input_rgb_image_sized'")
    mean = (s.real(), s.real(), s.real())
    return DlibInput(mean_rgb=mean, rows=s.integer(), cols=s.integer())


#: Layer kind -> the version strings of its details record this reader understands.
_DETAIL_NAMES = {
    "con": ("con_4",),
    "affine": ("affine_",),
    "relu": ("relu_",),
    "max_pool": ("max_pool_2",),
    "avg_pool": ("avg_pool_2",),
    "add_prev": ("add_prev_",),
    "fc": ("fc_2",),
}


# --------------------------------------------------------------------------------------------
# The face ResNet
# --------------------------------------------------------------------------------------------


def _block(downsample: bool) -> list[str]:
    """One residual block, input to output, with its tag/skip markers (dlib's ``ares``/``ares_down``)."""
    branch = ["tag", "con", "affine", "relu", "con", "affine"]
    if downsample:  # tag2 on the branch, skip back to tag1 (the input), pool it, add
        return [*branch, "tag", "skip", "avg_pool", "add_prev", "relu"]
    return [*branch, "add_prev", "relu"]


def face_resnet_layers() -> list[str]:
    """dlib's face ResNet (``anet_type``) as layer kinds from the input to the output, without the
    input and loss layers; ``tag``/``skip`` are the containers that have no details record."""
    layers = ["con", "affine", "relu", "max_pool"]
    for _, _, _, downsample, repeats in FACE_RESNET_STAGES:
        if downsample:
            layers += _block(True)
        for _ in range(repeats):
            layers += _block(False)
    return [*layers, "avg_pool", "fc"]


def _read_container_versions(s: _Stream, layers: list[str]) -> None:
    """The version ints of every container, outer to inner (the innermost holds the input)."""
    for depth, kind in enumerate(reversed(layers)):
        innermost = depth == len(layers) - 1
        expected = 1 if kind in _MARKERS else (3 if innermost else 2)
        s.version(expected, f"container of layer {len(layers) - depth} ({kind})")


def _read_details(s: _Stream, kind: str) -> tuple[str, object]:
    start = s.pos
    name = s.string()
    if name not in _DETAIL_NAMES[kind]:
        s.pos = start
        raise s.fail(f"expected a {kind} layer ({' or '.join(_DETAIL_NAMES[kind])}), found {name!r}")
    record: object = None
    if kind == "con":
        record = _read_con(s)
    elif kind == "affine":
        record = _read_affine(s)
    elif kind in ("max_pool", "avg_pool"):
        record = _read_pool(s, kind.removesuffix("_pool"))
    elif kind == "fc":
        record = _read_fc(s)
    return name, record


def _read_runtime_state(s: _Stream, innermost: bool) -> None:
    """Three bools and three tensors of training state after every layer (ignored)."""
    for _ in range(3):
        s.boolean()
    for _ in range(3):
        s.tensor()
    if innermost:
        s.integer()  # sample expansion factor


def parse_dlib_face_resnet(data: bytes, name: str = DLIB_RESNET_FILE) -> DlibNetwork:
    """Parse the bytes of a ``dlib_face_recognition_resnet_model_v1.dat``-style file.

    Raises:
        DlibFormatError: the bytes are not this network in dlib's format (the message gives the
            byte offset and what was found), or bytes are left over at the end.
    """
    s = _Stream(data, name)
    s.version(1, "loss layer")
    loss_name = s.string()
    if loss_name != "loss_metric_2":
        raise s.fail(f"loss layer {loss_name!r}, expected 'loss_metric_2' (dlib's metric-learning loss)")
    loss = {"margin": s.real(), "distance_threshold": s.real()}
    layers = face_resnet_layers()
    _read_container_versions(s, layers)
    net_input = _read_input(s)
    convs: list[DlibConv] = []
    affines: list[DlibAffine] = []
    pools: list[DlibPool] = []
    fc: DlibFullyConnected | None = None
    names = []
    detailed = [k for k in layers if k not in _MARKERS]
    for i, kind in enumerate(detailed):
        layer_name, record = _read_details(s, kind)
        _read_runtime_state(s, innermost=i == 0)
        names.append(layer_name)
        if isinstance(record, DlibConv):
            convs.append(record)
        elif isinstance(record, DlibAffine):
            affines.append(record)
        elif isinstance(record, DlibPool):
            pools.append(record)
        elif isinstance(record, DlibFullyConnected):
            fc = record
    if s.pos != len(data):
        raise s.fail(f"{len(data) - s.pos} bytes left after the last layer")
    assert fc is not None  # the layer list ends with "fc"
    return DlibNetwork(
        input=net_input,
        convs=convs,
        affines=affines,
        pools=pools,
        fc=fc,
        loss=loss,
        sha256=hashlib.sha256(data).hexdigest(),
        layer_names=names,
    )


def read_dlib_face_resnet(path: str | os.PathLike[str] | BinaryIO) -> DlibNetwork:
    """Read a dlib face-recognition ResNet file (a path or an open binary file)."""
    if hasattr(path, "read"):
        data, name = path.read(), getattr(path, "name", DLIB_RESNET_FILE)  # type: ignore[union-attr]
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"dlib model file not found: {p}")
        data, name = p.read_bytes(), p.name
    if data[:1] == b"B" and data[:3] == b"BZh":
        raise DlibFormatError(
            f"{name} is bzip2-compressed (as dlib.net serves it): unpack it with bunzip2 first"
        )
    return parse_dlib_face_resnet(data, str(name))
