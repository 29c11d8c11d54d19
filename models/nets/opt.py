"""Orthogonal over-parameterised training: OPT and stochastic OPT (S-OPT) layers (OPT, CVPR 2021).

OPT (Liu et al., CVPR 2021; thesis Ch. 7) learns every neuron of a layer as ``w_i = R v_i``: the
``v_i`` are drawn at random (zero-mean Gaussian) and frozen, and ``R`` is a learned ``d x d``
orthogonal matrix shared by the layer (``d``: the neuron's dimension, ``C_in/groups * k * k`` for
a convolution). An orthogonal ``R`` keeps every angle between neurons, so the layer's hyperspherical
energy stays that of its random initialisation, which is minimal in expectation (energy invariance,
Eq. 2; Theorem 1). The bias, when the layer has one, is learned as usual.

How ``R`` is learned (``method``, :data:`OPT_METHODS`):

* ``gs``: unrolled classical Gram-Schmidt of an unconstrained matrix ``U`` (the columns ``e_i``,
  computed in chunks of columns; each column is projected off every earlier one, as classical GS).
* ``hr``: Householder QR of ``U`` (LAPACK's, through ``torch.linalg.qr``) with the signs of
  Algorithm 4 (``H x = +||x|| e_1``, so the triangular factor has a positive diagonal). In exact
  arithmetic this is the same ``R`` as ``gs``; in float32 Householder keeps ``R`` orthogonal to
  rounding error while classical GS loses orthogonality as ``cond(U)^2`` (``opt_report``). Its
  gradient is the derivative of the QR factor, not an unrolling of the reflections (the same
  derivative, without storing ``d`` reflections).
* ``ls``: Loewdin's symmetric orthogonalisation ``R = U (U^T U)^(-1/2) = W V^T`` (from the SVD
  ``U = W S V^T``), the orthogonal matrix nearest ``U``. Its backward pass is the stable closed
  form ``W [(M - M^T) / (s_i + s_j)] V^T`` with ``M = W^T G V`` (:class:`_PolarFactor`).
* ``cp``: the Cayley parameterisation ``R = (I - A)^(-1) (I + A)``, ``A`` skew-symmetric from the
  strict upper triangle of the parameter (``R`` in SO(d); starts at ``R = I``).
* ``ogd``: orthogonality-preserving gradient descent: ``R`` itself is the parameter, left out of
  the optimiser, and moved along a Cayley curve on the Stiefel manifold by :func:`ogd_step_`
  (Eq. 3, with two fixed-point iterations of Eq. 4 instead of the inverse).
* ``or``: the relaxation ``R = U`` with the penalty ``beta ||U^T U - I||_F^2`` (Eq. 5,
  :func:`relaxed_orthogonality_penalty`); the energy is no longer fixed.
* ``upt``: ``R = U`` unconstrained and unpenalised (Table 1's "UPT" control).

``gs``/``hr``/``ls`` start from ``U`` with N(0, 1) entries (a random orthogonal ``R``), ``ogd``,
``or`` and ``upt`` from a random orthogonal ``U``, ``cp`` from ``R = I``. Options
(:class:`OPTSpec`): unit-norm ``v`` (§3.7), learnable ``v`` (Table 1's "OPT with learnable v"),
block-diagonal ``R`` with one shared block or independent blocks (parameter-efficient OPT, App. I),
and S-OPT: ``stochastic_dims = p`` learns a ``p x p`` ``R_p`` (from the identity) on ``p`` random
coordinates of the neurons (a layer with at most ``p`` dimensions, such as the first, gets full
OPT); every ``N_in`` steps :func:`stochastic_outer_step_` multiplies ``R_p``
into those coordinates of ``v``, draws new coordinates and resets ``R_p`` (Algorithm 1; the energy
is unchanged, Theorem 2).

:func:`fold_opt` replaces every OPT layer by a plain ``nn.Conv2d`` / ``nn.Linear`` holding
``R v``: the exported network has no extra cost. Everything here is pure PyTorch and knows nothing
of the trainer; the pre-training energy minimisation of ``v`` lives in :mod:`training.opt`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Ways to learn the orthogonal matrix ``R`` (module docstring).
OPT_METHODS: tuple[str, ...] = ("gs", "hr", "ls", "cp", "ogd", "or", "upt")
#: Methods whose ``R`` is orthogonal by construction (the energy-invariant ones).
ORTHOGONAL_METHODS: tuple[str, ...] = ("gs", "hr", "ls", "cp", "ogd")
#: Classical Gram-Schmidt processes this many columns per chunk (projections off the earlier
#: chunks are one matrix product; within a chunk, column by column).
GS_CHUNK = 32
#: OGD: the step along the Cayley curve is capped at ``OGD_MAX_STEP / ||W||`` (Li et al. 2020,
#: q = 0.5 with their factor 2), which keeps the fixed-point iteration contracting.
OGD_MAX_STEP = 1.0
#: Largest neuron dimension given a full ``d x d`` ``R`` (beyond it: blocks, S-OPT or ``skip``).
MAX_FULL_DIM = 4096


# ------------------------------------------------------------------------------------------------
# Orthogonalisers: (..., d, d) -> (..., d, d) orthogonal, differentiable
# ------------------------------------------------------------------------------------------------


def gram_schmidt(u: Tensor, chunk: int = GS_CHUNK) -> Tensor:
    """Classical Gram-Schmidt of the columns of ``u`` (..., d, d): ``e_i = u_i - sum_j<i <u_i, e_j> e_j``.

    Unrolled (differentiable by autograd). Columns are taken ``chunk`` at a time: the projections
    of a chunk off all earlier columns are one matrix product, then the chunk's own columns are
    projected one by one. Every projection uses the original ``u_i`` (classical, not modified GS).
    """
    d = u.shape[-1]
    done: Tensor | None = None  # (..., d, j) orthonormal columns so far
    for start in range(0, d, chunk):
        block = u[..., :, start : start + chunk]
        if done is not None:
            block = block - done @ (done.transpose(-1, -2) @ block)
        chunk_out: Tensor | None = None  # this chunk's orthonormal columns so far
        for i in range(block.shape[-1]):
            col = block[..., :, i : i + 1]
            if chunk_out is not None:  # <u_i, e_j> == <block_i, e_j>: e_j is orthogonal to `done`
                col = col - chunk_out @ (chunk_out.transpose(-1, -2) @ col)
            col = col / col.norm(dim=-2, keepdim=True)
            chunk_out = col if chunk_out is None else torch.cat([chunk_out, col], dim=-1)
        assert chunk_out is not None
        done = chunk_out if done is None else torch.cat([done, chunk_out], dim=-1)
    assert done is not None
    return done


def householder_orthogonalize(u: Tensor) -> Tensor:
    """The Q factor of the Householder QR of ``u`` (..., d, d) with a positive triangular diagonal."""
    q, r = torch.linalg.qr(u)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs.unsqueeze(-2)


class _PolarFactor(torch.autograd.Function):
    """``R = W V^T`` of ``U = W S V^T``, with the closed-form backward (stable: s_i + s_j > 0)."""

    @staticmethod
    def forward(ctx: Any, u: Tensor) -> Tensor:
        w, s, vh = torch.linalg.svd(u)
        ctx.save_for_backward(w, s, vh)
        return w @ vh

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        w, s, vh = ctx.saved_tensors
        v = vh.transpose(-1, -2)
        m = w.transpose(-1, -2) @ grad @ v
        z = (m - m.transpose(-1, -2)) / (s.unsqueeze(-1) + s.unsqueeze(-2))
        return w @ z @ vh


def lowdin_orthogonalize(u: Tensor) -> Tensor:
    """Loewdin's symmetric orthogonalisation ``U (U^T U)^(-1/2)`` of ``u`` (..., d, d)."""
    return _PolarFactor.apply(u)


