"""The trainer: SphereFace / SphereFace+ (and baseline heads) from a prepared dataset.

One entry point, :func:`train`, run directly or under ``torchrun`` (DistributedDataParallel,
several GPUs and nodes; NCCL on GPUs, Gloo on CPU). What it does, per thesis §2.3.6 "CNNs Setup":

* SGD, momentum 0.9, weight decay 5e-4 as the authors' Caffe nets (``sphereface_model.prototxt``):
  weights and PReLU slopes decayed, biases at twice the learning rate and not decayed (BatchNorm,
  which those nets lack, is not decayed either); learning rate 0.1 divided by 10 at 16/28 and
  24/28 of the run (the papers' 16K and 24K of 28K iterations, scaled to the run's length).
* The angular heads' classifier rows are put back on the unit sphere after every step, as the
  Caffe layer does on every forward pass.
* Horizontal flip, and optionally more augmentation (:mod:`training.augment`); bf16 autocast
  on GPUs that compute in bf16 (Ampere and later; fp32 before);
  the classifier heads compute in float32.
* A-Softmax's lambda per Caffe iteration (logged); the optional regularisers and weight steps
  (hidden-layer MHE, Eq. 5.4, CoMHE, OPT, orthogonality, distillation, ...) are the step hooks of
  :mod:`training.regularisers`, run through :class:`training.step_hooks.StepHooks`.
* A checkpoint every ``checkpoint_every`` steps and at the end (``checkpoint.pt``: network, head,
  optimizer, schedule, and every process's RNG and loader position): ``resume=True`` continues a
  killed run exactly (the weights equal those of an uninterrupted run, bit for bit on CPU), with
  the run's own config: :mod:`training.resume` refuses any change outside an allow-list.
* The mean feature norm ||x|| is logged; a run whose features collapse towards 0 stops with a
  message instead of training on (``feature_norm_collapse``).
* An LFW check (official 10-fold protocol, crops aligned with the same MTCNN landmarks as the
  training data) every ``lfw_every`` steps and at the end; a CSV log (``log.csv``) of loss,
  accuracy, lambda, MHE, ||x||, learning rate, images/s and LFW; a PNG of the curves;
  ``summary.json`` with the final numbers, the angular Fisher score of LFW features (Eq. A.1)
  and the hyperspherical energy of the classifier.
* The periodic work (health check, LFW check, CSV log, progress bar, checkpoint) is done by the
  callbacks of :mod:`training.callbacks`, in that order at the end of every log interval.
* Under torchrun the logged loss, accuracy and ||x|| are means over all processes, a NaN stops
  every process at the same step, and the summary records a checksum of every rank's weights.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.nets.hyperspherical import HYPERSPHERICAL_LAYERS, operator_parameters
from training.callbacks import Callbacks, Checkpointer, History, Interval, ProgressBar
from training.config import ConfigError, TrainConfig
from training.distributed import (
    DistributedContext,
    IntervalStats,
    all_ranks,
    gather_objects,
    gather_process_states,
    init_distributed,
    restore_process_state,
    seed_everything,
    weights_checksum,
)
from training.health import HealthCheck
from training.lfw_check import LFWCheck, LFWEvaluation
from training.regularisers import build_step_hooks
from training.resume import config_changes, original_config, record_resume, resumed_config
from training.run_log import CsvLog, plot_training_curves
from training.step_hooks import StepHooks, StepInputs
from training.verification_check import VerificationSetsCheck

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"


class FaceClassifier(nn.Module):
    """The embedding network and its training-only classifier head, as one module for DDP."""

    def __init__(self, net: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.head = head

    def forward(self, images: torch.Tensor, labels: torch.Tensor, step: int) -> tuple[Any, Any, dict]:
        """``(B, 3, 112, 96)``, ``(B,)`` -> (loss, logits ``(B, C)``, extras).

        ``extras`` holds the head's logged values, ``feature_norm``, the batch's mean ||x||
        (a detached device tensor), and ``features`` themselves (for a distillation loss).
        """
        features = self.net(images)
        out = self.head(features, labels, step=step)
        feature_norm = features.detach().float().norm(dim=1).mean()
        return out.loss, out.logits, {**out.extras, "feature_norm": feature_norm, "features": features}


#: Caffe's ``param { lr_mult: 2 decay_mult: 0 }`` of every bias in the authors' nets.
BIAS_LR_MULT = 2.0


def _param_groups(
    module: nn.Module, lr: float, weight_decay: float, orthogonality: bool = False
) -> list[dict[str, Any]]:
    """Optimiser groups as the authors' prototxt sets them.

    Weights (conv, linear, classifier) and PReLU slopes: ``lr``, decayed (a Caffe PReLU layer
    without ``param`` blocks has ``decay_mult: 1``). Biases: ``2 * lr``, not decayed. BatchNorm
    (not in the SphereFace nets; MobileFaceNet has it): ``lr``, not decayed. Hyperspherical
    operators: their own parameters (sigmoid ``k``, radius ``rho``, SphereNorm rescaling) are not
    decayed, and with the ``orthogonality`` regulariser their kernels are not either (it replaces
    weight decay, SphereNet §2.4). OPT layers: ``R``'s parameter is not decayed, and ``ogd``'s is left
    out (:func:`models.nets.opt.ogd_step_` moves it).
    """
    from models.nets.opt import ogd_parameters, rotation_parameters

    norm_types = (nn.BatchNorm1d, nn.BatchNorm2d)
    undecayed = operator_parameters(module) | {id(p) for p in rotation_parameters(module)}
    own_update = {id(p) for p in ogd_parameters(module)}
    decay, biases, norms = [], [], []
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in own_update:
                continue
            if isinstance(sub, norm_types) or id(param) in undecayed:
                norms.append(param)
            elif orthogonality and isinstance(sub, HYPERSPHERICAL_LAYERS) and name == "weight":
                norms.append(param)
            elif name == "bias":
                biases.append(param)
            else:
                decay.append(param)
    return [
        {"params": decay, "lr": lr, "weight_decay": weight_decay},
        {"params": biases, "lr": BIAS_LR_MULT * lr, "weight_decay": 0.0},
        {"params": norms, "lr": lr, "weight_decay": 0.0},
    ]


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of ``config.lr`` at ``step``: optional linear warm-up, then /10 at each milestone."""
    factor = 0.1 ** sum(step >= m for m in config.lr_milestones())
    if config.warmup_steps and step < config.warmup_steps:
        factor *= 0.1 + 0.9 * step / config.warmup_steps
    return factor


