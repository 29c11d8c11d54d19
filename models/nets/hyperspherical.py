"""Hyperspherical operators: SphereConv (SphereNet), SphereNorm and the decoupled operators (DCNet).

A decoupled operator (thesis Eq. 4.3) replaces the inner product ``<w, x> = ||w|| ||x|| cos(theta)``
of a convolution or linear layer by ``f(w, x) = h(||x||) * g(theta)``, with ``theta`` the angle
between the kernel ``w`` and the local patch ``x`` (SphereNet Eq. 1-4; thesis Eq. 4.3-4.10):

* angular activations ``g`` (:data:`ANGULAR`, :func:`angular_activation`):
  ``linear`` ``1 - 2 theta / pi`` (Eq. 3.2 / 4.11), ``cosine`` ``cos(theta)`` (Eq. 3.3),
  ``sigmoid`` with curvature ``k`` (Eq. 3.4; fixed, or learnable per filter), and ``square_cosine``
  ``sign(cos) cos^2`` (Eq. 4.14). Every ``g`` maps ``[0, pi]`` onto ``[-1, 1]`` with ``g(0) = 1``
  and ``g(pi) = -1``.
* magnitude functions ``h`` (:data:`MAGNITUDES`): ``sphere`` ``alpha`` (SphereConv, Eq. 4.4),
  ``ball`` ``alpha min(||x||, rho) / rho``, ``tanh`` ``alpha tanh(||x|| / rho)``, ``linear``
  ``alpha ||x||``, ``seg`` (piecewise linear, slope ``beta`` past ``rho``), ``log``
  ``alpha log(1 + ||x||)`` and ``mix`` ``alpha ||x|| + beta log(1 + ||x||)`` (Eq. 4.5-4.10).
  The operator radius is ``rho * E{||x||}`` (App. C.2): ``rho`` is learnable, one per kernel,
  initialised to 1, and ``E{||x||}`` is a moving average of the layer's mean patch norm (one
  number per layer: every kernel of a layer sees the same patches), updated in training mode like
  BatchNorm's statistics and frozen in eval mode (and in an exported model).

The patch norm ``||x||`` of every output position is a convolution of ``x^2`` with a kernel of ones,
so a network of these layers exports to ONNX with standard operators (ReduceSum, Conv, Sqrt, Div,
Acos, Tanh).

Numerics (stated, and tested in tests/test_hyperspherical.py):

* ``||x||`` is ``sqrt(sum x^2 + NORM_EPS)`` (and ``||w||`` likewise): a zero patch (padding, dead
  ReLUs) gives ``cos = 0`` exactly, a finite output and finite gradients; no NaN. The kernels are
  normalised before the convolution and the patch norm divides after it, so the layer costs one
  convolution, one single-channel convolution of ``x^2`` and a few elementwise operations.
* ``theta = arccos(c)`` is taken with ``c`` clamped to ``[-1 + delta, 1 - delta]`` (``delta`` =
  :data:`ACOS_MARGIN` for the tensor's dtype) because ``d arccos / dc`` is infinite at ``c = +-1``.
  Within that band ``theta`` and its gradients are exact; a kernel exactly parallel or antiparallel
  to a patch gets zero gradient through ``theta`` (the subgradient at the kink of ``theta(w)``).
  The cosine and square-cosine activations never take the arccos and are exact everywhere.
* Sigmoid: Eq. 3.4 equals ``tanh((pi/2 - theta) / (2k)) / tanh(pi / (4k))``, which is what is
  computed (no overflow for small ``k``). A learnable ``k`` is clamped to at least :data:`K_MIN`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Angular activations ``g(theta)``.
ANGULAR: tuple[str, ...] = ("linear", "cosine", "sigmoid", "square_cosine")
#: Magnitude functions ``h(||x||)``; ``sphere`` is SphereConv.
MAGNITUDES: tuple[str, ...] = ("sphere", "ball", "tanh", "linear", "seg", "log", "mix")
#: Operator names of the trainer's ``operator`` option, and their magnitude function.
OPERATORS: dict[str, str] = {
    "sphereconv": "sphere",
    "ballconv": "ball",
    "tanhconv": "tanh",
    "linearconv": "linear",
    "segconv": "seg",
    "logconv": "log",
    "mixconv": "mix",
}
#: Default ``beta`` of the magnitude functions that have one (App. C: SegConv 0.5, MixConv 1).
DEFAULT_BETA = {"seg": 0.5, "mix": 1.0}

NORM_EPS = 1e-12
"""Added to the sum of squares under the patch and kernel norms (a norm floor of 1e-6)."""
ACOS_MARGIN = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
"""How far inside [-1, 1] the cosine is clamped before arccos, per dtype."""
K_MIN = 0.01
"""Smallest curvature ``k`` a learnable sigmoid activation may use (kept positive, §2.5)."""


def _acos(cos: Tensor) -> Tensor:
    margin = ACOS_MARGIN.get(cos.dtype, 1e-6)
    return torch.acos(cos.clamp(-1.0 + margin, 1.0 - margin))


def sigmoid_of_theta(theta: Tensor, k: Tensor | float) -> Tensor:
    """Eq. 3.4 as ``tanh((pi/2 - theta) / (2k)) / tanh(pi / (4k))``; ``k`` broadcasts with ``theta``."""
    k = torch.as_tensor(k, dtype=theta.dtype, device=theta.device)
    return torch.tanh((math.pi / 2 - theta) / (2 * k)) / torch.tanh(math.pi / (4 * k))


def angular_of_theta(theta: Tensor, kind: str, k: Tensor | float = 0.3) -> Tensor:
    """``g(theta)`` for any real ``theta`` (the GA-Softmax target takes ``g(m theta)``, past ``pi``).

    ``linear`` and ``sigmoid`` extend monotonically past ``pi``; ``cosine`` and ``square_cosine``
    are periodic there (the heads use A-Softmax's monotone ``psi`` for a cosine margin instead).
    """
    if kind == "linear":
        return 1.0 - (2.0 / math.pi) * theta
    if kind == "sigmoid":
        return sigmoid_of_theta(theta, k)
    if kind == "cosine":
        return torch.cos(theta)
    if kind == "square_cosine":
        c = torch.cos(theta)
        return c * c.abs()
    raise ValueError(f"unknown angular activation {kind!r}; choose one of {', '.join(ANGULAR)}")


def angular_activation(cos: Tensor, kind: str, k: Tensor | float = 0.3) -> Tensor:
    """``g(theta)`` from ``cos(theta)`` (values in [-1, 1]); the output lies in [-1, 1]."""
    if kind == "cosine":
        return cos
    if kind == "square_cosine":
        return cos * cos.abs()  # sign(cos) cos^2 (Eq. 4.14)
    if kind in ("linear", "sigmoid"):
        return angular_of_theta(_acos(cos), kind, k)
    raise ValueError(f"unknown angular activation {kind!r}; choose one of {', '.join(ANGULAR)}")


def magnitude(norm: Tensor, kind: str, radius: Tensor | None, alpha: float, beta: float | None) -> Tensor:
    """``h(||x||)`` of Eq. 4.4-4.10; ``radius`` (``rho E{||x||}``) broadcasts with ``norm``."""
    if kind == "sphere":
        return torch.full_like(norm, alpha)
    if kind == "linear":
        return alpha * norm
    if kind == "log":
        return alpha * torch.log1p(norm)
    if kind == "mix":
        return alpha * norm + beta * torch.log1p(norm)
    if radius is None:
        raise ValueError(f"magnitude {kind!r} needs an operator radius")
    if kind == "ball":
        return alpha * torch.minimum(norm, radius) / radius
    if kind == "tanh":
        return alpha * torch.tanh(norm / radius)
    if kind == "seg":
        return torch.where(norm <= radius, alpha * norm, beta * norm + (alpha - beta) * radius)
    raise ValueError(f"unknown magnitude {kind!r}; choose one of {', '.join(MAGNITUDES)}")


@dataclass
class OperatorSpec:
    """What replaces the inner product of a layer: ``h(||x||) g(theta)`` (+ optional rescaling).

    ``rescale``: SphereNorm's ``beta F + gamma`` with a learned ``beta`` (init 1) and ``gamma``
    (init 0) per output channel. ``learnable_k``: one sigmoid ``k`` per filter, initialised to
    ``k_init`` (0.5 in the paper, §2.5).
    """

    magnitude: str = "sphere"
    angular: str = "cosine"
    k: float = 0.3
    learnable_k: bool = False
    k_init: float = 0.5
    alpha: float = 1.0
    beta: float | None = None
    rho: float = 1.0
    momentum: float = 0.1
    rescale: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        if self.magnitude not in MAGNITUDES:
            raise ValueError(f"unknown magnitude {self.magnitude!r}; choose one of {', '.join(MAGNITUDES)}")
        if self.angular not in ANGULAR:
            raise ValueError(
                f"unknown angular activation {self.angular!r}; choose one of {', '.join(ANGULAR)}"
            )
        if self.k <= 0 or self.k_init <= 0:
            raise ValueError("the sigmoid curvature k must be positive")
        if not 0 < self.momentum <= 1:
            raise ValueError("momentum must be in (0, 1]")
        if self.beta is None:
            self.beta = DEFAULT_BETA.get(self.magnitude)

    @property
    def needs_radius(self) -> bool:
        return self.magnitude in ("ball", "tanh", "seg")

    @classmethod
    def from_options(cls, operator: str, options: dict[str, Any] | None = None) -> OperatorSpec:
        """``operator`` is a name of :data:`OPERATORS`; ``options`` the other fields (config form)."""
        if operator not in OPERATORS:
            raise ValueError(f"unknown operator {operator!r}; choose conv or one of {', '.join(OPERATORS)}")
        options = dict(options or {})
        known = set(cls.__dataclass_fields__) - {"magnitude"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown operator options {unknown}; known: {sorted(known)}")
        return cls(magnitude=OPERATORS[operator], **options)


class _HypersphericalBase(nn.Module):
    """Parameters shared by the convolution and linear forms (weight shape set by the subclass)."""

    weight: nn.Parameter

    def _init_operator(self, out_features: int, spec: OperatorSpec) -> None:
        self.spec = spec
        if spec.angular == "sigmoid" and spec.learnable_k:
            self.k = nn.Parameter(torch.full((out_features,), float(spec.k_init)))
        else:
            self.register_parameter("k", None)
        if spec.needs_radius:
            self.rho = nn.Parameter(torch.full((out_features,), float(spec.rho)))
            self.register_buffer("running_norm", torch.ones(()))
            self.register_buffer("norm_initialised", torch.zeros((), dtype=torch.bool))
        else:
            self.register_parameter("rho", None)
        if spec.rescale:
            self.scale = nn.Parameter(torch.ones(out_features))
            self.shift = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("scale", None)
            self.register_parameter("shift", None)
        self.bias = nn.Parameter(torch.zeros(out_features)) if spec.bias else None

    def _curvature(self, shape: tuple[int, ...]) -> Tensor | float:
        if self.k is None:
            return self.spec.k
        return self.k.clamp_min(K_MIN).reshape(shape)

    def _radius(self, norm: Tensor, shape: tuple[int, ...]) -> Tensor | None:
        if self.rho is None:
            return None
        if self.training:
            with torch.no_grad():
                batch_mean = norm.mean().to(self.running_norm.dtype)
                if not bool(self.norm_initialised):
                    self.running_norm.copy_(batch_mean)
                    self.norm_initialised.fill_(True)
                else:
                    self.running_norm.lerp_(batch_mean, self.spec.momentum)
        return self.rho.reshape(shape) * self.running_norm.clamp_min(1e-6)

    def _combine(self, cos: Tensor, norm: Callable[[], Tensor], shape: tuple[int, ...]) -> Tensor:
        """``h(||x||) g(theta)`` (+ rescaling, + bias); ``norm()`` gives ``||x||`` when ``h`` needs it;
        ``shape`` broadcasts per-channel values."""
        spec = self.spec
        out = angular_activation(cos, spec.angular, self._curvature(shape))
        if spec.magnitude == "sphere":
            if spec.alpha != 1.0:
                out = out * spec.alpha
        else:
            x_norm = norm()
            out = out * magnitude(x_norm, spec.magnitude, self._radius(x_norm, shape), spec.alpha, spec.beta)
        if self.scale is not None:
            out = out * self.scale.reshape(shape) + self.shift.reshape(shape)
        if self.bias is not None:
            out = out + self.bias.reshape(shape)
        return out

    def kernel_matrix(self) -> Tensor:
        """The kernels as columns, ``(fan_in, out)``: the ``W`` of the orthogonality regulariser."""
        return self.weight.flatten(1).t()

    def extra_repr(self) -> str:
        s = self.spec
        text = f"h={s.magnitude}, g={s.angular}"
        if s.angular == "sigmoid":
            text += ", k=learnable" if s.learnable_k else f", k={s.k}"
        return text + (", rescale" if s.rescale else "")


class HypersphericalConv2d(_HypersphericalBase):
    """A 2-D convolution whose output is ``h(||x||) g(theta(w, x))`` at every position.

    ``(N, in_channels, H, W)`` -> ``(N, out_channels, H', W')`` with ``nn.Conv2d``'s geometry.
    Grouped convolutions (depthwise included) take each patch norm over its group's channels.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        spec: OperatorSpec | None = None,
    ) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError("in_channels and out_channels must be divisible by groups")
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = (kh, kw)
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, kh, kw))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        # Ungrouped: the channels' squares are summed first, then one 1-channel convolution sums
        # the window (about 3x cheaper than convolving every channel of x^2 with ones).
        ones_shape = (groups, in_channels // groups, kh, kw) if groups > 1 else (1, 1, kh, kw)
        self.register_buffer("ones", torch.ones(ones_shape), persistent=False)
        self._init_operator(out_channels, spec or OperatorSpec())

    def _conv(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.conv2d(x, weight, None, self.stride, self.padding, self.dilation, self.groups)

    def _inverse_patch_norm(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(``sum x^2 + eps``, its reciprocal square root) of every patch, ``(N, 1 or out, H', W')``."""
        ones = self.ones.to(x.dtype)
        if self.groups > 1:
            square_sum = self._conv(x * x, ones) + NORM_EPS
            square_sum = square_sum.repeat_interleave(self.out_channels // self.groups, dim=1)
        else:
            channel_sum = x.square().sum(1, keepdim=True)
            window_sum = F.conv2d(channel_sum, ones, None, self.stride, self.padding, self.dilation)
            square_sum = window_sum + NORM_EPS
        return square_sum, torch.rsqrt(square_sum)

    def patch_norm(self, x: Tensor) -> Tensor:
        """``||x||`` of every patch each output channel sees: ``(N, out_channels or 1, H', W')``."""
        square_sum, inverse = self._inverse_patch_norm(x)
        return square_sum * inverse

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        w_unit = w * torch.rsqrt(w.flatten(1).square().sum(1) + NORM_EPS).reshape(-1, 1, 1, 1)
        square_sum, inverse = self._inverse_patch_norm(x)
        cos = self._conv(x, w_unit) * inverse  # in [-1, 1] up to rounding; arccos clamps
        return self._combine(cos, lambda: square_sum * inverse, (1, -1, 1, 1))


class HypersphericalLinear(_HypersphericalBase):
    """The fully connected case (the kernel is the whole input): ``(N, in)`` -> ``(N, out)``."""

    def __init__(self, in_features: int, out_features: int, spec: OperatorSpec | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self._init_operator(out_features, spec or OperatorSpec())

    def forward(self, x: Tensor) -> Tensor:
        w_unit = self.weight * torch.rsqrt(self.weight.square().sum(1, keepdim=True) + NORM_EPS)
        square_sum = x.square().sum(1, keepdim=True) + NORM_EPS
        inverse = torch.rsqrt(square_sum)
        cos = F.linear(x, w_unit) * inverse
        return self._combine(cos, lambda: square_sum * inverse, (1, -1))


HYPERSPHERICAL_LAYERS = (HypersphericalConv2d, HypersphericalLinear)


def hyperspherical_layers(module: nn.Module) -> Iterator[_HypersphericalBase]:
    """Every hyperspherical conv / linear layer of ``module``."""
    return (m for m in module.modules() if isinstance(m, HYPERSPHERICAL_LAYERS))


def _replacement(layer: nn.Module, spec: OperatorSpec, include_linear: bool) -> nn.Module | None:
    if isinstance(layer, nn.Conv2d) and not isinstance(layer, HYPERSPHERICAL_LAYERS):
        if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise ValueError("hyperspherical convolutions support numeric zero padding only")
        new: nn.Module = HypersphericalConv2d(
            layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
            layer.dilation, layer.groups, spec,
        )  # fmt: skip
    elif include_linear and isinstance(layer, nn.Linear):
        new = HypersphericalLinear(layer.in_features, layer.out_features, spec)
    else:
        return None
    with torch.no_grad():
        new.weight.copy_(layer.weight)  # the network's own initialisation (the direction matters)
    return new


def convert_to_hyperspherical(
    net: nn.Module, spec: OperatorSpec, include_linear: bool = False, skip: tuple[str, ...] = ()
) -> nn.Module:
    """Replace every ``nn.Conv2d`` (and ``nn.Linear`` when ``include_linear``) of ``net`` in place.

    ``skip``: qualified names of layers to keep (e.g. ``("fc1",)``). Returns ``net``. The original
    layers' bias is dropped unless ``spec.bias`` (the papers omit it, Eq. 1).
    """
    for parent_name, parent in list(net.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if qualified in skip:
                continue
            new = _replacement(child, spec, include_linear)
            if new is not None:
                setattr(parent, name, new)
    return net


@dataclass
class HypersphericalSettings:
    """A network's operator choice as the trainer's config states it (``operator = "conv"``: none)."""

    operator: str = "conv"
    options: dict[str, Any] = field(default_factory=dict)
    include_linear: bool = False

    def apply(self, net: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
        if self.operator == "conv":
            return net
        return convert_to_hyperspherical(
            net, OperatorSpec.from_options(self.operator, self.options), self.include_linear, skip
        )


# ------------------------------------------------------------------------------------------------
# Regularisers and optimiser options (SphereNet §2.4, DCNet §4.4)
# ------------------------------------------------------------------------------------------------


def orthogonality_penalty(module: nn.Module, off_diagonal_only: bool = False) -> Tensor:
    """Sum over hyperspherical layers of ``||W^T W - I||_F^2`` (SphereNet §2.4), kernels as columns.

    ``off_diagonal_only``: DCNet's ``||W^T W - diag(W^T W)||_F^2`` (only the correlations).
    """
    total: Tensor | None = None
    for layer in hyperspherical_layers(module):
        w = layer.kernel_matrix().float()
        gram = w.t() @ w
        if off_diagonal_only:
            gram = gram - torch.diag(torch.diagonal(gram))
        else:
            gram = gram - torch.eye(gram.shape[0], device=gram.device)
        term = gram.square().sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the network has no hyperspherical layers to regularise")
    return total


@torch.no_grad()
def project_weights_(module: nn.Module, norm: float = 1.0) -> None:
    """DCNet's weight projection ``w <- s w / ||w||`` for every kernel of every hyperspherical layer."""
    for layer in hyperspherical_layers(module):
        w = layer.weight
        w_norm = torch.sqrt(w.flatten(1).square().sum(1) + NORM_EPS)
        w.mul_((norm / w_norm).reshape([-1] + [1] * (w.dim() - 1)))


def enable_weighted_gradients(module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """DCNet's weighted gradients (Eq. 4.17-4.18): each kernel's gradient times its norm ``||w||``.

    The gradient of an angle-only operator scales as ``1 / ||w||``, so the weighted one does not
    depend on the kernel's norm. Returns the hook handles (``handle.remove()`` undoes it).
    """
    handles = []
    for layer in hyperspherical_layers(module):
        weight = layer.weight

        def scale_by_norm(grad: Tensor, weight: Tensor = weight) -> Tensor:
            w_norm = torch.sqrt(weight.detach().flatten(1).square().sum(1) + NORM_EPS)
            return grad * w_norm.reshape([-1] + [1] * (grad.dim() - 1))

        handles.append(weight.register_hook(scale_by_norm))
    return handles


def operator_parameters(module: nn.Module) -> set[int]:
    """``id``s of the operator's own parameters (``k``, ``rho``, rescaling): never weight-decayed."""
    ids = set()
    for layer in hyperspherical_layers(module):
        for name in ("k", "rho", "scale", "shift", "bias"):
            param = getattr(layer, name)
            if param is not None:
                ids.add(id(param))
    return ids
