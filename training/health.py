"""The face trainer's health check: a run stops on a NaN loss or on collapsing features.

Every rank checks the same all-reduced interval means, so all stop at the same step. The step and
the reason are written to ``stopped.json`` in the run folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.callbacks import Callback, Interval, RunStopped

#: Written when a run stops early on a NaN loss or collapsed features: step, reason, message.
STOPPED_NAME = "stopped.json"


class FeatureCollapseError(RunStopped):
    """The features shrank towards 0 (loss -> ln C, accuracy -> 0): the run cannot recover."""


class HealthCheck(Callback):
    """Stops the run when an interval's mean loss is not finite, or its mean feature norm ||x||
    falls below ``collapse_fraction`` of the first interval's (0: no collapse check).

    ``first_feature_norm`` is that first interval's norm (kept in checkpoints, so a resumed run
    compares with the same one).
    """

    def __init__(
        self,
        collapse_fraction: float,
        num_classes: int,
        run_dir: Path,
        checkpoint_path: Path,
        *,
        write_record: bool,
        first_feature_norm: float | None = None,
    ) -> None:
        self.collapse_fraction = collapse_fraction
        self.num_classes = num_classes
        self.run_dir = run_dir
        self.checkpoint_path = checkpoint_path
        self.write_record = write_record
        self.first_feature_norm = first_feature_norm

    def on_interval(self, interval: Interval) -> None:
        metrics, done = interval.row, interval.done
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(
                f"loss became {metrics['loss']} at step {done}; lower lr or the MHE weight "
                f"(the last good checkpoint is {self.checkpoint_path})"
            )
        norm = metrics.get("feature_norm")
        if norm is None or self.collapse_fraction <= 0:
            return
        if self.first_feature_norm is None:
            self.first_feature_norm = norm
            return
        if norm < self.collapse_fraction * self.first_feature_norm:
            raise FeatureCollapseError(self._collapse_message(done, norm, metrics))

    def _collapse_message(self, done: int, norm: float, metrics: dict[str, Any]) -> str:
        return (
            f"the features collapsed at step {done}: mean ||x|| fell from {self.first_feature_norm:.3g} "
            f"to {norm:.3g} (loss {metrics['loss']:.3f}, ln C = {math.log(self.num_classes):.3f}; "
            f"training accuracy {100 * metrics['accuracy']:.1f}%). The network lowers the loss by "
            "shrinking its features and will not recover. Usual causes: lambda reaching its floor "
            "before the network has learnt (lambda_floor_epochs), a learning rate too high for the "
            "batch, or a margin too large for the data. Set feature_norm_collapse = 0 to train on "
            f"anyway; the last checkpoint is {self.checkpoint_path}"
        )

    def on_stop(self, interval: Interval, error: BaseException) -> None:
        """``stopped.json``: the step, the error's class and its message."""
        if not self.write_record:
            return
        stopped = {"step": interval.done, "reason": type(error).__name__, "message": str(error)}
        (self.run_dir / STOPPED_NAME).write_text(json.dumps(stopped, indent=2) + "\n")