def build_model(
    config: TrainConfig, num_classes: int, num_images: int | None = None, processes: int = 1
) -> FaceClassifier:
    """The network of ``config`` and its head (with the lambda schedule), on CPU.

    ``num_images`` (the training set's size) is needed when ``config.lambda_floor_epochs`` is set;
    ``processes`` (torchrun's world size) turns its epochs into steps of the global batch.
    """
    from models.nets import build_network
    from training.losses import build_head
    from training.opt import apply_classifier_opt_as_configured

    net = build_network(
        config.network, config.embedding_size, config.operator_settings(), config.opt_settings()
    )
    if config.weighted_gradients:
        from models.nets.hyperspherical import enable_weighted_gradients

        enable_weighted_gradients(net)
    embedding_size = int(getattr(net, "embedding_size"))  # noqa: B009 - every registered net has it
    options = dict(config.head_options)
    schedule = config.lambda_schedule()
    if schedule is not None:
        if config.lambda_floor_epochs is not None:
            if num_images is None:
                raise ConfigError("lambda_floor_epochs needs the number of training images")
            steps_per_epoch = num_images / config.global_batch(processes)
            schedule = schedule.reaching_floor_at(config.lambda_floor_epochs * steps_per_epoch)
        options.setdefault("lambda_schedule", schedule)
    head = build_head(config.head, embedding_size, num_classes, **options)
    apply_classifier_opt_as_configured(head, config.opt, config.opt_options)
    _renormalise_head(head)
    return FaceClassifier(net, head)


def _renormalise_head(head: nn.Module) -> None:
    """Unit classifier rows for the angular heads of the papers (a no-op for the others)."""
    renormalise = getattr(head, "renormalise_", None)
    if renormalise is not None:
        renormalise()


