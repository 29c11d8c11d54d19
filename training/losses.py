"""Classifier heads ("FC2") and hyperspherical regularisers for SphereFace / SphereFace+ (pure torch).

Every head is built as ``Head(embedding_size, num_classes, **options)`` and called as
``head(features (N, D), labels (N,) int64, step=0) -> HeadOutput``. ``HeadOutput.loss`` is the mean
loss over the batch (regulariser included), ``HeadOutput.logits`` (N, C) are the logits used for
prediction (no margin: for angular heads ``||x|| cos(theta)``, so argmax is the class of smallest
angle) and ``HeadOutput.extras`` holds logged numbers as python floats. The classifier weight is
always ``head.weight`` of shape (C, D), initialised by Caffe's ``xavier`` filler (as fc6 in the
authors' Caffe model: rows of norm ≈ 1). Heads compute in float32 with autocast disabled,
whatever the dtype of the features.

Heads (``HEADS`` / :func:`build_head`):

* ``softmax`` -- :class:`SoftmaxHead`: linear layer with bias + cross-entropy (Eq. 2.16).
* ``modified_softmax`` -- :class:`ModifiedSoftmaxHead`: ``||W_j|| = 1``, ``b = 0``, feature norm
  kept (Eq. 2.18).
* ``asoftmax`` -- :class:`ASoftmaxHead`: SphereFace A-Softmax, target logit ``||x|| psi(theta_y)``
  (Eq. 2.20) with ``cos(m theta)`` from the multi-angle polynomial (Eq. 2.7) and the lambda
  annealing of thesis App. A.7 (:class:`LambdaSchedule`, the authors' Caffe schedule).
* ``sphereface_plus`` -- :class:`SphereFacePlusHead`: A-Softmax + output-layer MHE in the
  data-dependent mini-batch form of Eq. 5.8.
* ``cosface`` -- :class:`CosFaceHead`: normalised features and weights, target ``s (cos - m)``.
* ``arcface`` -- :class:`ArcFaceHead`: normalised features and weights, target ``s cos(theta + m)``
  (with a continuous, monotone fallback past ``theta = pi - m``, see :func:`arc_margin_cos`).
* ``w_softmax`` / ``ga_softmax`` / ``s_softmax`` -- SphereNet's losses (SphereNet §3):
  :class:`WSoftmaxHead` (Eq. 10, logits ``||x|| g(theta)``), :class:`GASoftmaxHead` (Eq. 11,
  target ``||x|| g(m theta)``; the cosine one is A-Softmax) and :class:`SSoftmaxHead`
  (``s g(theta)``), for ``g`` linear, cosine or sigmoid (:mod:`models.nets.hyperspherical`).

Regularisers: :func:`mhe_energy` (Eq. 5.1 normalised per layer as in Eq. 5.4; half-space and
angular variants, thesis §5.3.4-5.3.5), :func:`output_mhe_loss` (Eq. 5.8 term) and :class:`HiddenMHE`
(Eq. 5.4 hidden-layer term, with the random-neuron mini-batch approximation of thesis §5.3.6).

Numerics shared by every MHE function (the project's choice; the papers give none): the Euclidean distance
between unit vectors is computed from their dot product as ``d = sqrt(max(2 - 2 w_i.w_j, 0) + eps)``
with ``eps = MHE_EPS = 1e-6`` (so ``d >= 1e-3`` and duplicated neurons give a finite energy and a
finite gradient); the angular distance is ``arccos(clamp(w_i.w_j, -1 + 1e-6, 1 - 1e-6))``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.nets.hyperspherical import ACOS_MARGIN, angular_activation, angular_of_theta
from models.nets.init import caffe_xavier_uniform_

__all__ = [
    "HEADS",
    "MHE_EPS",
    "ASoftmaxHead",
    "ArcFaceHead",
    "CosFaceHead",
    "GASoftmaxHead",
    "SSoftmaxHead",
    "WSoftmaxHead",
    "HeadOutput",
    "HiddenMHE",
    "LambdaSchedule",
    "ModifiedSoftmaxHead",
    "SoftmaxHead",
    "SphereFacePlusHead",
    "BACKWARDS",
    "CaffeMarginLogits",
    "arc_margin_cos",
    "build_head",
    "cos_m_theta",
    "mhe_energy",
    "output_mhe_loss",
    "psi",
    "psi_slope",
]

MHE_EPS = 1e-6
"""Added to the squared Euclidean distance inside the MHE kernels (and the arccos clamp margin)."""

DISTANCES = ("euclidean", "angular")


@dataclass
class HeadOutput:
    """What a head returns.

    ``loss``: scalar float32 tensor, mean over the batch, regulariser included.
    ``logits``: (N, C) float32 prediction logits without margin (detached).
    ``extras``: logged numbers, e.g. ``{"lambda": 5.0, "mhe": 0.97, "ce": 2.3}``: python floats,
    or detached scalar tensors where reading the value would wait for the device (the trainer
    reads them once per logging interval, never per step).
    """

    loss: Tensor
    logits: Tensor
    extras: dict[str, float | Tensor] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# A-Softmax building blocks
# ----------------------------------------------------------------------------------------------


def _check_margin(m: object, low: int = 1, high: int | None = None) -> int:
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):
        raise ValueError(f"the angular margin m must be an integer, got {m!r}")
    if m < low or (high is not None and m > high):
        upper = "" if high is None else f"..{high}"
        raise ValueError(f"the angular margin m must be in {low}{upper}, got {m}")
    return int(m)


def cos_m_theta(c: Tensor, m: int) -> Tensor:
    """``cos(m theta)`` as a polynomial in ``c = cos(theta)`` (Eq. 2.7), without any arccos.

    ``c``: any shape, values in [-1, 1]; ``m``: integer >= 1. Returns a tensor like ``c`` in [-1, 1].
    """
    m = _check_margin(m)
    sin_sq = 1.0 - c * c
    # Eq. 2.7: cos(m theta) = sum_n (-1)^n C(m, 2n) c^(m-2n) (1 - c^2)^n
    out = torch.zeros_like(c)
    for n in range(m // 2 + 1):
        out = out + ((-1) ** n * math.comb(m, 2 * n)) * c ** (m - 2 * n) * sin_sq**n
    return out


def psi(c: Tensor, m: int) -> Tensor:
    """Monotone extension ``psi(theta) = (-1)^k cos(m theta) - 2k`` of ``cos(m theta)`` (Eq. 2.20).

    ``c = cos(theta)``: any shape, values in [-1, 1]; ``m``: integer >= 1. ``k`` (the index of the
    interval ``[k pi/m, (k+1) pi/m]`` holding theta) is ``sum_{j=1}^{m-1} [c <= cos(j pi/m)]``
    (thesis Eq. 2.7, §2.2.3), computed from ``c`` without arccos and without gradient. Returns values in
    ``[1 - 2m, 1]``, decreasing in theta, equal to ``cos(m theta)`` on ``[0, pi/m]``.
    """
    m = _check_margin(m)
    cos_m = cos_m_theta(c, m)  # Eq. 2.7
    k = _psi_interval(c, m)
    sign = 1.0 - 2.0 * torch.remainder(k, 2.0)
    return sign * cos_m - 2.0 * k  # Eq. 2.20


def _psi_interval(c: Tensor, m: int) -> Tensor:
    """``k`` of Eq. 2.20 (theta in ``[k pi/m, (k+1) pi/m]``) from ``c = cos(theta)``; detached, dtype of c."""
    c_detached = c.detach()
    k = torch.zeros_like(c_detached)
    for j in range(1, m):
        k = k + (c_detached <= math.cos(j * math.pi / m)).to(c.dtype)
    return k


def psi_slope(c: Tensor, m: int) -> Tensor:
    """``d psi / d cos(theta)`` at ``c = cos(theta)`` (Eq. 2.20; any shape, no gradient).

    ``cos(m theta)`` is the Chebyshev polynomial ``T_m(c)`` (Eq. 2.7), whose derivative is
    ``m U_{m-1}(c)`` with ``U_0 = 1``, ``U_1 = 2c``, ``U_{n+1} = 2c U_n - U_{n-1}``; psi multiplies
    it by ``(-1)^k``. For m = 4 on the first interval: ``32 c^3 - 16 c``.
    """
    m = _check_margin(m)
    c = c.detach()
    previous, current = torch.ones_like(c), 2.0 * c
    if m == 1:
        current = previous
    for _ in range(m - 2):
        previous, current = current, 2.0 * c * current - previous
    sign = 1.0 - 2.0 * torch.remainder(_psi_interval(c, m), 2.0)
    return sign * m * current


@dataclass(frozen=True)
class LambdaSchedule:
    """Annealing weight ``lambda = max(minimum, base (1 + gamma i)^(-power))`` (thesis App. A.7).

    The defaults are the authors' Caffe values (``base=1000, gamma=0.12, power=1, minimum=5``).
    ``i`` is Caffe's iteration counter, which ``MarginInnerProductLayer::Forward`` increments
    *before* computing lambda: the first forward pass uses ``i = 1``. Called with the 0-based
    optimiser step ``t``, the schedule therefore uses ``i = t + 1``: lambda is 892.86 at step 0,
    454.5 at step 9, and first reaches the floor 5 at step 1658 (Caffe iteration 1659, about one
    CASIA-WebFace epoch of batch 256).
    """

    base: float = 1000.0
    gamma: float = 0.12
    power: float = 1.0
    minimum: float = 5.0

    def __call__(self, step: int) -> float:
        """lambda at 0-based optimiser step ``step`` (a float >= ``minimum``)."""
        iteration = step + 1  # Caffe increments its counter before the first lambda
        return max(self.minimum, self.base * (1.0 + self.gamma * iteration) ** (-self.power))

    def floor_step(self) -> int:
        """The first 0-based step at which lambda equals ``minimum`` (1658 for the defaults)."""
        if self.minimum <= 0 or self.base <= self.minimum:
            return 0
        iteration = ((self.base / self.minimum) ** (1.0 / self.power) - 1.0) / self.gamma
        return max(0, math.ceil(iteration - 1e-9) - 1)

    def reaching_floor_at(self, step: float) -> LambdaSchedule:
        """The same schedule with ``gamma`` chosen so that lambda reaches ``minimum`` at ``step``.

        Solves ``base * (1 + gamma * (step + 1)) ** -power = minimum``. An option for experiments
        that want the softmax-like warm phase to last a given number of epochs; the papers' runs
        use the unchanged schedule.
        """
        if step <= 0 or self.minimum <= 0 or self.base <= self.minimum:
            raise ValueError("need step > 0 and base > minimum > 0")
        return replace(self, gamma=((self.base / self.minimum) ** (1.0 / self.power) - 1.0) / (step + 1))


DEFAULT_LAMBDA_SCHEDULE = LambdaSchedule()

LambdaLike = LambdaSchedule | Callable[[int], float] | float | None


def _lambda_at(schedule: LambdaLike, step: int) -> float:
    if schedule is None:
        return 0.0
    if isinstance(schedule, numbers.Real):
        return float(schedule)
    return float(schedule(step))


def _init_classifier(weight: Tensor) -> None:
    """Caffe's ``xavier`` filler on the (C, D) classifier: U(±sqrt(3 / D)), rows of norm ≈ 1."""
    caffe_xavier_uniform_(weight)