def skew_from(a: Tensor) -> Tensor:
    """The skew-symmetric matrix of the strict upper triangle of ``a``: ``triu(a, 1) - triu(a, 1)^T``."""
    upper = torch.triu(a, diagonal=1)
    return upper - upper.transpose(-1, -2)


def cayley(a: Tensor) -> Tensor:
    """``(I - A)^(-1) (I + A)`` with ``A = skew_from(a)`` (..., d, d): a rotation (det 1)."""
    skew = skew_from(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye - skew, eye + skew)


def orthogonal_from(parameter: Tensor, method: str) -> Tensor:
    """The layer's ``R`` blocks (..., b, b) from its parameter under ``method`` (:data:`OPT_METHODS`)."""
    if method == "gs":
        return gram_schmidt(parameter)
    if method == "hr":
        return householder_orthogonalize(parameter)
    if method == "ls":
        return lowdin_orthogonalize(parameter)
    if method == "cp":
        return cayley(parameter)
    if method in ("ogd", "or", "upt"):
        return parameter
    raise ValueError(f"unknown OPT method {method!r}; expected one of: {', '.join(OPT_METHODS)}")


def random_orthogonal(shape: tuple[int, ...], generator: torch.Generator | None = None) -> Tensor:
    """A Haar-random orthogonal matrix (or a stack of them), float32."""
    gaussian = torch.randn(shape, generator=generator, dtype=torch.float64)
    return householder_orthogonalize(gaussian).float()


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OPTSpec:
    """How a network's layers are OPT-trained (the trainer's ``opt`` and ``opt_options``).

    ``block_size``: 0 for one ``d x d`` ``R``; otherwise ``R`` is block-diagonal with blocks of
    this size along the neuron's flattened dimension (which it must divide; a layer with
    ``d <= block_size`` gets one full ``R``), one block shared by all (``shared_blocks``) or one per
    block. ``stochastic_dims``: S-OPT's ``p`` (0: full OPT).
    """

    method: str = "gs"
    normalize_v: bool = False
    learn_v: bool = False
    block_size: int = 0
    shared_blocks: bool = True
    stochastic_dims: int = 0
    #: Raise the initial energy (OPT Table 4): every ``v_i`` gets ``v_shift * ||v_i||`` (in expectation)
    #: along one common random direction before it is frozen; 0 keeps the Gaussian draw.
    v_shift: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in OPT_METHODS:
            raise ValueError(f"unknown OPT method {self.method!r}; expected one of: {', '.join(OPT_METHODS)}")
        if self.block_size < 0 or self.stochastic_dims < 0 or self.v_shift < 0:
            raise ValueError("block_size, stochastic_dims and v_shift must be >= 0")
        if self.block_size and self.stochastic_dims:
            raise ValueError(
                "block_size (parameter-efficient OPT) and stochastic_dims (S-OPT) exclude each other"
            )
        if self.stochastic_dims and self.method not in ORTHOGONAL_METHODS:
            raise ValueError(f"S-OPT needs an orthogonal method ({', '.join(ORTHOGONAL_METHODS)})")

    @classmethod
    def from_options(cls, method: str, options: dict[str, Any] | None = None) -> OPTSpec:
        """The spec of ``opt = method`` with ``opt_options`` (unknown keys raise ValueError)."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)} - {"method"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown OPT options {unknown}; expected some of: {', '.join(sorted(known))}")
        return cls(method=method, **options)


class _OPTBase(nn.Module):
    """Shared part of :class:`OPTConv2d` and :class:`OPTLinear`: ``weight = R v`` (neurons as rows)."""

    method: str
    neuron_shape: tuple[int, ...]

    def _init_opt(self, initial: Tensor, spec: OPTSpec, generator: torch.Generator | None) -> None:
        """``initial``: (n, *neuron_shape), the layer's own initialisation (its scale is kept)."""
        self.method = spec.method
        self.neuron_shape = tuple(initial.shape[1:])
        n = initial.shape[0]
        d = math.prod(self.neuron_shape)
        std = float(initial.float().std()) if initial.numel() > 1 else 1.0
        v = torch.randn((n, d), generator=generator) * std  # zero-mean Gaussian (Theorem 1)
        if spec.v_shift:
            common = F.normalize(torch.randn(d, generator=generator), dim=0)
            v = v + spec.v_shift * std * math.sqrt(d) * common
        if spec.normalize_v:
            v = F.normalize(v, dim=1)
        if spec.learn_v:
            self.v = nn.Parameter(v)
        else:
            self.register_buffer("v", v)
        # S-OPT on a layer whose neurons have at most p dimensions (the first layer) is full OPT
        self.stochastic_dims = spec.stochastic_dims if spec.stochastic_dims < d else 0
        if self.stochastic_dims:
            self.block_size, blocks = self.stochastic_dims, 1
            self.register_buffer("dims", torch.randperm(d, generator=generator)[: spec.stochastic_dims])
        else:
            self.block_size = min(spec.block_size or d, d)  # a layer no wider than a block: one full R
            if d % self.block_size:
                raise ValueError(f"block_size {spec.block_size} does not divide the neuron dimension {d}")
            blocks = 1 if spec.shared_blocks else d // self.block_size
        shape = (blocks, self.block_size, self.block_size)
        self.rotation_parameter = nn.Parameter(self._initial_parameter(shape, generator))

    def _initial_parameter(self, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
        if self.method == "cp":
            return torch.zeros(shape)
        if self.stochastic_dims:  # R_p starts at the identity (Algorithm 1)
            return torch.eye(shape[-1]).expand(shape).clone()
        if self.method in ("gs", "hr", "ls"):
            return torch.randn(shape, generator=generator)
        return random_orthogonal(shape, generator)

    @property
    def neuron_dim(self) -> int:
        return int(self.v.shape[1])

    def rotation_blocks(self) -> Tensor:
        """``R``'s diagonal blocks (1 or d/b, b, b); for S-OPT the ``p x p`` ``R_p``."""
        return orthogonal_from(self.rotation_parameter, self.method)

    def rotation(self) -> Tensor:
        """The full ``d x d`` ``R`` (S-OPT: the identity with ``R_p`` on the chosen coordinates)."""
        blocks = self.rotation_blocks()
        d = self.neuron_dim
        if self.stochastic_dims:
            full = torch.eye(d, dtype=blocks.dtype, device=blocks.device)
            index = self.dims
            return full.index_put((index[:, None], index[None, :]), blocks[0])
        count = d // self.block_size
        blocks = blocks.expand(count, -1, -1) if blocks.shape[0] == 1 else blocks
        return torch.block_diag(*blocks.unbind(0))

    def weight_matrix(self) -> Tensor:
        """(n, d): every neuron ``R v_i`` as a row."""
        blocks = self.rotation_blocks()
        v = self.v
        if self.stochastic_dims:
            chosen = v[:, self.dims] @ blocks[0].transpose(0, 1)
            return v.index_copy(1, self.dims, chosen)
        n, b = v.shape[0], self.block_size
        grouped = v.reshape(n, -1, b).transpose(0, 1)  # (k, n, b)
        return (grouped @ blocks.transpose(-1, -2)).transpose(0, 1).reshape(n, -1)

    @property
    def weight(self) -> Tensor:
        """The layer's effective weight, shaped as the plain layer's."""
        return self.weight_matrix().reshape((-1, *self.neuron_shape))


class OPTConv2d(_OPTBase):
    """A convolution whose kernels are ``R v`` (numeric zero padding, any stride/dilation/groups)."""

    def __init__(self, conv: nn.Conv2d, spec: OPTSpec, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError("OPT convolutions support numeric zero padding only")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride = conv.kernel_size, conv.stride
        self.padding, self.dilation, self.groups = conv.padding, conv.dilation, conv.groups
        self._init_opt(conv.weight.detach(), spec, generator)
        self.bias = nn.Parameter(conv.bias.detach().clone()) if conv.bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def folded(self) -> nn.Conv2d:
        """A plain ``nn.Conv2d`` with this layer's current weight and bias."""
        conv = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self.dilation, self.groups, bias=self.bias is not None,
        )  # fmt: skip
        _copy_into(conv, self)
        return conv

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, " + _opt_repr(self)


class OPTLinear(_OPTBase):
    """A fully connected layer whose rows are ``R v``."""

    def __init__(self, linear: nn.Linear, spec: OPTSpec, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._init_opt(linear.weight.detach(), spec, generator)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_matrix(), self.bias)

    def folded(self) -> nn.Linear:
        """A plain ``nn.Linear`` with this layer's current weight and bias."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        _copy_into(linear, self)
        return linear

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, " + _opt_repr(self)


class OPTClassifierWeight(_OPTBase):
    """CLS-OPT: a parametrisation that makes a classifier's (C, D) ``weight`` equal to ``R v``.

    Registered with ``torch.nn.utils.parametrize`` on a loss head (:func:`apply_classifier_opt`);
    the head's original weight tensor stays in the state dict, unused (it gets no gradient).
    """

    def __init__(self, weight: Tensor, spec: OPTSpec, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self._init_opt(weight.detach(), spec, generator)
        self.bias = None

    def forward(self, _original: Tensor) -> Tensor:
        return self.weight_matrix()


OPT_LAYERS = (OPTConv2d, OPTLinear, OPTClassifierWeight)


def _opt_repr(layer: _OPTBase) -> str:
    extra = f", p={layer.stochastic_dims}" if layer.stochastic_dims else ""
    return (
        f"method={layer.method}, block={layer.block_size}, blocks={layer.rotation_parameter.shape[0]}{extra}"
    )


@torch.no_grad()
def _copy_into(plain: nn.Conv2d | nn.Linear, layer: _OPTBase) -> None:
    plain.to(device=layer.v.device)
    plain.weight.copy_(layer.weight.to(plain.weight.dtype))
    if layer.bias is not None:
        assert plain.bias is not None
        plain.bias.copy_(layer.bias)


# ------------------------------------------------------------------------------------------------
# Whole networks
# ------------------------------------------------------------------------------------------------


def opt_layers(module: nn.Module) -> Iterator[_OPTBase]:
    """Every OPT layer of ``module``."""
    return (m for m in module.modules() if isinstance(m, OPT_LAYERS))


def _replace_layers(net: nn.Module, make: Any, skip: tuple[str, ...]) -> nn.Module:
    for parent_name, parent in list(net.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if qualified in skip:
                continue
            new = make(qualified, child)
            if new is not None:
                setattr(parent, name, new)
    return net


def _check_rotation_size(name: str, d: int, spec: OPTSpec) -> None:
    """Refuse a full ``R`` beyond :data:`MAX_FULL_DIM`, saying what to do instead."""
    if spec.block_size or spec.stochastic_dims or d <= MAX_FULL_DIM:
        return
    raise ValueError(
        f"layer {name} has neurons of dimension {d}: a full {d} x {d} R would hold {d * d:,} numbers. "
        f'Set opt_options.block_size (a divisor of {d}), stochastic_dims (S-OPT), or skip = ["{name}"]'
    )


def convert_to_opt(
    net: nn.Module, spec: OPTSpec, skip: tuple[str, ...] = (), generator: torch.Generator | None = None
) -> nn.Module:
    """Replace every ``nn.Conv2d`` and ``nn.Linear`` of ``net`` (except the qualified names in ``skip``).

    Each new layer draws its own Gaussian ``v`` with the replaced layer's weight scale. Returns ``net``.
    """

    def make(name: str, child: nn.Module) -> nn.Module | None:
        if isinstance(child, (nn.Conv2d, nn.Linear)):
            _check_rotation_size(name, child.weight[0].numel(), spec)
        if isinstance(child, nn.Conv2d):
            return OPTConv2d(child, spec, generator)
        if isinstance(child, nn.Linear):
            return OPTLinear(child, spec, generator)
        return None

    return _replace_layers(net, make, skip)


def apply_classifier_opt(
    head: nn.Module, spec: OPTSpec, generator: torch.Generator | None = None
) -> nn.Module:
    """CLS-OPT: the head's ``weight`` (C, D) becomes ``R v`` (D x D ``R``). Returns ``head``."""
    from torch.nn.utils import parametrize

    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(head).__name__} has no (classes, features) weight for CLS-OPT")
    _check_rotation_size("classifier", weight.shape[1], spec)
    parametrize.register_parametrization(
        head, "weight", OPTClassifierWeight(weight, spec, generator), unsafe=True
    )
    return head