def _init_from(model: FaceClassifier, path: str) -> None:
    """Start from another run's network (and head when it has the same classes): fine-tuning."""
    state = load_checkpoint(path)
    model.net.load_state_dict(state["net"])
    head_state = model.head.state_dict()
    source = state["head"]
    if "weight" in source and source["weight"].shape == head_state["weight"].shape:
        head_state["weight"] = source["weight"]
        model.head.load_state_dict(head_state)
        log.info("initialised network and classifier from %s", path)
    else:
        log.info("initialised the network from %s (classifier re-initialised: other classes)", path)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    os.replace(partial, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by the trainer (tensors and plain values only: ``weights_only``)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "net" not in state or "config" not in state:
        raise ConfigError(f"{path} is not a checkpoint written by sphereface train")
    return state


# --------------------------------------------------------------------------------------------
# Setting up a session
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    summary: dict[str, Any]


@dataclass
class _Run:
    """Everything one training session holds (set up by :func:`_set_up_run`)."""

    config: TrainConfig
    ctx: DistributedContext
    data: Any
    model: FaceClassifier
    trained: nn.Module  # the model, wrapped in DDP under torchrun
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    loader_kind: str
    bf16: bool
    hooks: StepHooks
    health: HealthCheck
    #: The first session's config (``as_dict``), kept in every checkpoint for the resume check.
    original_config: dict[str, Any]
    start_step: int = 0
    #: The learning rate of the last step taken (of the first parameter group: the weights').
    step_lr: float = 0.0
    lfw: LFWEvaluation | None = None  # the main process's, when the config names an LFW folder
    csv_log: CsvLog | None = None  # the main process's
    verification: VerificationSetsCheck | None = None  # the main process's, for verification_sets

    @property
    def checkpoint_path(self) -> Path:
        return self.config.run_dir / CHECKPOINT_NAME


@dataclass
class _LoopResult:
    history: list[dict[str, Any]]
    metrics: dict[str, Any]
    last_lfw: dict[str, Any] | None
    train_seconds: float
    stopped_at: int


def _bf16_for(config: TrainConfig, device: torch.device) -> bool:
    """bf16 autocast when asked, or under ``auto`` on a GPU with bf16 arithmetic (Ampere, sm_80+)."""
    if config.precision != "auto":
        return config.precision == "bf16"
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _make_loader(config: TrainConfig, data: Any, ctx: DistributedContext, per_rank_batch: int) -> Any:
    from training.data import DeviceResidentLoader, StreamingLoader, fits_on_device

    kind = config.loader
    nbytes = sum(int(np.prod(images.shape)) for images, _ in data.shards)
    if kind == "auto":
        kind = "device" if all_ranks(fits_on_device(nbytes, ctx.device), ctx) else "stream"
    common = {
        "flip": config.flip,
        "seed": config.seed,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "augment": config.augment_options(),
    }
    if kind == "device":
        return DeviceResidentLoader.from_shards(data.shards, per_rank_batch, ctx.device, **common), kind
    return StreamingLoader(data.shards, per_rank_batch, ctx.device, **common), kind


def _classifier_geometry(head: nn.Module) -> dict[str, Any]:
    from training.metrics import hyperspherical_energy, neuron_angles

    weights = head.weight.detach().float().cpu().numpy()
    return {
        "classifier_energy_s2": hyperspherical_energy(weights, power=2),
        "classifier_energy_s0": hyperspherical_energy(weights, power=0),
        "classifier_angles_deg": neuron_angles(weights),
    }


def _set_up_run(config: TrainConfig, ctx: DistributedContext, resume: bool) -> _Run:
    from training.prepare import load_training_set

    if config.threads and ctx.device.type == "cpu":
        torch.set_num_threads(config.threads)
    per_rank_batch = config.batch_per_process(ctx.world_size)
    state = _checkpoint_to_resume(config, resume)
    config, original = _session_config(config, state)
    checkpoint_path = _open_run_dir(config, ctx, state, original)
    seed_everything(config.seed + ctx.rank)
    data = load_training_set(config.data_paths, config.min_photos_per_identity)
    model = build_model(config, data.num_classes, data.num_images, ctx.world_size)
    if state is not None:
        model.net.load_state_dict(state["net"])
        model.head.load_state_dict(state["head"])
    elif config.init_from:
        _init_from(model, config.init_from)
    hooks = build_step_hooks(config, model, device=ctx.device)
    if state is None:
        hooks.before_training()
    model.to(ctx.device)
    if ctx.device.type == "cuda":
        model.net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        _param_groups(model, config.lr, config.weight_decay, config.orthogonality_weight > 0),
        lr=config.lr,
        momentum=config.momentum,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    trained = _distributed(model, ctx)
    loader, loader_kind = _make_loader(config, data, ctx, per_rank_batch)
    health = HealthCheck(
        config.feature_norm_collapse, data.num_classes, config.run_dir, checkpoint_path,
        write_record=ctx.is_main,
    )  # fmt: skip
    bf16 = _bf16_for(config, ctx.device)
    run = _Run(
        config, ctx, data, model, trained, optimizer, scheduler, loader, loader_kind, bf16, hooks, health,
        original.as_dict(),
    )  # fmt: skip
    if state is not None:
        _resume_from(run, state)
    _add_main_process_work(run, per_rank_batch)
    return run


def _checkpoint_to_resume(config: TrainConfig, resume: bool) -> dict[str, Any] | None:
    """The run's checkpoint when ``resume`` and there is one (None: a fresh run)."""
    checkpoint_path = config.run_dir / CHECKPOINT_NAME
    if not checkpoint_path.exists():
        return None
    if not resume:
        raise ConfigError(
            f"{config.run_dir} already holds a run: pass --resume to continue it, or choose another name"
        )
    return load_checkpoint(checkpoint_path)


def _session_config(config: TrainConfig, state: dict[str, Any] | None) -> tuple[TrainConfig, TrainConfig]:
    """(the config this session trains with, the run's original config): ``config`` itself for a
    fresh run; for a resume, checked against the checkpoint's original (training.resume)."""
    if state is None:
        return config, config
    original = original_config(state)
    return resumed_config(original, config, int(state["step"]), config.run_dir), original


def _open_run_dir(
    config: TrainConfig, ctx: DistributedContext, state: dict[str, Any] | None, original: TrainConfig
) -> Path:
    """The run's checkpoint path. The main process writes ``config.toml`` when the run starts (a
    resume keeps it) and, on a resume, the session's changes to ``resumes.jsonl``."""
    run_dir = config.run_dir
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if state is None:
            (run_dir / "config.toml").write_text(config.to_toml())
        else:
            record_resume(run_dir, int(state["step"]), config_changes(original, config), ctx.world_size)
    return run_dir / CHECKPOINT_NAME


def _distributed(model: FaceClassifier, ctx: DistributedContext) -> nn.Module:
    """The model as the processes train it: wrapped in DistributedDataParallel under torchrun."""
    if ctx.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _add_main_process_work(run: _Run, per_rank_batch: int) -> None:
    """The main process's LFW check, verification-set check and CSV log."""
    config, ctx, data = run.config, run.ctx, run.data
    if not ctx.is_main:
        return
    if config.lfw:
        check = LFWCheck(config.lfw, config.lfw_pairs_per_fold, ctx.device, run.bf16, config.lfw_landmarks)
        run.lfw = LFWEvaluation(check, run.model.net, config.lfw_every)
    if config.verification_sets:
        run.verification = VerificationSetsCheck(
            config.verification_sets, run.model.net, ctx.device, run.bf16, config.lfw_every,
            config.run_dir / "verification.csv", run.start_step,
        )  # fmt: skip
    run.csv_log = CsvLog(config.run_dir / "log.csv", run.start_step)
    log.info(
        "training %s: %s + %s on %s (%s loader, %d processes x batch %d, %s), %d faces, %d classes, "
        "steps %d..%d", config.name, config.network, config.head, ctx.device, run.loader_kind,
        ctx.world_size, per_rank_batch, "bf16" if run.bf16 else "fp32", data.num_images,
        data.num_classes, run.start_step, config.steps,
    )  # fmt: skip


def _resume_from(run: _Run, state: dict[str, Any]) -> None:
    """Optimizer, schedule, and this rank's RNG and loader position from a checkpoint."""
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.start_step = int(state["step"])
    run.health.first_feature_norm = state.get("first_feature_norm")
    if "hooks" in state:
        run.hooks.load_state_dict(state["hooks"])
    processes = state.get("processes") or []
    if len(processes) == run.ctx.world_size:
        restore_process_state(processes[run.ctx.rank], run.loader, run.ctx.device)
    else:
        log.warning(
            "the checkpoint was written by %d processes and this run has %d: the weights and "
            "optimizer continue, the data order and random state start afresh (not an exact resume)",
            len(processes), run.ctx.world_size,
        )  # fmt: skip
        run.loader.epoch = int(state.get("epoch", 0))


def _save_run_checkpoint(run: _Run, step: int, metrics: dict[str, Any]) -> None:
    """``checkpoint.pt`` (written by rank 0; collective: every rank must call it)."""
    processes = gather_process_states(run.loader, run.ctx)
    if not run.ctx.is_main:
        return
    config, model = run.config, run.model
    _save_checkpoint(
        run.checkpoint_path,
        {
            "step": step,
            "epoch": run.loader.epoch,
            "config": config.as_dict(),
            "original_config": run.original_config,
            "network": config.network,
            "embedding_size": int(model.net.embedding_size),
            "num_classes": run.data.num_classes,
            "identities": list(run.data.identities),
            "net": model.net.state_dict(),
            "head": model.head.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "processes": processes,
            "hooks": run.hooks.state_dict(),
            "first_feature_norm": run.health.first_feature_norm,
            "metrics": metrics,
        },
    )


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def _train_step(run: _Run, step: int, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """One optimiser step; returns the values to log (device tensors and host floats)."""
    if run.ctx.device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(device_type=run.ctx.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        loss, logits, extras = run.trained(images, labels, step)
        inputs = StepInputs(run.model.net, images, extras["features"])
        total, logged = run.hooks.add_penalties(loss, inputs)
    run.optimizer.zero_grad(set_to_none=True)
    total.backward()
    run.hooks.after_backward(run.optimizer)
    run.optimizer.step()
    run.step_lr = run.optimizer.param_groups[0]["lr"]  # this step's; the scheduler sets the next one's
    run.scheduler.step()
    run.hooks.after_step(run.optimizer, step)
    values: dict[str, Any] = {
        "loss": total.detach(),
        "accuracy": (logits.argmax(1) == labels).float().mean(),
        "feature_norm": extras["feature_norm"],
    }
    for key in ("lambda", "mhe"):
        if key in extras:
            values[key] = extras[key]
    values.update(logged)
    return values


def _interval_row(run: _Run, done: int, stats: IntervalStats, started: float) -> dict[str, Any]:
    """The log row of the interval that ends at step ``done`` (collective: means over the processes)."""
    means = stats.means(run.ctx)
    now = time.perf_counter()
    return {
        "step": done,
        "epoch": run.loader.epoch,
        "loss": means["loss"],
        "accuracy": means["accuracy"],
        "lambda": means.get("lambda"),
        "mhe": means.get("mhe"),
        "distill": means.get("distill"),
        "feature_norm": means.get("feature_norm"),
        "lr": run.step_lr,
        "images_per_s": stats.images * run.ctx.world_size / max(now - stats.started, 1e-9),
        "elapsed_s": now - started,
    }


def _postfix(metrics: dict[str, Any], last_lfw: dict[str, Any] | None) -> dict[str, str]:
    lam = metrics["lambda"]
    return {
        "loss": f"{metrics['loss']:.3f}",
        "acc": f"{metrics['accuracy']:.3f}",
        "|x|": f"{metrics['feature_norm']:.1f}",
        "lam": f"{lam:.1f}" if lam is not None else "-",
        "ips": f"{metrics['images_per_s']:.0f}",
        "lfw": f"{100 * last_lfw['accuracy']:.2f}" if last_lfw else "-",
    }


def _callbacks(run: _Run, until: int, progress: bool, history: History) -> Callbacks:
    """The loop's periodic work, in order: health, LFW, verification sets, CSV log, history, progress,
    checkpoint."""
    config = run.config

    def postfix(row: dict[str, Any]) -> dict[str, str]:
        return _postfix(row, run.lfw.last if run.lfw is not None else None)

    bar = ProgressBar(
        config.steps, config.name, postfix, initial=run.start_step, enabled=progress and run.ctx.is_main,
        unit="step", dynamic_ncols=True,
    )  # fmt: skip
    checkpoints = Checkpointer(partial(_save_run_checkpoint, run), config.checkpoint_every, until)
    return Callbacks([run.health, run.lfw, run.verification, run.csv_log, history, bar, checkpoints])


def _train_loop(run: _Run, until: int, progress: bool) -> _LoopResult:
    """Steps ``run.start_step .. until``; the callbacks log, check and checkpoint along the way."""
    config = run.config
    history = History()
    callbacks = _callbacks(run, until, progress, history)
    started, train_seconds = time.perf_counter(), 0.0
    stats = IntervalStats()
    batches = iter(run.loader)
    run.trained.train()
    done = run.start_step
    try:
        for step in range(run.start_step, until):
            images, labels = next(batches)
            stats.add(_train_step(run, step, images, labels), len(labels))
            done = step + 1
            if done % config.log_every == 0 or done == until:
                train_seconds += time.perf_counter() - stats.started
                row = _interval_row(run, done, stats, started)
                callbacks.on_interval(Interval(done, done == config.steps, row))
                stats = IntervalStats()
            callbacks.on_step(done)
    finally:
        callbacks.close()
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    last_lfw = run.lfw.last if run.lfw is not None else None
    return _LoopResult(history.rows, history.latest, last_lfw, train_seconds, done)


def _write_summary(run: _Run, loop: _LoopResult, checksums: list[str]) -> dict[str, Any]:
    config, ctx, data = run.config, run.ctx, run.data
    summary = {
        "name": config.name,
        "network": config.network,
        "operator": config.operator,
        "operator_options": config.operator_options,
        "opt": config.opt,
        "opt_options": config.opt_options,
        "head": config.head,
        "head_options": config.head_options,
        "init_from": config.init_from,
        "flip": config.flip,
        "augment": config.augment_options().as_dict(),
        "seed": config.seed,
        "steps": config.steps,
        "batch_size": config.global_batch(ctx.world_size),
        "processes": ctx.world_size,
        "device": str(ctx.device),
        "precision": "bf16" if run.bf16 else "fp32",
        "loader": run.loader_kind,
        "data": config.data_paths,
        "min_photos_per_identity": config.min_photos_per_identity,
        "num_images": data.num_images,
        "num_classes": data.num_classes,
        "epochs": config.steps * config.global_batch(ctx.world_size) / data.num_images,
        "train_seconds_this_session": loop.train_seconds,
        "mean_images_per_s": float(np.mean([h["images_per_s"] for h in loop.history]))
        if loop.history
        else None,
        "final": loop.metrics,
        "first_feature_norm": run.health.first_feature_norm,
        "lfw": loop.last_lfw,
        "lfw_landmarks": config.lfw_landmarks if config.lfw else None,
        "verification_sets": run.verification.last if run.verification is not None else None,
        **_classifier_geometry(run.model.head),
        "rank_weight_checksums": checksums,
        "checkpoint": str(run.checkpoint_path),
    }
    run_dir = config.run_dir
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        title = f"{config.name}: {config.network} + {config.head}"
        plot_training_curves(run_dir / "log.csv", run_dir / "curves.png", title)
    except Exception as exc:  # a plot must never lose a finished run
        log.warning("could not plot the training curves: %s", exc)
    return summary


def _nothing_to_train(run: _Run) -> TrainResult:
    """The result of a resumed session that starts where it was asked to stop."""
    summary_path = run.config.run_dir / "summary.json"
    finished = run.start_step == run.config.steps and summary_path.is_file()
    log.info("%s is already at step %d: nothing to train", run.config.run_dir, run.start_step)
    summary = json.loads(summary_path.read_text()) if finished else {}
    return TrainResult(run_dir=run.config.run_dir, steps=run.start_step, summary=summary)


def train(
    config: TrainConfig, *, resume: bool = False, progress: bool = True, until_step: int | None = None
) -> TrainResult:
    """Train ``config``; returns the run folder and its summary (what ``summary.json`` holds).

    ``until_step`` stops the session after that step with a checkpoint (for time-limited jobs:
    ``resume=True`` continues it exactly); the summary is written only when the run reaches
    ``config.steps``.

    A resume of a session that already reached ``until`` trains nothing and rewrites nothing
    (its summary is the one in the run folder, if the run is finished).

    Raises:
        ConfigError: the run folder already has a checkpoint and ``resume`` is False, a resume
            changes the config beyond :data:`TrainConfig.RESUME_MAY_CHANGE` (training.resume), or
            the config does not fit the data (e.g. a batch larger than the dataset).
        FloatingPointError: the loss became NaN or infinite.
        FeatureCollapseError: the features collapsed towards 0 (``feature_norm_collapse``).
    """
    config.validate()
    until = config.steps if until_step is None else min(int(until_step), config.steps)
    ctx = init_distributed(config.device)
    try:
        run = _set_up_run(config, ctx, resume)
        if run.start_step >= until:
            return _nothing_to_train(run)
        loop = _train_loop(run, until, progress)
        summary: dict[str, Any] = {}
        if loop.stopped_at == config.steps:
            checksums = gather_objects(weights_checksum(run.model), ctx)
            if ctx.is_main:
                summary = _write_summary(run, loop, checksums)
    finally:
        if ctx.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return TrainResult(run_dir=config.run_dir, steps=loop.stopped_at, summary=summary)
