"""The step hooks a config turns on, and :func:`build_step_hooks`, the one place that builds them.

The hooks (:class:`training.step_hooks.StepHook`) of a run, in the order the loops run them:

* hidden-layer MHE (thesis Eq. 5.4) or compressive MHE (thesis Ch. 6): :class:`HiddenMHEHook`;
* SphereNet's orthogonality regulariser ``w ||W^T W - I||_F^2`` (SphereNet §2.4):
  :class:`OrthogonalityHook`;
* OPT: the refinement of ``v`` before a fresh run and the per-step work
  (:class:`training.opt.OPTRefinement`, :class:`training.opt.OPTTraining`);
* distillation from a teacher model (face runs): :class:`training.distill.DistillationHook`;
* the angular heads' classifier rows put back on the unit sphere after every step, as the Caffe
  layer does on every forward pass: :class:`HeadRenormalisation`;
* DCNet's weight projection ``w <- w / ||w||`` every N steps: :class:`WeightProjection`.

Adding a regulariser is its hook class and one line in :func:`build_step_hooks`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from training.config import ConfigError, RunConfig, TrainConfig
from training.step_hooks import StepHook, StepHooks, StepInputs

log = logging.getLogger(__name__)


class HiddenMHEHook(StepHook):
    """Hidden-layer MHE or CoMHE of the backbone: ``regulariser(net)`` (already weighted)."""

    def __init__(self, regulariser: Any) -> None:
        self.regulariser = regulariser

    def penalty(self, inputs: StepInputs) -> Tensor:
        return self.regulariser(inputs.net)

    def state_dict(self) -> dict[str, Any]:
        """CoMHE's generator, call counter and current projections (plain MHE keeps none: its
        random neurons come from torch's global generator, which the checkpoint keeps)."""
        return self.regulariser.state_dict() if hasattr(self.regulariser, "state_dict") else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.regulariser, "load_state_dict"):
            self.regulariser.load_state_dict(state)


class OrthogonalityHook(StepHook):
    """``weight * sum_layers ||W^T W - I||_F^2`` over the hyperspherical layers (SphereNet §2.4)."""

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def penalty(self, inputs: StepInputs) -> Tensor:
        from models.nets.hyperspherical import orthogonality_penalty

        return self.weight * orthogonality_penalty(inputs.net)


class HeadRenormalisation(StepHook):
    """Unit classifier rows after every step (the head's ``renormalise_``)."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.head.renormalise_()


class WeightProjection(StepHook):
    """Every ``every`` steps (after steps ``every - 1``, ``2 every - 1``, ...), each operator kernel
    back onto the unit sphere (DCNet)."""

    def __init__(self, net: nn.Module, every: int) -> None:
        self.net, self.every = net, every

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        from models.nets.hyperspherical import project_weights_

        if (step + 1) % self.every == 0:
            project_weights_(self.net)


def build_step_hooks(
    config: RunConfig,
    model: nn.Module,
    *,
    device: torch.device | None = None,
    hidden_mhe_last: bool = False,
) -> StepHooks:
    """The hooks ``config`` turns on for ``model`` (a module with ``net`` and ``head``).

    Args:
        device: where a distillation teacher runs (face configs with ``distill_weight > 0``).
        hidden_mhe_last: add hidden MHE's penalty after the orthogonality and OPT penalties (the
            CIFAR loop's order) instead of before them (the face trainer's). Float addition is not
            associative: each loop keeps its order, so its runs reproduce their numbers bit for bit.
    """
    hidden = _hidden_mhe(config)
    hooks: list[StepHook] = []
    if hidden is not None and not hidden_mhe_last:
        hooks.append(hidden)
    if config.orthogonality_weight > 0:
        hooks.append(OrthogonalityHook(config.orthogonality_weight))
    if config.opt != "none":
        from training.opt import OPTRefinement, OPTTraining

        hooks.append(OPTRefinement(model.net, config.opt, config.opt_options))
        # the whole model: the head is OPT-trained too under CLS-OPT; one seed for every rank, so
        # that all draw the same S-OPT coordinates
        hooks.append(OPTTraining(model, config.opt, config.opt_options, seed=config.seed))
    if hidden is not None and hidden_mhe_last:
        hooks.append(hidden)
    if isinstance(config, TrainConfig) and config.distill_weight > 0:
        hooks.append(_distillation(config, device or torch.device("cpu")))
    if getattr(model.head, "renormalise_", None) is not None:
        hooks.append(HeadRenormalisation(model.head))
    if config.weight_projection_every:
        hooks.append(WeightProjection(model.net, config.weight_projection_every))
    return StepHooks(hooks)


def _hidden_mhe(config: RunConfig) -> HiddenMHEHook | None:
    if config.hidden_mhe_weight <= 0:
        return None
    from training.comhe import hidden_regulariser

    return HiddenMHEHook(
        hidden_regulariser(
            config.hidden_mhe_weight,
            config.hidden_mhe_half_space,
            config.hidden_mhe_projection,
            config.hidden_mhe_options,
            seed=config.seed,
        )  # fmt: skip
    )


def _distillation(config: TrainConfig, device: torch.device) -> StepHook:
    from models.registry import resolve_model
    from training.distill import DistillationHook, TeacherEmbedder

    try:
        teacher = TeacherEmbedder(resolve_model(config.distill_from), device, threads=config.threads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    log.info("distilling %s's pairwise cosines, weight %g", teacher.model_id, config.distill_weight)
    return DistillationHook(teacher, config.distill_weight)
