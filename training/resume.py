"""What a resumed run may change, and the config the resumed session trains with.

A checkpoint continues the run that wrote it: a resume that trained on with other settings would
leave a run folder whose ``config.toml`` and checkpoint describe a run that never happened. So
``sphereface train CONFIG --resume`` compares the requested config with the run's original one
(the first session's, kept in the checkpoint and in ``config.toml``, which a resume never
rewrites) and refuses any difference outside :data:`TrainConfig.RESUME_MAY_CHANGE`, naming the
keys. The allow-list holds settings that decide where the run lives, what is logged, checked or
checkpointed and how many threads compute it, never what a step computes. One more change is
allowed, by rule (:func:`steps_extension_error`): a larger ``steps``, once the run has taken its
last learning-rate drop; the extra steps run at the last learning rate, the drops stay at the
steps where the original run took them (the effective ``lr_drops`` are re-expressed as
fractions of the new length), and the change is recorded in the run folder's ``resumes.jsonl``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from training.config import ConfigError, TrainConfig

#: One line per resumed session: the step it started from and the allowed changes it made.
RESUMES_FILE = "resumes.jsonl"


def original_config(state: dict[str, Any]) -> TrainConfig:
    """The config of a checkpoint's first session (``original_config``; a checkpoint without it
    was written by a run that was never extended: its ``config``)."""
    return TrainConfig.from_dict(dict(state.get("original_config") or state["config"]))


def config_changes(original: TrainConfig, requested: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (original value, requested value)}`` of every field that differs, in field order."""
    old, new = original.as_dict(), requested.as_dict()
    return {key: (old[key], new[key]) for key in original.FIELD_ORDER if old[key] != new[key]}


def steps_extension_error(original: TrainConfig, requested: TrainConfig, done: int) -> str | None:
    """Why ``requested.steps`` cannot replace ``original.steps`` at step ``done`` (None: it can).

    The rule: ``steps`` may only grow, and only once the run has taken its last learning-rate
    drop (``done >= original.lr_milestones()[-1]``): then no step done or to come changes its
    learning rate, and the extra steps run at the last one. A shorter run, or a longer one before
    the last drop, would move the drops (they are fractions of ``steps``).
    """
    if requested.steps < original.steps:
        return f"steps {original.steps} -> {requested.steps}: a resume may lengthen a run, never shorten it"
    milestones = original.lr_milestones()
    last_drop = max(milestones) if milestones else 0
    if done < last_drop:
        return (
            f"steps {original.steps} -> {requested.steps} at step {done}: a run may be lengthened only "
            f"after its last learning-rate drop (step {last_drop}); earlier, the new length would "
            "move the drops"
        )
    return None


def resumed_config(original: TrainConfig, requested: TrainConfig, done: int, run_dir: Path) -> TrainConfig:
    """The config the session resuming the run at step ``done`` trains with.

    ``requested`` with, when it lengthens the run, ``lr_drops`` re-expressed so that the drops
    stay at ``original.lr_milestones()``.

    Raises:
        ConfigError: ``requested`` differs from ``original`` in a field outside
            :data:`TrainConfig.RESUME_MAY_CHANGE` (every such field is named), or in ``steps``
            against :func:`steps_extension_error`, or ends before ``done``.
    """
    changes = config_changes(original, requested)
    allowed = set(TrainConfig.RESUME_MAY_CHANGE)
    refused = {key: pair for key, pair in changes.items() if key not in allowed and key != "steps"}
    reasons = [f"{key} {_show(old)} -> {_show(new)}" for key, (old, new) in refused.items()]
    if "steps" in changes:
        error = steps_extension_error(original, requested, done)
        if error is not None:
            refused["steps"] = changes["steps"]
            reasons.append(error)
    if requested.steps < done:
        refused.setdefault("steps", (original.steps, requested.steps))
        reasons.append(f"steps {requested.steps} ends before the checkpoint's step {done}")
    if refused:
        raise ConfigError(_refusal(run_dir, sorted(refused), reasons))
    if requested.steps == original.steps:
        return requested
    drops = [milestone / requested.steps for milestone in original.lr_milestones()]
    effective = replace(requested, lr_drops=drops)
    if effective.lr_milestones() != original.lr_milestones():  # a float rounding would move a drop
        raise ConfigError(f"cannot keep the learning-rate drops at {original.lr_milestones()}")
    return effective


def _refusal(run_dir: Path, keys: list[str], reasons: list[str]) -> str:
    return (
        f"cannot resume {run_dir} with a changed config: {', '.join(keys)} differ "
        f"({'; '.join(reasons)}). A resume may change only {', '.join(TrainConfig.RESUME_MAY_CHANGE)}, "
        "and lengthen steps after the last learning-rate drop. Resume with the run's own settings "
        f"({run_dir / 'config.toml'}), or start a new run (another name; init_from to start from "
        "this checkpoint)"
    )


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def record_resume(run_dir: Path, done: int, changes: dict[str, tuple[Any, Any]], processes: int) -> None:
    """Append the session's start (step ``done``) and its allowed changes to ``resumes.jsonl``."""
    entry = {
        "step": done,
        "processes": processes,
        "changed": {key: {"from": old, "to": new} for key, (old, new) in changes.items()},
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    with (run_dir / RESUMES_FILE).open("a") as handle:
        handle.write(json.dumps(entry) + "\n")
