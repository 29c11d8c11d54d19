"""The trainer's side of OPT and S-OPT (thesis Ch. 7, OPT): options, step hooks, the refinement of ``v``.

The layers are :mod:`models.nets.opt`. A config turns OPT on with ``opt = "<method>"`` and one
``opt_options`` table that holds the layer options (:class:`models.nets.opt.OPTSpec`: ``normalize_v``,
``learn_v``, ``block_size``, ``shared_blocks``, ``stochastic_dims``) and these training options:

* ``skip``: qualified names of layers trained as usual (e.g. ``["fc1"]``);
* ``classifier``: CLS-OPT, the loss head's classifier weight learned as ``R v`` too (off: the
  papers leave the last layer alone);
* ``relaxed_weight``: beta of the relaxed method ``or`` (Eq. 5), default :data:`DEFAULT_RELAXED_WEIGHT`;
* ``inner_steps``: S-OPT's ``N_in``, steps between two outer steps (Algorithm 1), default 750 as the
  paper's CIFAR-100 runs;
* ``refine_steps``, ``refine_half_space``: minimise the (half-space) hyperspherical energy of every
  layer's ``v`` for this many gradient steps before training (§3.7; 0: off, the papers' default).

:class:`OPTTraining` is the step hook the training loops run (:class:`training.step_hooks.StepHook`):
the penalty to add to the loss, the orthogonality-preserving update after ``backward`` and S-OPT's
outer step after ``optimizer.step``; :class:`OPTRefinement` refines ``v`` before a fresh run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from models.nets.opt import (
    OPTSettings,
    OPTSpec,
    ogd_step_,
    opt_layers,
    relaxed_orthogonality_penalty,
    stochastic_outer_step_,
)
from training.step_hooks import StepHook, StepInputs

log = logging.getLogger(__name__)

DEFAULT_RELAXED_WEIGHT = 1e-3
"""beta of ``or`` when the config does not set one (the paper does not print its value)."""
DEFAULT_INNER_STEPS = 750
"""S-OPT's ``N_in`` of the paper's CIFAR-100 runs."""


@dataclass(frozen=True)
class OPTOptions:
    """The training options of ``opt_options`` (the rest are the layers' :class:`OPTSpec`)."""

    skip: tuple[str, ...] = ()
    classifier: bool = False
    relaxed_weight: float = DEFAULT_RELAXED_WEIGHT
    inner_steps: int = DEFAULT_INNER_STEPS
    refine_steps: int = 0
    refine_half_space: bool = False
    layer_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, method: str, options: dict[str, Any] | None) -> OPTOptions:
        """Split ``opt_options`` and check both halves (ValueError names the bad key or value)."""
        options = dict(options or {})
        own = {f.name for f in fields(cls)} - {"layer_options"}
        mine = {k: options.pop(k) for k in list(options) if k in own}
        if "skip" in mine:
            mine["skip"] = tuple(mine["skip"])
        parsed = cls(layer_options=options, **mine)
        OPTSpec.from_options(method, options)  # unknown layer options and bad values raise here
        if parsed.relaxed_weight < 0 or parsed.inner_steps < 1 or parsed.refine_steps < 0:
            raise ValueError("relaxed_weight must be >= 0, inner_steps >= 1 and refine_steps >= 0")
        return parsed


def opt_settings(method: str, options: dict[str, Any] | None) -> OPTSettings:
    """What :func:`models.nets.build_network` applies to the network (``method = "none"``: nothing)."""
    if method == "none":
        return OPTSettings()
    parsed = OPTOptions.parse(method, options)
    return OPTSettings(method, parsed.layer_options, parsed.skip)


