"""The protocol of the optional per-step machinery that both training loops run.

Everything a config can add around a plain training step is a :class:`StepHook`: hidden-layer MHE
and CoMHE, SphereNet's orthogonality regulariser, OPT (and its refinement of ``v``), distillation
from a teacher, the angular heads' renormalisation and DCNet's weight projection
(:mod:`training.regularisers` builds them from a config). A loop holds them in one
:class:`StepHooks` and calls, in this order::

    hooks.before_training()                     # a fresh run, before its first step
    loss, logged = hooks.add_penalties(loss, inputs)   # in the forward pass (and its autocast)
    loss.backward()
    hooks.after_backward(optimizer)
    optimizer.step()
    hooks.after_step(optimizer, step)

Each call visits the hooks in their order; the loops add no optional work of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class StepInputs:
    """What a penalty may look at in one training step."""

    #: The embedding network (the backbone, without the classifier head).
    net: nn.Module
    #: The batch as the network saw it, ``(B, 3, H, W)``.
    images: Tensor
    #: The network's features of ``images``, ``(B, D)``, with their graph.
    features: Tensor


class StepHook:
    """One piece of optional per-step work; every method does nothing unless a hook overrides it."""

    def before_training(self) -> None:
        """Once, before the first step of a fresh run (a resumed run skips it)."""

    def penalty(self, inputs: StepInputs) -> Tensor | None:
        """A scalar term added to the training loss (weighted), or None."""
        return None

    def logged(self) -> dict[str, Tensor]:
        """Values of the last :meth:`penalty` for the training log (detached device tensors)."""
        return {}

    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``loss.backward()``, before ``optimizer.step()``."""

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """After ``optimizer.step()`` of step ``step`` (0-based)."""

    def state_dict(self) -> dict[str, Any]:
        """What the hook must carry over a resume for the run to continue exactly (random
        generators, counters, drawn projections); tensors and plain values only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave."""


class StepHooks:
    """The hooks of one run, called in order."""

    def __init__(self, hooks: Iterable[StepHook] = ()) -> None:
        self.hooks = list(hooks)

    def __iter__(self) -> Iterator[StepHook]:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def before_training(self) -> None:
        for hook in self.hooks:
            hook.before_training()

    def add_penalties(self, loss: Tensor, inputs: StepInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """``loss`` plus every hook's penalty, added one by one in the hooks' order, and the values
        they log."""
        total = loss
        for hook in self.hooks:
            term = hook.penalty(inputs)
            if term is not None:
                total = total + term
        logged: dict[str, Tensor] = {}
        for hook in self.hooks:
            logged.update(hook.logged())
        return total, logged

    def after_backward(self, optimizer: torch.optim.Optimizer) -> None:
        for hook in self.hooks:
            hook.after_backward(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(optimizer, step)

    def state_dict(self) -> list[dict[str, Any]]:
        """Every hook's state with its class name, in the hooks' order (for the checkpoint)."""
        return [{"hook": type(hook).__name__, "state": hook.state_dict()} for hook in self.hooks]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        """Give each hook its state back.

        Raises:
            ValueError: the checkpoint's hooks are not this run's (another config).
        """
        names = [type(hook).__name__ for hook in self.hooks]
        saved = [entry["hook"] for entry in states]
        if saved != names:
            raise ValueError(f"the checkpoint's step hooks {saved} are not this run's {names}")
        for hook, entry in zip(self.hooks, states, strict=True):
            hook.load_state_dict(entry["state"])