def _autocast_off(tensor: Tensor) -> torch.autocast:
    """Context that disables autocast on the device of ``tensor`` (heads compute in float32)."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


#: How an A-Softmax head differentiates its logits (``head_options.backward``): ``"autograd"``, the
#: exact gradient of Eq. 2.20 with the App. A.7 annealing (the default), or ``"caffe"``, the
#: backward pass of the authors' released Caffe layer (:class:`CaffeMarginLogits`).
BACKWARDS = ("autograd", "caffe")


def _margin_forward(features: Tensor, unit_weight: Tensor, labels: Tensor, lam: float, m: int) -> Tensor:
    """A-Softmax logits (N, C): ``||x|| cos(theta_j)`` and the annealed target of Eq. 2.20 / App. A.7."""
    logits = features @ unit_weight.t()
    x_norm = features.norm(dim=1, keepdim=True)
    cos = (logits / x_norm.clamp_min(1e-12)).clamp(-1.0, 1.0)
    index = labels.view(-1, 1)
    cos_y = cos.gather(1, index)
    return logits.scatter(1, index, x_norm * (lam * cos_y + psi(cos_y, m)) / (1.0 + lam))


class CaffeMarginLogits(torch.autograd.Function):
    """The A-Softmax logits with the backward pass of the authors' released Caffe layer.

    ``apply(features (N, D) float32, weight (C, D), labels (N,) int64, lam, m)`` returns the
    same (N, C) logits as :class:`ASoftmaxHead` (Eq. 2.20 with the App. A.7 annealing; the
    rows of ``weight`` are normalised inside). The backward differs from the exact gradient
    in two places, as the released ``MarginInnerProductLayer`` computes them:

    * features: the target logit ``||x|| psi(theta_y)`` has the gradient
      ``a w_y + b x`` with ``a = psi'(c)`` and ``b = (psi(c) - c psi'(c)) / ||x||``
      (``c = cos(theta_y)``); the layer divides it by ``sqrt(a^2 + b^2)`` (the authors call
      it a normalised gradient, a per-sample learning rate). The annealed part
      ``lambda / (1 + lambda) ||x|| cos(theta_y)`` and the other logits pass the plain
      inner-product gradient ``w_j``. For m = 1 every logit is the plain inner product.
    * classifier: the gradient is that of a plain inner product, ``grad^T x`` for every
      logit (margin and annealing ignored), and it reaches the stored rows without the
      projection through the normalisation. The Caffe layer rescales its rows to unit
      norm in place on each forward pass; the trainer keeps the rows at unit norm after
      each step (``renormalise_``), so the stored rows are the normalised ones.
    """

    @staticmethod
    def forward(ctx: Any, features: Tensor, weight: Tensor, labels: Tensor, lam: float, m: int) -> Tensor:
        unit = F.normalize(weight, dim=1)
        ctx.save_for_backward(features, unit, labels)
        ctx.lam, ctx.m = float(lam), int(m)
        return _margin_forward(features, unit, labels, float(lam), int(m))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        features, unit, labels = ctx.saved_tensors
        grad_weight = grad.t() @ features  # plain inner-product gradient on the unit rows
        if ctx.m == 1:
            return grad @ unit, grad_weight, None, None, None
        lam, index = ctx.lam, labels.view(-1, 1)
        grad_y = grad.gather(1, index)
        plain = grad.scatter(1, index, grad_y * lam / (1.0 + lam))  # lambda/(1+lambda) w_y on the target
        x_norm = features.norm(dim=1, keepdim=True)
        cos_y = (features * unit[labels]).sum(1, keepdim=True) / x_norm
        coeff_w = psi_slope(cos_y, ctx.m)
        coeff_x = (psi(cos_y, ctx.m) - cos_y * coeff_w) / x_norm
        scale = grad_y / ((1.0 + lam) * torch.sqrt(coeff_w * coeff_w + coeff_x * coeff_x))
        grad_features = plain @ unit + scale * (coeff_w * unit[labels] + coeff_x * features)
        return grad_features, grad_weight, None, None, None


# ----------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------


class SoftmaxHead(nn.Module):
    """Plain softmax classifier: ``f_j = W_j.x + b_j`` and cross-entropy (Eq. 2.16)."""

    def __init__(self, embedding_size: int, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        self.bias = nn.Parameter(torch.zeros(num_classes))
        _init_classifier(self.weight)

    def forward(self, features: Tensor, labels: Tensor, step: int = 0) -> HeadOutput:
        """``features`` (N, D), ``labels`` (N,) int64 in [0, C); ``step`` is ignored."""
        with _autocast_off(features):
            logits = F.linear(features.float(), self.weight.float(), self.bias.float())  # Eq. 2.16
            loss = F.cross_entropy(logits, labels)
        return HeadOutput(loss=loss, logits=logits.detach())


class ASoftmaxHead(nn.Module):
    """SphereFace A-Softmax classifier (Eq. 2.20) with lambda annealing (thesis App. A.7).

    Weights are normalised to unit norm on every forward (inside the computation; the parameter is
    not modified), there is no bias, and the feature norm is kept. With ``c_j = cos(theta_j)``:

    * non-target logits: ``||x|| c_j`` (Eq. 2.18);
    * target logit: ``(lambda ||x|| c_y + ||x|| psi(theta_y)) / (1 + lambda)`` with ``psi`` of Eq. 2.20.

    ``m``: integer margin in 1..4 (``m = 1`` is exactly the modified softmax). ``lambda_schedule``:
    a :class:`LambdaSchedule` (or any ``step -> float`` callable, or a constant float); ``None``
    means ``lambda = 0``, the pure A-Softmax loss. ``backward``: ``"autograd"`` (the exact
    gradient) or ``"caffe"`` (the released Caffe layer's backward, :class:`CaffeMarginLogits`;
    same loss values). ``extras``: ``{"lambda": lambda}``.
    """

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        m: int = 4,
        lambda_schedule: LambdaLike = DEFAULT_LAMBDA_SCHEDULE,
        backward: str = "autograd",
    ) -> None:
        super().__init__()
        self.m = _check_margin(m, 1, 4)
        self.lambda_schedule = lambda_schedule
        if backward not in BACKWARDS:
            raise ValueError(f"unknown backward {backward!r}: use one of {', '.join(BACKWARDS)}")
        self.backward = backward
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        _init_classifier(self.weight)

    @torch.no_grad()
    def renormalise_(self) -> None:
        """Scale every classifier row to unit norm in place (the trainer calls it after each step).

        The authors' Caffe layer rescales its weight blob to unit rows on every forward pass, so
        the classifier's angular step size does not grow as weight decay shrinks the rows. The
        forward pass normalises anyway; this only keeps the stored parameter on the sphere.
        """
        self.weight.div_(self.weight.norm(dim=1, keepdim=True).clamp_min(1e-12))

    def _cosine_logits(self, features: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(``||x||`` (N, 1), ``cos(theta)`` (N, C) clamped to [-1, 1], ``||x|| cos(theta)`` (N, C))."""
        x = features.float()
        w = F.normalize(self.weight.float(), dim=1)  # ||W_j|| = 1 on every forward (Eq. 2.18)
        logits = x @ w.t()
        x_norm = x.norm(dim=1, keepdim=True)
        cos = (logits / x_norm.clamp_min(1e-12)).clamp(-1.0, 1.0)
        return x_norm, cos, logits

    def margin_logits(self, features: Tensor, labels: Tensor, step: int = 0) -> Tensor:
        """The (N, C) float32 logits fed to the cross-entropy at ``step`` (target logit with margin)."""
        with _autocast_off(features):
            return self._margin_and_plain(features, labels, _lambda_at(self.lambda_schedule, step))[0]

    def _margin_and_plain(self, features: Tensor, labels: Tensor, lam: float) -> tuple[Tensor, Tensor]:
        """(logits with margin (N, C), prediction logits ``||x|| cos(theta_j)`` (N, C)), in float32."""
        if self.backward == "caffe":
            x = features.float()
            margin = CaffeMarginLogits.apply(x, self.weight.float(), labels, lam, self.m)
            plain = x.detach() @ F.normalize(self.weight.detach().float(), dim=1).t()
            return margin, plain
        x_norm, cos, logits = self._cosine_logits(features)
        return self._apply_margin(x_norm, cos, logits, labels, lam), logits

    def _apply_margin(
        self, x_norm: Tensor, cos: Tensor, logits: Tensor, labels: Tensor, lam: float
    ) -> Tensor:
        index = labels.view(-1, 1)
        cos_y = cos.gather(1, index)
        # thesis App. A.7 annealing of the Eq. 2.20 target logit; non-target logits stay ||x|| cos(theta_j)
        target = x_norm * (lam * cos_y + psi(cos_y, self.m)) / (1.0 + lam)
        return logits.scatter(1, index, target)

    def forward(self, features: Tensor, labels: Tensor, step: int = 0) -> HeadOutput:
        """``features`` (N, D), ``labels`` (N,) int64 in [0, C), ``step``: optimiser step for lambda."""
        lam = _lambda_at(self.lambda_schedule, step)
        with _autocast_off(features):
            margin, logits = self._margin_and_plain(features, labels, lam)
            loss = F.cross_entropy(margin, labels)
        return HeadOutput(loss=loss, logits=logits.detach(), extras={"lambda": lam})