class OPTTraining(StepHook):
    """The per-step OPT work of one network (a no-op hook when it has no OPT layers)."""

    def __init__(self, net: nn.Module, method: str, options: dict[str, Any] | None, seed: int = 0) -> None:
        self.net = net
        self.method = method
        self.options = OPTOptions.parse(method, options) if method != "none" else OPTOptions()
        self.has_layers = any(True for _ in opt_layers(net))
        self.stochastic = any(layer.stochastic_dims for layer in opt_layers(net))
        self.generator = torch.Generator().manual_seed(seed + 1_000_003)

    def penalty(self, inputs: StepInputs | None = None) -> Tensor | None:
        """``beta ||U^T U - I||_F^2`` for ``or`` (None otherwise; ``inputs`` are not needed)."""
        if self.method != "or" or not self.has_layers:
            return None
        return self.options.relaxed_weight * relaxed_orthogonality_penalty(self.net)

    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """``ogd``: move every ``R`` along its Cayley curve by the first group's learning rate
        (before ``optimizer.step``)."""
        if self.method == "ogd":
            ogd_step_(self.net, optimizer.param_groups[0]["lr"])

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """S-OPT: every ``inner_steps`` steps fold ``R_p`` into ``v``, redraw, reset, clear its momentum."""
        if not self.stochastic or (step + 1) % self.options.inner_steps:
            return
        for param in stochastic_outer_step_(self.net, self.generator):
            optimizer.state.pop(param, None)

    def state_dict(self) -> dict[str, Any]:
        """S-OPT's generator, which draws the next dimensions to rotate."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class OPTRefinement(StepHook):
    """Before a fresh run: the refinement of the fixed neurons ``v`` that ``refine_steps`` asks for
    (:func:`refine_as_configured`; OPT §3.7)."""

    def __init__(self, net: nn.Module, method: str, options: dict[str, Any] | None) -> None:
        self.net, self.method, self.options = net, method, options

    def before_training(self) -> None:
        energies = refine_as_configured(self.net, self.method, self.options)
        if energies:
            log.info("OPT: hyperspherical energy of v refined, per layer: %s", describe_refinement(energies))


def layer_energy(layer: nn.Module, half_space: bool = False) -> float:
    """The normalised hyperspherical energy (s = 2) of an OPT layer's current neurons ``R v``."""
    from training.losses import mhe_energy

    with torch.no_grad():
        return float(mhe_energy(layer.weight_matrix().double(), power=2, half_space=half_space))


def refine_initial_neurons_(
    net: nn.Module, steps: int, half_space: bool = False, lr: float = 0.1
) -> list[tuple[float, float]]:
    """Minimise each OPT layer's energy of ``v`` for ``steps`` steps (§3.7); (before, after) per layer.

    Gradient descent on ``v`` alone (its norms are kept: only the directions move), s = 2.
    """
    from training.losses import mhe_energy

    report = []
    for layer in opt_layers(net):
        v = layer.v.detach().clone().requires_grad_(True)
        norms = v.norm(dim=1, keepdim=True).detach()
        before = float(mhe_energy(v.detach().double(), power=2, half_space=half_space))
        optimizer = torch.optim.SGD([v], lr=lr, momentum=0.9)
        for _ in range(steps):
            energy = mhe_energy(v, power=2, half_space=half_space)
            optimizer.zero_grad()
            energy.backward()
            optimizer.step()
        with torch.no_grad():
            refined = nn.functional.normalize(v, dim=1) * norms
            layer.v.copy_(refined)
        after = float(mhe_energy(refined.double(), power=2, half_space=half_space))
        report.append((before, after))
    return report


def refine_as_configured(
    net: nn.Module, method: str, options: dict[str, Any] | None
) -> list[tuple[float, float]]:
    """:func:`refine_initial_neurons_` with the config's ``refine_steps`` (empty list when 0 or no OPT)."""
    if method == "none":
        return []
    parsed = OPTOptions.parse(method, options)
    if not parsed.refine_steps:
        return []
    return refine_initial_neurons_(net, parsed.refine_steps, parsed.refine_half_space)


def describe_refinement(energies: list[tuple[float, float]]) -> str:
    """``0.5123 -> 0.5101, ...``: each layer's energy of ``v`` before and after the refinement."""
    return ", ".join(f"{before:.4f} -> {after:.4f}" for before, after in energies)


def apply_classifier_opt_as_configured(head: nn.Module, method: str, options: dict[str, Any] | None) -> None:
    """CLS-OPT on ``head`` when the config's ``opt_options.classifier`` is true."""
    from models.nets.opt import apply_classifier_opt

    if method == "none":
        return
    parsed = OPTOptions.parse(method, options)
    if parsed.classifier:
        apply_classifier_opt(head, OPTSpec.from_options(method, parsed.layer_options))


def trainable_parameters(net: nn.Module) -> int:
    """Numbers the training changes: parameters that need a gradient (``ogd``'s ``R`` included)."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def layer_energies(net: nn.Module) -> list[float]:
    """Normalised hyperspherical energy (s = 2, float64) of every conv, linear and OPT layer, in order.

    The quantity OPT keeps fixed and MHE / CoMHE lower (OPT Table 4, CoMHE Fig. 6.2).
    """
    from models.nets.opt import OPT_LAYERS
    from training.losses import mhe_energy

    energies = []
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear, *OPT_LAYERS)):
                weight = module.weight.detach().double()
                energies.append(float(mhe_energy(weight.reshape(weight.shape[0], -1), power=2)))
    return energies