def fold_opt(net: nn.Module) -> nn.Module:
    """Replace every OPT layer by the plain layer it computes (for export). Returns ``net``."""
    return _replace_layers(
        net, lambda _, child: child.folded() if isinstance(child, OPT_LAYERS) else None, ()
    )


@dataclass
class OPTSettings:
    """A network's OPT choice as the trainer's config states it (``opt = "none"``: plain training).

    ``skip``: qualified names of layers trained as usual (the papers leave the classifier alone; in
    a face network the classifier is the loss head, outside the backbone this is applied to).
    """

    method: str = "none"
    options: dict[str, Any] | None = None
    skip: tuple[str, ...] = ()

    def apply(self, net: nn.Module) -> nn.Module:
        if self.method == "none":
            return net
        return convert_to_opt(net, OPTSpec.from_options(self.method, self.options), self.skip)


# ------------------------------------------------------------------------------------------------
# Training-time operations
# ------------------------------------------------------------------------------------------------


def relaxed_orthogonality_penalty(module: nn.Module) -> Tensor:
    """Sum over ``or`` layers of ``||U^T U - I||_F^2`` (Eq. 5, without its weight beta)."""
    total: Tensor | None = None
    for layer in opt_layers(module):
        if layer.method != "or":
            continue
        u = layer.rotation_parameter.float()
        gram = u.transpose(-1, -2) @ u
        eye = torch.eye(gram.shape[-1], device=gram.device)
        term = (gram - eye).square().sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the network has no OPT layers with method 'or' to penalise")
    return total