class ModifiedSoftmaxHead(ASoftmaxHead):
    """Modified softmax (Eq. 2.18): A-Softmax with ``m = 1`` and no annealing."""

    def __init__(self, embedding_size: int, num_classes: int) -> None:
        super().__init__(embedding_size, num_classes, m=1, lambda_schedule=None)


#: SphereFace+'s MHE term (``mhe_form``): ``"eq5.8"``, the thesis' Eq. 5.8 (the default), or
#: ``"caffe_among"``, the gradient of the authors' released Caffe layer (:func:`caffe_among_mhe_loss`).
MHE_FORMS = ("eq5.8", "caffe_among")


class SphereFacePlusHead(ASoftmaxHead):
    """SphereFace+ (Eq. 5.8): A-Softmax + ``mhe_weight`` x output-layer MHE (mini-batch form).

    The MHE term is :func:`output_mhe_loss` over the normalised classifier neurons:
    ``1/(B (C-1)) sum_i sum_{j != y_i} f_s(d(w_{y_i}, w_j))``. Defaults follow the papers
    (full-space, Euclidean, ``s = 2``, weight ``lambda_o = 1``; the authors' Caffe finetune used 10).
    ``mhe_form="caffe_among"`` replaces the term by the released Caffe layer's update
    (:func:`caffe_among_mhe_loss`; ``mhe_power`` and ``mhe_distance`` do not apply to it).
    ``extras``: ``{"lambda", "mhe" (unweighted term; for the Caffe form the layer's output D),
    "ce" (A-Softmax loss)}``.
    """

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        m: int = 4,
        lambda_schedule: LambdaLike = DEFAULT_LAMBDA_SCHEDULE,
        mhe_weight: float = 1.0,
        mhe_power: int = 2,
        mhe_distance: str = "euclidean",
        mhe_form: str = "eq5.8",
        backward: str = "autograd",
    ) -> None:
        super().__init__(embedding_size, num_classes, m=m, lambda_schedule=lambda_schedule, backward=backward)
        _check_kernel(mhe_power, mhe_distance)
        if mhe_form not in MHE_FORMS:
            raise ValueError(f"unknown mhe_form {mhe_form!r}: use one of {', '.join(MHE_FORMS)}")
        self.mhe_weight = float(mhe_weight)
        self.mhe_power = mhe_power
        self.mhe_distance = mhe_distance
        self.mhe_form = mhe_form

    def mhe_term(self, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(the unweighted term added to the loss, the number logged as ``mhe``) for a batch."""
        weight = self.weight.float()
        if self.mhe_form == "caffe_among":
            return caffe_among_term_and_distance(weight, labels)
        term = output_mhe_loss(weight, labels, self.mhe_power, self.mhe_distance)
        return term, term.detach()

    def forward(self, features: Tensor, labels: Tensor, step: int = 0) -> HeadOutput:
        """``features`` (N, D), ``labels`` (N,) int64 in [0, C), ``step``: optimiser step for lambda."""
        asoftmax = super().forward(features, labels, step)
        with _autocast_off(features):
            mhe, logged = self.mhe_term(labels)
        loss = asoftmax.loss + self.mhe_weight * mhe  # Eq. 5.8
        extras = {**asoftmax.extras, "mhe": logged, "ce": asoftmax.loss.detach()}
        return HeadOutput(loss=loss, logits=asoftmax.logits, extras=extras)


class _NormalisedMarginHead(nn.Module):
    """Shared part of CosFace / ArcFace: ``s cos(theta)`` logits with a margin on the target."""

    def __init__(self, embedding_size: int, num_classes: int, scale: float, margin: float) -> None:
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = float(scale)
        self.margin = float(margin)
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        _init_classifier(self.weight)

    def _target_cos(self, cos_y: Tensor) -> Tensor:
        raise NotImplementedError

    def _cos(self, features: Tensor) -> Tensor:
        x = F.normalize(features.float(), dim=1)
        w = F.normalize(self.weight.float(), dim=1)
        return (x @ w.t()).clamp(-1.0, 1.0)

    def _margin(self, cos: Tensor, labels: Tensor) -> Tensor:
        index = labels.view(-1, 1)
        return self.scale * cos.scatter(1, index, self._target_cos(cos.gather(1, index)))

    def margin_logits(self, features: Tensor, labels: Tensor, step: int = 0) -> Tensor:
        """The (N, C) float32 logits fed to the cross-entropy (``s`` x target cosine with margin)."""
        with _autocast_off(features):
            return self._margin(self._cos(features), labels)

    def forward(self, features: Tensor, labels: Tensor, step: int = 0) -> HeadOutput:
        """``features`` (N, D), ``labels`` (N,) int64 in [0, C); ``step`` is ignored."""
        with _autocast_off(features):
            cos = self._cos(features)
            loss = F.cross_entropy(self._margin(cos, labels), labels)
        return HeadOutput(loss=loss, logits=(self.scale * cos).detach())


class CosFaceHead(_NormalisedMarginHead):
    """CosFace / AM-Softmax: normalised x and W, target logit ``s (cos(theta_y) - m)``."""

    def __init__(self, embedding_size: int, num_classes: int, scale: float = 30.0, margin: float = 0.35):
        super().__init__(embedding_size, num_classes, scale, margin)

    def _target_cos(self, cos_y: Tensor) -> Tensor:
        return cos_y - self.margin


def _check_arc_margin(margin: float) -> None:
    if not 0.0 <= margin < math.pi:
        raise ValueError(f"ArcFace margin must be in [0, pi), got {margin}")


def arc_margin_cos(c: Tensor, margin: float) -> Tensor:
    """ArcFace target cosine ``cos(theta + m)`` from ``c = cos(theta)`` in [-1, 1], ``0 <= m < pi``.

    Past ``theta = pi - m`` the cosine would increase again, so there the value is continued as
    ``-2 - cos(theta + m)`` (the reflection used by SphereFace's psi with k = 1): it equals -1 at
    ``theta = pi - m``, keeps decreasing down to ``-2 + cos(m)`` at ``theta = pi``, has the same
    (zero) slope on both sides of the switch, and stays <= cos(theta). Output in [-2, 1].
    """
    _check_arc_margin(margin)
    sin = (1.0 - c * c).clamp_min(torch.finfo(c.dtype).eps).sqrt()  # bounded gradient at c = +-1
    cos_plus = c * math.cos(margin) - sin * math.sin(margin)  # cos(theta + m)
    return torch.where(c >= -math.cos(margin), cos_plus, -2.0 - cos_plus)


class ArcFaceHead(_NormalisedMarginHead):
    """ArcFace: normalised x and W, target logit ``s cos(theta_y + m)`` (see :func:`arc_margin_cos`)."""

    def __init__(self, embedding_size: int, num_classes: int, scale: float = 30.0, margin: float = 0.5):
        super().__init__(embedding_size, num_classes, scale, margin)
        _check_arc_margin(self.margin)

    def _target_cos(self, cos_y: Tensor) -> Tensor:
        return arc_margin_cos(cos_y, self.margin)


# ----------------------------------------------------------------------------------------------
# SphereNet's losses on the hypersphere (SphereNet §3): W-Softmax, GA-Softmax, S-Softmax
# ----------------------------------------------------------------------------------------------


def _check_angular(g: str) -> str:
    if g not in ("linear", "cosine", "sigmoid"):
        raise ValueError(f"g must be linear, cosine or sigmoid, got {g!r}")
    return g


class GASoftmaxHead(ASoftmaxHead):
    """Generalised angular softmax (SphereNet Eq. 11) with lambda annealing as A-Softmax's.

    ``||W_j|| = 1``, no bias, the feature norm kept; with ``g`` one of SphereConv's angular
    functions (``linear`` ``1 - 2 theta / pi``, ``cosine``, ``sigmoid`` with curvature ``k``):

    * non-target logits ``||x|| g(theta_j)``;
    * target logit ``||x|| (lambda g(theta_y) + g(m theta_y)) / (1 + lambda)``.

    ``g(m theta)`` is taken past ``pi`` by the monotone continuation of ``g`` (linear and sigmoid
    are monotone on the whole line); for the cosine it is A-Softmax's ``psi`` (Eq. 2.20), so the
    cosine GA-Softmax *is* A-Softmax. ``m = 1`` is W-Softmax. Prediction logits:
    ``||x|| g(theta_j)`` (argmax: the class of smallest angle, as ``g`` decreases).
    """

    def __init__(
        self,
        embedding_size: int,
        num_classes: int,
        g: str = "linear",
        m: int = 4,
        k: float = 0.3,
        lambda_schedule: LambdaLike = DEFAULT_LAMBDA_SCHEDULE,
    ) -> None:
        super().__init__(embedding_size, num_classes, m=m, lambda_schedule=lambda_schedule)
        self.g = _check_angular(g)
        if k <= 0:
            raise ValueError(f"the sigmoid curvature k must be positive, got {k}")
        self.k = float(k)

    def _cosine_logits(self, features: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x_norm, cos, _ = super()._cosine_logits(features)
        return x_norm, cos, x_norm * angular_activation(cos, self.g, self.k)

    def _target_angular(self, cos_y: Tensor) -> Tensor:
        """``g(m theta_y)`` for the target column ``cos_y`` (N, 1)."""
        if self.g == "cosine":
            return psi(cos_y, self.m)
        margin = ACOS_MARGIN.get(cos_y.dtype, 1e-6)
        theta = torch.acos(cos_y.clamp(-1.0 + margin, 1.0 - margin))
        return angular_of_theta(self.m * theta, self.g, self.k)

    def _apply_margin(
        self, x_norm: Tensor, cos: Tensor, logits: Tensor, labels: Tensor, lam: float
    ) -> Tensor:
        index = labels.view(-1, 1)
        cos_y = cos.gather(1, index)
        g_y = angular_activation(cos_y, self.g, self.k)
        target = x_norm * (lam * g_y + self._target_angular(cos_y)) / (1.0 + lam)
        return logits.scatter(1, index, target)


class WSoftmaxHead(GASoftmaxHead):
    """W-Softmax (SphereNet Eq. 10): logits ``||x|| g(theta_j)``, ``||W_j|| = 1``, no bias, no margin."""

    def __init__(self, embedding_size: int, num_classes: int, g: str = "cosine", k: float = 0.3) -> None:
        super().__init__(embedding_size, num_classes, g=g, m=1, k=k, lambda_schedule=None)


class SSoftmaxHead(nn.Module):
    """S-Softmax (SphereNet §3; thesis App. B.3): features and weights normalised, logits ``s g(theta_j)``.

    Hard to optimise from scratch at ``s = 1``; a scale ``s`` of 10 to 70 trains ([T] B.3).
    """

    def __init__(
        self, embedding_size: int, num_classes: int, scale: float = 30.0, g: str = "cosine", k: float = 0.3
    ) -> None:
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale, self.g, self.k = float(scale), _check_angular(g), float(k)
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_size))
        _init_classifier(self.weight)

    def forward(self, features: Tensor, labels: Tensor, step: int = 0) -> HeadOutput:
        """``features`` (N, D), ``labels`` (N,) int64 in [0, C); ``step`` is ignored."""
        with _autocast_off(features):
            x = F.normalize(features.float(), dim=1)
            w = F.normalize(self.weight.float(), dim=1)
            logits = self.scale * angular_activation((x @ w.t()).clamp(-1.0, 1.0), self.g, self.k)
            loss = F.cross_entropy(logits, labels)
        return HeadOutput(loss=loss, logits=logits.detach())


HEADS = (
    "softmax",
    "modified_softmax",
    "asoftmax",
    "sphereface_plus",
    "cosface",
    "arcface",
    "w_softmax",
    "ga_softmax",
    "s_softmax",
)

_HEAD_CLASSES: dict[str, type[nn.Module]] = {
    "softmax": SoftmaxHead,
    "modified_softmax": ModifiedSoftmaxHead,
    "asoftmax": ASoftmaxHead,
    "sphereface_plus": SphereFacePlusHead,
    "cosface": CosFaceHead,
    "arcface": ArcFaceHead,
    "w_softmax": WSoftmaxHead,
    "ga_softmax": GASoftmaxHead,
    "s_softmax": SSoftmaxHead,
}


def build_head(name: str, embedding_size: int, num_classes: int, **options: object) -> nn.Module:
    """Head ``name`` (one of ``HEADS``) for ``embedding_size``-d features and ``num_classes`` classes.

    ``options`` go to the head's constructor (e.g. ``m=``, ``lambda_schedule=``, ``mhe_weight=``,
    ``scale=``, ``margin=``). Raises ValueError for an unknown name.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in _HEAD_CLASSES:
        raise ValueError(f"unknown head {name!r}; choose one of {', '.join(HEADS)}")
    return _HEAD_CLASSES[key](embedding_size, num_classes, **options)


# ----------------------------------------------------------------------------------------------
# Minimum hyperspherical energy
# ----------------------------------------------------------------------------------------------


def _check_kernel(power: float, distance: str) -> None:
    if power < 0:
        raise ValueError(f"MHE power s must be >= 0, got {power}")
    if distance not in DISTANCES:
        raise ValueError(f"MHE distance must be one of {DISTANCES}, got {distance!r}")


def _kernel_from_cos(cos: Tensor, power: float, distance: str) -> Tensor:
    """``f_s(d)`` (Eq. 5.1 / Eq. 5.5) for unit vectors with dot products ``cos`` (any shape)."""
    if distance == "euclidean":
        sq = (2.0 - 2.0 * cos).clamp_min(0.0) + MHE_EPS  # ||w_i - w_j||^2 + eps
        if power == 0:
            return -0.5 * torch.log(sq)  # f_0(d) = log(1/d)
        return sq ** (-0.5 * power)  # f_s(d) = d^-s
    theta = torch.acos(cos.clamp(-1.0 + MHE_EPS, 1.0 - MHE_EPS))  # Eq. 5.5 geodesic distance
    if power == 0:
        return -torch.log(theta)
    return theta ** (-float(power))


def mhe_energy(
    weights: Tensor, power: int = 2, distance: str = "euclidean", half_space: bool = False
) -> Tensor:
    """Normalised hyperspherical energy ``E_s / (N (N-1))`` of the rows of ``weights`` (N, D).

    Eq. 5.1 over the L2-normalised rows (ordered pairs ``i != j``), divided by the number of ordered
    pairs as each layer term of Eq. 5.4. ``power`` is s >= 0 (0: logarithmic energy), ``distance``
    is ``"euclidean"`` or ``"angular"`` (A-MHE, Eq. 5.5). ``half_space=True`` adds the virtual
    neurons ``-w_i`` and normalises by ``2N (2N-1)`` (thesis §5.3.4). Returns a scalar tensor
    (0 when N < 2) differentiable w.r.t. ``weights``. Memory is O(N^2).
    """
    _check_kernel(power, distance)
    w = F.normalize(weights.reshape(weights.shape[0], -1), dim=1)
    if half_space:
        w = torch.cat([w, -w], dim=0)
    n = w.shape[0]
    if n < 2:
        return weights.sum() * 0.0
    kernel = _kernel_from_cos(w @ w.t(), power, distance)
    eye = torch.eye(n, dtype=torch.bool, device=w.device)
    return kernel.masked_fill(eye, 0.0).sum() / (n * (n - 1))  # Eq. 5.1 normalised as in Eq. 5.4


def output_mhe_loss(weights: Tensor, labels: Tensor, power: int = 2, distance: str = "euclidean") -> Tensor:
    """Data-dependent output-layer MHE of Eq. 5.8 (without its weight lambda_M).

    ``weights``: (C, D) classifier neurons (normalised here), ``labels``: (B,) int64 in [0, C).
    Returns ``1/(B (C-1)) sum_i sum_{j != y_i} f_s(d(w_{y_i}, w_j))`` (scalar, 0 when C < 2): each
    sample's class neuron against all C neurons (thesis §5.3.6).
    """
    _check_kernel(power, distance)
    w = F.normalize(weights, dim=1)
    num_classes = w.shape[0]
    if num_classes < 2 or labels.numel() == 0:
        return weights.sum() * 0.0
    kernel = _kernel_from_cos(w[labels] @ w.t(), power, distance)  # (B, C)
    own = F.one_hot(labels, num_classes).bool()
    return kernel.masked_fill(own, 0.0).sum() / (labels.numel() * (num_classes - 1))  # Eq. 5.8


def caffe_among_distance(weights: Tensor, labels: Tensor) -> Tensor:
    """The released Caffe ``InterClass`` layer's output (type AMONG, its mini-batch kernels):
    ``D = (1/N) sum_i sum_j ||w_i - w_{y_j}||^2`` over all N normalised neurons and the batch's M
    labels (about ``2 M`` for spread-out unit neurons). Detached."""
    return caffe_among_term_and_distance(weights, labels)[1]


def caffe_among_mhe_loss(weights: Tensor, labels: Tensor) -> Tensor:
    """A term whose gradient is the update of the authors' released Caffe ``InterClass`` layer
    (``tools/caffe-sfplus``, type AMONG, as ``sfplus_model.prototxt`` uses it), and whose value is 0.

    That layer does not differentiate Eq. 5.8. Its backward adds, for each sample j of the batch,
    ``-4 / (M D^2 + 1e-5) * (w_{y_j} - w_mean)`` to the gradient of the sample's own neuron and
    nothing to any other neuron (D: :func:`caffe_among_distance`; ``w_mean``: the mean of all
    neurons): it pushes the batch's neurons away from the mean neuron. For unit neurons D is
    about 2M, so the step shrinks as ``1 / M^3``. In Caffe the neurons are unit vectors (the
    A-Softmax layer normalises the shared blob in place); here the normalised rows give D, the
    mean and the direction, and the update goes to the raw rows. The layer recomputes D every
    10 iterations; here every call. The heads use Eq. 5.8 (thesis §5.5.2) unless asked for this form
    (the project's option, to compare with the authors' released layer).
    """
    return caffe_among_term_and_distance(weights, labels)[0]


def caffe_among_term_and_distance(weights: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(:func:`caffe_among_mhe_loss`, :func:`caffe_among_distance`) from one normalisation."""
    w = F.normalize(weights.detach(), dim=1)
    batch = w[labels]
    total = labels.numel() * (w * w).sum() + w.shape[0] * (batch * batch).sum()
    distance = (total - 2 * w.sum(0) @ batch.sum(0)) / w.shape[0]
    coefficient = 4.0 / (labels.numel() * distance**2 + 1e-5)
    update = -coefficient * (batch - w.mean(0))  # (M, K): the gradient on each w_{y_j}
    surrogate = (weights[labels] * update).sum()
    return surrogate - surrogate.detach(), distance


class HiddenMHE:
    """Hidden-layer MHE regulariser of Eq. 5.4: ``weight * sum_layers mhe_energy(layer)``.

    Every ``nn.Conv2d`` and ``nn.Linear`` of the model passed to ``__call__`` is one layer; each
    kernel (``C_in/groups x k x k`` filter, or a row of a linear layer) flattened is one neuron, so
    ``N = out_channels``. Pass the backbone, not the classifier head: Eq. 5.4 regularises the output
    layer separately. ``weight=None`` picks the papers' defaults (thesis App. D.1): 10 for full-space MHE,
    1 for half-space MHE. ``max_neurons``: mini-batch approximation (thesis §5.3.6), a random subset of
    at most that many neurons per layer on every call (drawn with ``generator`` if given).
    """

    def __init__(
        self,
        power: int = 2,
        weight: float | None = None,
        half_space: bool = False,
        distance: str = "euclidean",
        max_neurons: int | None = None,
    ) -> None:
        _check_kernel(power, distance)
        if max_neurons is not None and max_neurons < 2:
            raise ValueError(f"max_neurons must be >= 2, got {max_neurons}")
        self.power = power
        self.weight = float(weight) if weight is not None else (1.0 if half_space else 10.0)
        self.half_space = half_space
        self.distance = distance
        self.max_neurons = max_neurons

    @staticmethod
    def layers(model: nn.Module) -> list[nn.Module]:
        """The regularised layers of ``model``: every ``nn.Conv2d`` and ``nn.Linear``, in order."""
        return [mod for mod in model.modules() if isinstance(mod, (nn.Conv2d, nn.Linear))]

    def __call__(self, model: nn.Module, generator: torch.Generator | None = None) -> Tensor:
        """Scalar float32 tensor ``weight * sum_l E_s(layer l) / (N_l (N_l - 1))`` (Eq. 5.4)."""
        layers = self.layers(model)
        if not layers:
            return torch.zeros(())
        total = torch.zeros((), device=layers[0].weight.device)
        with _autocast_off(total):
            for layer in layers:
                w = layer.weight.float().reshape(layer.weight.shape[0], -1)
                if self.max_neurons is not None and w.shape[0] > self.max_neurons:
                    device = generator.device if generator is not None else torch.device("cpu")
                    pick = torch.randperm(w.shape[0], generator=generator, device=device)[: self.max_neurons]
                    w = w[pick.to(w.device)]
                total = total + mhe_energy(w, self.power, self.distance, self.half_space)
        return self.weight * total  # Eq. 5.4 hidden-layer term
