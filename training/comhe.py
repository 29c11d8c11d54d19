"""Compressive MHE (CoMHE, thesis Ch. 6): hidden-layer MHE on projected neurons.

MHE in a high dimension has many stationary points and deterministic gradients; CoMHE projects the
(normalised) neurons of a layer to ``k`` dimensions and minimises the energy there (Eq. 6.3):
``E = sum_{i != j} f_s(|| g(w_i) - g(w_j) ||)`` with ``g(w) = P w / ||P w||``. Projections
(:data:`PROJECTIONS`):

* ``random`` (RP-CoMHE, Eq. 6.4-6.5): ``C`` Gaussian ``P_c`` (N(0, 1) entries, ``k x d``); the
  energy is the mean (or, ``reduce = "max"``, the max) over them. They are re-drawn every
  ``redraw_every`` calls (Table E.4: every 1, 200 or 1000 iterations are alike; never is worse),
  and shared by the layers whose neurons have the same dimension (``share``; not sharing is worse).
  No gradient flows into ``P``.
* ``angle`` (AP-CoMHE, Eq. 6.6-6.7): one ``P`` per neuron dimension, drawn at random every
  ``redraw_every`` calls and fitted to preserve the angles, ``L_P = sum_{i != j} (cos(w_i, w_j) -
  cos(P w_i, P w_j))^2`` (the cosine form the thesis allows), over every layer that shares it.
  ``unrolled = false`` (alternating): after each draw and every ``ap_every`` calls, ``ap_steps``
  gradient steps on ``P`` with the neurons held fixed. ``unrolled = true``: the energy is taken at
  ``P - ap_lr * dL_P/dP`` with the gradient kept in the graph, so the network's gradient includes
  the second-order path through the projection's update; ``P`` then moves to that point.
* ``group`` (G-CoMHE, Eq. 6.9): ``P_c`` selects a group of ``group_size`` consecutive input
  channels (0/1 diagonal, summing to I); the energy is the mean over groups.

The layer energies are those of :func:`training.losses.mhe_energy` (normalised by the number of
ordered pairs, half-space by default as the thesis's CoMHE experiments, s = 2) of the projected
neurons, summed over the layers and times ``weight`` (1 in the thesis's hidden layers).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.losses import HiddenMHE, mhe_energy

#: CoMHE projections.
PROJECTIONS: tuple[str, ...] = ("random", "angle", "group")


@dataclass(frozen=True)
class CoMHEOptions:
    """Options of :class:`CompressiveMHE` (the trainer's ``hidden_mhe_options``)."""

    dim: int = 30
    projections: int = 5
    reduce: str = "mean"
    #: Calls between two draws of the projections (None: 1 for ``random``, 200 for ``angle``,
    #: which fits its P after each draw; the thesis does not print AP's interval).
    redraw_every: int | None = None
    share: bool = True
    ap_every: int = 10
    #: AP's gradient steps per fit and their learning rate for ``L_P`` (a mean over the ordered
    #: pairs, with ``P`` of N(0, 1) entries: its gradient is small, hence the large rate; 200
    #: steps at 50 halve ``L_P`` for 30 neurons of dimension 200 projected to 12).
    ap_steps: int = 5
    ap_lr: float = 50.0
    unrolled: bool = False
    group_size: int = 8
    power: int = 2

    def __post_init__(self) -> None:
        checks = [
            (self.dim >= 2, "dim (the projection dimension k + 1) must be at least 2"),
            (self.projections >= 1, "projections (C) must be at least 1"),
            (self.reduce in ("mean", "max"), "reduce must be mean or max"),
            (
                (self.redraw_every is None or self.redraw_every >= 1)
                and self.ap_every >= 1
                and self.ap_steps >= 1,
                "redraw_every, ap_every and ap_steps must be >= 1",
            ),
            (self.ap_lr > 0, "ap_lr must be positive"),
            (self.group_size >= 1, "group_size must be at least 1"),
            (self.power >= 0, "power must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> CoMHEOptions:
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown CoMHE options {unknown}; expected some of: {', '.join(sorted(known))}")
        return cls(**options)


def projected_energy(
    neurons: Tensor, projection: Tensor, power: int = 2, half_space: bool = True, reduce: str = "mean"
) -> Tensor:
    """Energy of ``neurons`` (N, d) under each projection of ``projection`` (C, k, d), reduced over C.

    The neurons are normalised before projecting (``g`` acts on ``S^d``); ``mhe_energy`` normalises
    the projected ones (``P w / ||P w||``).
    """
    unit = F.normalize(neurons, dim=1)
    projected = torch.einsum("ckd,nd->cnk", projection, unit)
    energies = torch.stack([mhe_energy(p, power, half_space=half_space) for p in projected])
    return energies.max() if reduce == "max" else energies.mean()


def group_energy(
    neurons: Tensor, in_channels: int, group_size: int, power: int = 2, half_space: bool = True
) -> Tensor:
    """Mean over groups of ``group_size`` consecutive input channels of each group's sub-neuron energy.

    ``neurons``: (N, in_channels * spatial), laid out channel-major as a flattened conv kernel (or a
    linear layer's rows with ``spatial = 1``). A last, smaller group takes the remaining channels.
    """
    n = neurons.shape[0]
    per_channel = neurons.reshape(n, in_channels, -1)
    groups = per_channel.split(group_size, dim=1)
    return torch.stack([mhe_energy(g.reshape(n, -1), power, half_space=half_space) for g in groups]).mean()


def angle_preservation_loss(neurons: Tensor, projection: Tensor) -> Tensor:
    """``L_P`` of Eq. 6.6 with cosines: mean over ordered pairs ``i != j`` of ``(cos_ij - cos_P,ij)^2``."""
    unit = F.normalize(neurons, dim=1)
    before = unit @ unit.t()
    projected = F.normalize(unit @ projection.t(), dim=1)
    after = projected @ projected.t()
    n = unit.shape[0]
    off = ~torch.eye(n, dtype=torch.bool, device=unit.device)
    return (before - after)[off].square().mean()


class CompressiveMHE:
    """Hidden-layer CoMHE: ``weight * sum_layers E(projected neurons of the layer)``.

    Called as :class:`training.losses.HiddenMHE` is (``regulariser(model) -> scalar``), on the same
    layers (every ``nn.Conv2d`` and ``nn.Linear`` of the backbone). It keeps its projections and a
    call counter; ``generator`` seeds the draws (CPU; moved to the neurons' device).
    """

    def __init__(
        self,
        projection: str = "random",
        weight: float = 1.0,
        half_space: bool = True,
        options: CoMHEOptions | None = None,
        seed: int = 0,
    ) -> None:
        if projection not in PROJECTIONS:
            raise ValueError(
                f"unknown CoMHE projection {projection!r}; expected one of: {', '.join(PROJECTIONS)}"
            )
        self.projection = projection
        self.weight = float(weight)
        self.half_space = half_space
        self.options = options or CoMHEOptions()
        self.generator = torch.Generator().manual_seed(seed + 7919)
        self.calls = 0
        self._projections: dict[Any, Tensor] = {}
        self._fresh: set[Any] = set()  # keys drawn during the current call
        default_redraw = 1 if projection == "random" else 200
        self.redraw_every = self.options.redraw_every or default_redraw

    # -- projections ----------------------------------------------------------------------------

    def _key(self, index: int, dim: int) -> Any:
        return dim if self.options.share else (index, dim)

    def _draw(self, count: int, dim: int, device: torch.device) -> Tensor:
        shape = (count, self.options.dim, dim)
        return torch.randn(shape, generator=self.generator).to(device)

    def projection_for(self, index: int, dim: int, device: torch.device) -> Tensor:
        """The current (C, k, d) projection of layer ``index`` (shared by dimension when ``share``)."""
        key = self._key(index, dim)
        current = self._projections.get(key)
        if current is not None and current.device != device:  # restored from a checkpoint
            current = self._projections[key] = current.to(device)
        if current is None or (self.calls % self.redraw_every == 0 and key not in self._fresh):
            count = self.options.projections if self.projection == "random" else 1
            current = self._draw(count, dim, device)
            self._projections[key] = current
            self._fresh.add(key)
        return current

    def _fit_angle_projection(self, key: Any, layers: list[Tensor]) -> None:
        """Alternating AP: ``ap_steps`` gradient steps on ``L_P`` with the neurons held fixed."""
        p = self._projections[key][0].detach().clone().requires_grad_(True)
        for _ in range(self.options.ap_steps):
            loss = sum(angle_preservation_loss(w.detach(), p) for w in layers)
            (grad,) = torch.autograd.grad(loss, p)
            p = (p - self.options.ap_lr * grad).detach().requires_grad_(True)
        self._projections[key] = p.detach()[None]

    def state_dict(self) -> dict[str, Any]:
        """The generator, the call counter and the current projections (on the CPU): what a
        resumed run needs to draw and use the same projections as an uninterrupted one."""
        return {
            "generator": self.generator.get_state(),
            "calls": self.calls,
            "projections": [
                [list(key) if isinstance(key, tuple) else key, value.detach().cpu()]
                for key, value in self._projections.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.calls = int(state["calls"])
        self._projections = {
            tuple(key) if isinstance(key, list) else key: value for key, value in state["projections"]
        }

    # -- the regulariser ------------------------------------------------------------------------

    def _neurons(self, model: nn.Module) -> list[tuple[nn.Module, Tensor]]:
        layers = HiddenMHE.layers(model)
        return [(layer, layer.weight.float().reshape(layer.weight.shape[0], -1)) for layer in layers]

    def __call__(self, model: nn.Module) -> Tensor:
        """Scalar float32 tensor: ``weight * sum_l E(layer l)`` under the current projections."""
        neurons = self._neurons(model)
        self._fresh = set()
        if not neurons:
            return torch.zeros(())
        total = torch.zeros((), device=neurons[0][1].device)
        if self.projection == "group":
            for layer, w in neurons:
                channels = layer.weight.shape[1]
                size = self.options.group_size
                total = total + group_energy(w, channels, size, self.options.power, self.half_space)
        elif self.projection == "random":
            for index, (_, w) in enumerate(neurons):
                p = self.projection_for(index, w.shape[1], w.device)
                total = total + projected_energy(
                    w, p, self.options.power, self.half_space, self.options.reduce
                )
        else:
            total = total + self._angle_energy(neurons)
        self.calls += 1
        return self.weight * total

    def _angle_energy(self, neurons: list[tuple[nn.Module, Tensor]]) -> Tensor:
        by_key: dict[Any, list[int]] = {}
        for index, (_, w) in enumerate(neurons):
            self.projection_for(index, w.shape[1], w.device)
            by_key.setdefault(self._key(index, w.shape[1]), []).append(index)
        total = torch.zeros((), device=neurons[0][1].device)
        for key, members in by_key.items():
            layers = [neurons[i][1] for i in members]
            if self.options.unrolled:
                p = self._unrolled_projection(key, layers)
            else:
                if key in self._fresh or self.calls % self.options.ap_every == 0:
                    self._fit_angle_projection(key, layers)
                p = self._projections[key]
            for w in layers:
                total = total + projected_energy(w, p, self.options.power, self.half_space)
        return total

    def _unrolled_projection(self, key: Any, layers: list[Tensor]) -> Tensor:
        """``P - ap_lr * dL_P/dP`` with the gradient in the graph (second order through the neurons)."""
        p = self._projections[key][0].detach().requires_grad_(True)
        loss = sum(angle_preservation_loss(w, p) for w in layers)
        (grad,) = torch.autograd.grad(loss, p, create_graph=True)
        stepped = p - self.options.ap_lr * grad
        self._projections[key] = stepped.detach()[None]
        return stepped[None]


def hidden_regulariser(
    weight: float,
    half_space: bool,
    projection: str = "none",
    options: dict[str, Any] | None = None,
    seed: int = 0,
) -> HiddenMHE | CompressiveMHE:
    """The trainers' hidden-layer regulariser: plain MHE (Eq. 5.4) or CoMHE with ``projection``."""
    if projection == "none":
        return HiddenMHE(weight=weight, half_space=half_space)
    return CompressiveMHE(projection, weight, half_space, CoMHEOptions.from_options(options), seed)