def rotation_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameter behind ``R`` of every OPT layer (``U``, the Cayley ``A``, or ``R`` itself)."""
    return [layer.rotation_parameter for layer in opt_layers(module)]


def ogd_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The ``R`` of every ``ogd`` layer: updated by :func:`ogd_step_`, never by the optimiser."""
    return [layer.rotation_parameter for layer in opt_layers(module) if layer.method == "ogd"]


@torch.no_grad()
def cayley_step(r: Tensor, grad: Tensor, lr: float, iterations: int = 2) -> Tensor:
    """One orthogonality-preserving descent step of ``r`` (..., d, d) along ``-grad`` (Eq. 3-4).

    ``W_hat = G R^T - 1/2 R (R^T G R^T)``, ``W = W_hat - W_hat^T``, and ``Y = R - (a/2) W (R + Y)``
    by ``iterations`` fixed-point steps from ``Y = R - a W R``; ``a = min(lr, OGD_MAX_STEP / ||W||)``.
    For small ``a`` this is ``R - a (G - R G^T R) / 2``-like descent that stays on the manifold to
    ``O(a^(iterations + 2))``.
    """
    rt = r.transpose(-1, -2)
    w_hat = grad @ rt - 0.5 * r @ (rt @ grad @ rt)
    w = w_hat - w_hat.transpose(-1, -2)
    norm = torch.linalg.matrix_norm(w).amax().item()
    step = min(lr, OGD_MAX_STEP / (norm + 1e-12))
    y = r - step * (w @ r)
    for _ in range(iterations):
        y = r - 0.5 * step * (w @ (r + y))
    return y


@torch.no_grad()
def ogd_step_(module: nn.Module, lr: float, iterations: int = 2) -> None:
    """Move every ``ogd`` layer's ``R`` by :func:`cayley_step` with its gradient, then clear the gradient."""
    for param in ogd_parameters(module):
        if param.grad is None:
            continue
        param.copy_(cayley_step(param, param.grad, lr, iterations))
        param.grad = None


@torch.no_grad()
def stochastic_outer_step_(module: nn.Module, generator: torch.Generator | None = None) -> list[nn.Parameter]:
    """S-OPT's outer step (Algorithm 1, step 4): fold ``R_p`` into ``v``, draw new coordinates, reset ``R_p``.

    Returns the reset parameters: their optimiser state (momentum) must be cleared by the caller.
    """
    reset = []
    for layer in opt_layers(module):
        if not layer.stochastic_dims:
            continue
        layer.v.copy_(layer.weight_matrix())
        d = layer.neuron_dim
        device = generator.device if generator is not None else torch.device("cpu")
        picked = torch.randperm(d, generator=generator, device=device)[: layer.stochastic_dims]
        layer.dims.copy_(picked.to(layer.dims.device))
        layer.rotation_parameter.copy_(layer._initial_parameter(tuple(layer.rotation_parameter.shape), None))
        reset.append(layer.rotation_parameter)
    return reset


@torch.no_grad()
def orthogonality_error(module: nn.Module) -> float:
    """The largest ``max |R^T R - I|`` over the network's OPT layers (0.0 when it has none)."""
    worst = 0.0
    for layer in opt_layers(module):
        r = layer.rotation_blocks().double()
        eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
        worst = max(worst, float((r.transpose(-1, -2) @ r - eye).abs().max()))
    return worst


def trainable_rotation_parameters(module: nn.Module) -> int:
    """How many numbers the OPT layers learn (``R`` parameters, plus ``v`` when it is learnable)."""
    total = 0
    for layer in opt_layers(module):
        total += layer.rotation_parameter.numel()
        if isinstance(layer.v, nn.Parameter):
            total += layer.v.numel()
    return total
