"""The trainer: SphereFace / SphereFace+ (and baseline heads) from a prepared dataset.

One entry point, :func:`train`, run directly or under ``torchrun`` (DistributedDataParallel,
several GPUs and nodes; NCCL on GPUs, Gloo on CPU). What it does, per SPEC.md §1.8:

* SGD, momentum 0.9, weight decay 5e-4 as the authors' Caffe nets (``sphereface_model.prototxt``):
  weights and PReLU slopes decayed, biases at twice the learning rate and not decayed (BatchNorm,
  which those nets lack, is not decayed either); learning rate 0.1 divided by 10 at 16/28 and
  24/28 of the run (the papers' 16K and 24K of 28K iterations, scaled to the run's length).
* The angular heads' classifier rows are put back on the unit sphere after every step, as the
  Caffe layer does on every forward pass.
* Horizontal flip, and optionally more augmentation (:mod:`training.augment`); bf16 autocast
  on GPUs that compute in bf16 (Ampere and later; fp32 before);
  the classifier heads compute in float32.
* A-Softmax's lambda per Caffe iteration (logged), optional hidden-layer MHE (Eq. 5.4).
* A checkpoint every ``checkpoint_every`` steps and at the end (``checkpoint.pt``: network, head,
  optimizer, schedule, and every process's RNG and loader position): ``resume=True`` continues a
  killed run exactly (the weights equal those of an uninterrupted run, bit for bit on CPU).
* The mean feature norm ||x|| is logged; a run whose features collapse towards 0 stops with a
  message instead of training on (``feature_norm_collapse``).
* An LFW check (official 10-fold protocol, crops aligned with the same MTCNN landmarks as the
  training data) every ``lfw_every`` steps and at the end; a CSV log (``log.csv``) of loss,
  accuracy, lambda, MHE, ||x||, learning rate, images/s and LFW; a PNG of the curves;
  ``summary.json`` with the final numbers, the angular Fisher score of LFW features (Eq. A.1)
  and the hyperspherical energy of the classifier.
* Under torchrun the logged loss, accuracy and ||x|| are means over all processes, a NaN stops
  every process at the same step, and the summary records a checksum of every rank's weights.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.nets.hyperspherical import (
    HYPERSPHERICAL_LAYERS,
    operator_parameters,
    orthogonality_penalty,
    project_weights_,
)
from training.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
#: Written when a run stops early on a NaN loss or collapsed features: step, reason, message.
STOPPED_NAME = "stopped.json"
LOG_COLUMNS = (
    "step", "epoch", "loss", "accuracy", "lambda", "mhe", "distill", "feature_norm", "lr", "images_per_s",
    "lfw_accuracy", "lfw_std", "elapsed_s",
)  # fmt: skip


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


@dataclass
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _init_distributed(device_choice: str) -> DistributedContext:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = 'cuda' but torch sees no CUDA device")
    if world_size == 1:
        return DistributedContext(device=torch.device("cuda" if use_cuda else "cpu"))
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return DistributedContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


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


def build_model(config: TrainConfig, num_classes: int, num_images: int | None = None) -> FaceClassifier:
    """The network of ``config`` and its head (with the lambda schedule), on CPU.

    ``num_images`` (the training set's size) is needed when ``config.lambda_floor_epochs`` is set.
    """
    from models.nets import build_network
    from training.losses import LambdaSchedule, build_head
    from training.opt import apply_classifier_opt_as_configured

    net = build_network(
        config.network, config.embedding_size, config.operator_settings(), config.opt_settings()
    )
    if config.weighted_gradients:
        from models.nets.hyperspherical import enable_weighted_gradients

        enable_weighted_gradients(net)
    embedding_size = int(getattr(net, "embedding_size"))  # noqa: B009 - every registered net has it
    options = dict(config.head_options)
    if config.head in ("asoftmax", "sphereface_plus", "ga_softmax"):
        schedule = LambdaSchedule(
            base=config.lambda_base,
            gamma=config.lambda_gamma,
            power=config.lambda_power,
            minimum=config.lambda_min,
        )
        if config.lambda_floor_epochs is not None:
            if num_images is None:
                raise ConfigError("lambda_floor_epochs needs the number of training images")
            schedule = schedule.reaching_floor_at(config.lambda_floor_epochs * num_images / config.batch_size)
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


# --------------------------------------------------------------------------------------------
# LFW check during training
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def embed_crops(
    net: nn.Module, crops: np.ndarray, device: torch.device, batch_size: int = 256, bf16: bool = False
) -> np.ndarray:
    """Fused features of aligned crops with a PyTorch network: ``[f(x); f(flip(x))]`` (SPEC §1.10).

    Args:
        crops: ``(N, 112, 96, 3)`` uint8 RGB.

    Returns:
        ``(N, 2D)`` float32, not normalised (the LFW protocol normalises after mean subtraction).
    """
    from training.data import to_network_input

    was_training = net.training
    net.eval()
    out = []
    try:
        for start in range(0, len(crops), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(crops[start : start + batch_size])).to(device)
            x = to_network_input(batch)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                both = net(torch.cat([x, x.flip(3)]))
            both = both.float()
            n = len(x)
            out.append(torch.cat([both[:n], both[n:]], dim=1).cpu().numpy())
    finally:
        net.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


class LFWCheck:
    """LFW accuracy of the network being trained, on crops aligned once.

    ``landmarks="detect"`` (the default of the trainer) aligns LFW with our MTCNN's landmarks, as
    the training data and the service are; ``"file"`` uses ``landmarks.txt``.
    """

    def __init__(
        self,
        lfw_dir: str | Path,
        pairs_per_fold: int | None,
        device: torch.device,
        bf16: bool,
        landmarks: str = "detect",
    ) -> None:
        from training.evaluation.lfw import aligned_lfw_crops

        started = time.perf_counter()
        self.crops, self.names, self.pairs = aligned_lfw_crops(lfw_dir, workers=2, landmarks=landmarks)
        self.quick_pairs = self.pairs.subset(pairs_per_fold) if pairs_per_fold else self.pairs
        quick_names = set(self.quick_pairs.images())
        self.quick_rows = np.array([i for i, n in enumerate(self.names) if n in quick_names])
        self.device = device
        self.bf16 = bf16
        log.info("LFW check: %d crops aligned in %.1f s", len(self.crops), time.perf_counter() - started)

    def __call__(self, net: nn.Module, full: bool) -> dict[str, Any]:
        from training.evaluation.lfw_files import pair_features
        from training.evaluation.verification import lfw_10fold_accuracy

        started = time.perf_counter()
        pairs = self.pairs if full else self.quick_pairs
        rows = np.arange(len(self.names)) if full else self.quick_rows
        names = [self.names[i] for i in rows]
        features = embed_crops(net, self.crops[rows], self.device, bf16=self.bf16)
        left, right = pair_features(features, names, pairs)
        result = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold)
        out: dict[str, Any] = {
            "accuracy": result.accuracy,
            "std": result.std,
            "pairs": len(pairs),
            "seconds": time.perf_counter() - started,
        }
        if full:
            out["angular_fisher_score"] = _lfw_afs(features, names)
        return out


def _lfw_afs(features: np.ndarray, names: list[str]) -> float | None:
    """Angular Fisher score (Eq. A.1) of LFW features over the people with 2+ images."""
    from training.evaluation.lfw_files import identity_of
    from training.metrics import angular_fisher_score

    people = np.array([identity_of(n) for n in names])
    unique, counts = np.unique(people, return_counts=True)
    keep = np.isin(people, unique[counts >= 2])
    if keep.sum() < 4:
        return None
    _, labels = np.unique(people[keep], return_inverse=True)
    return float(angular_fisher_score(features[keep], labels))


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------


class CsvLog:
    """Appends rows of :data:`LOG_COLUMNS` to ``log.csv`` (kept across resumes)."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        rows = []
        if path.is_file():
            with path.open(newline="") as handle:
                rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= resume_step]
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, LOG_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, LOG_COLUMNS)
            writer.writerow({k: _fmt(row.get(k)) for k in LOG_COLUMNS})


def _fmt(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def read_log(path: str | Path) -> dict[str, np.ndarray]:
    """``log.csv`` as columns of floats (NaN where a row has no value)."""
    with Path(path).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {k: np.array([float(r[k]) if r.get(k) else np.nan for r in rows]) for k in LOG_COLUMNS}


def plot_training_curves(log_path: str | Path, out: str | Path, title: str) -> Path:
    """Loss, training accuracy, mean feature norm, lambda / learning rate, LFW accuracy and the
    MHE term (when logged) against step (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = read_log(log_path)
    fig = Figure(figsize=(14, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    step = cols["step"]
    axes[0, 0].plot(step, cols["loss"], lw=1.2)
    axes[0, 0].set_title("training loss")
    axes[0, 1].plot(step, 100 * cols["accuracy"], lw=1.2)
    axes[0, 1].set_title("training accuracy (%, logits without margin)")
    axes[0, 2].plot(step, cols["feature_norm"], lw=1.2, color="tab:green")
    axes[0, 2].set_title("mean feature norm ||x||")
    axes[0, 2].set_ylim(bottom=0)
    has_mhe = np.isfinite(cols["mhe"])
    has_distill = np.isfinite(cols["distill"])
    if has_mhe.any():
        axes[1, 2].plot(step[has_mhe], cols["mhe"][has_mhe], lw=1.2, color="tab:purple")
        axes[1, 2].set_title("output-layer MHE term (unweighted)")
    elif has_distill.any():
        axes[1, 2].plot(step[has_distill], cols["distill"][has_distill], lw=1.2, color="tab:purple")
        axes[1, 2].set_title("distillation term: mean squared cosine gap (unweighted)")
    else:
        axes[1, 2].set_axis_off()
    ax = axes[1, 0]
    ax.plot(step, cols["lr"], lw=1.2, color="tab:blue", label="learning rate")
    ax.set_yscale("log")
    ax.set_title("learning rate and lambda")
    if (cols["lambda"] > 0).any():  # heads without a margin log lambda 0 or nothing
        twin = ax.twinx()
        twin.plot(step, np.where(cols["lambda"] > 0, cols["lambda"], np.nan), lw=1.2, color="tab:red")
        twin.set_yscale("log")
        twin.set_ylabel("lambda", color="tab:red")
    ax.set_ylabel("learning rate", color="tab:blue")
    has_lfw = np.isfinite(cols["lfw_accuracy"])
    axes[1, 1].plot(step[has_lfw], 100 * cols["lfw_accuracy"][has_lfw], "o-", lw=1.2)
    axes[1, 1].set_title("LFW 10-fold accuracy (%)")
    for a in axes.flat:
        if not a.axison:
            continue
        a.set_xlabel("step")
        a.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    return out


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
# The loop
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    summary: dict[str, Any]


class FeatureCollapseError(RuntimeError):
    """The features shrank towards 0 (loss -> ln C, accuracy -> 0): the run cannot recover."""


def _bf16_for(config: TrainConfig, device: torch.device) -> bool:
    """bf16 autocast when asked, or under ``auto`` on a GPU with bf16 arithmetic (Ampere, sm_80+)."""
    if config.precision != "auto":
        return config.precision == "bf16"
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _all_ranks(flag: bool, ctx: DistributedContext) -> bool:
    """True only when ``flag`` is true on every process (each rank must take the same decision)."""
    if ctx.world_size == 1:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _make_loader(config: TrainConfig, data: Any, ctx: DistributedContext, per_rank_batch: int) -> Any:
    from training.data import DeviceResidentLoader, StreamingLoader, fits_on_device

    kind = config.loader
    nbytes = sum(int(np.prod(images.shape)) for images, _ in data.shards)
    if kind == "auto":
        kind = "device" if _all_ranks(fits_on_device(nbytes, ctx.device), ctx) else "stream"
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


# --------------------------------------------------------------------------------------------
# Every process's random state and loader position (exact resume)
# --------------------------------------------------------------------------------------------


def _process_state(loader: Any, device: torch.device) -> dict[str, Any]:
    """This process's RNGs (torch, CUDA, python) and loader position, checkpointable.

    (numpy's global RNG is not used anywhere in training: every numpy draw has its own seeded
    generator.)
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "loader": loader.state_dict(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_process_state(state: dict[str, Any], loader: Any, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    loader.load_state_dict(state["loader"])


def _gather_process_states(loader: Any, ctx: DistributedContext) -> list[dict[str, Any]]:
    """Every rank's :func:`_process_state`, in rank order (collective: every rank must call it)."""
    return _gather_objects(_process_state(loader, ctx.device), ctx)


def _weights_checksum(module: nn.Module) -> str:
    """A hash of every parameter's bytes (equal on every rank when DDP keeps them in step)."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _gather_objects(value: Any, ctx: DistributedContext) -> list[Any]:
    if ctx.world_size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


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
    start_step: int
    hidden_mhe: Any = None
    opt: Any = None  # training.opt.OPTTraining when the config sets opt
    teacher: Any = None  # training.distill.TeacherEmbedder when the config distils
    lfw_check: LFWCheck | None = None
    csv_log: CsvLog | None = None
    first_feature_norm: float | None = None

    @property
    def checkpoint_path(self) -> Path:
        return self.config.run_dir / CHECKPOINT_NAME


class _IntervalStats:
    """Per-step values summed on the device between two log lines (one sync per interval).

    ``lambda`` is a python float of the schedule and is summed on the host: no host-to-device
    copy per step.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.host_sums: dict[str, float] = {}
        self.steps = 0
        self.images = 0
        self.started = time.perf_counter()

    def add(self, values: dict[str, Any], images: int) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().float()
                self.sums[key] = self.sums[key] + value if key in self.sums else value.clone()
            else:
                self.host_sums[key] = self.host_sums.get(key, 0.0) + float(value)
        self.steps += 1
        self.images += images

    def means(self, ctx: DistributedContext) -> dict[str, float]:
        """Interval means; under torchrun the device sums are averaged over all processes."""
        keys = sorted(self.sums)
        out = {k: v / self.steps for k, v in self.host_sums.items()}
        if not keys:
            return out
        stacked = torch.stack([self.sums[k] for k in keys])
        if ctx.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(stacked)
            stacked = stacked / ctx.world_size
        values = (stacked / self.steps).tolist()  # the one device sync of the interval
        out.update(zip(keys, values, strict=True))
        return out


def _set_up_run(config: TrainConfig, ctx: DistributedContext, resume: bool) -> _Run:
    from training.prepare import load_training_set

    if config.threads and ctx.device.type == "cpu":
        torch.set_num_threads(config.threads)
    if config.batch_size % ctx.world_size:
        raise ConfigError(f"batch_size {config.batch_size} is not divisible by {ctx.world_size} processes")
    per_rank_batch = config.batch_size // ctx.world_size
    run_dir = config.run_dir
    checkpoint_path = run_dir / CHECKPOINT_NAME
    if checkpoint_path.exists() and not resume:
        raise ConfigError(
            f"{run_dir} already holds a run: pass --resume to continue it, or choose another name"
        )
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config.to_toml())

    _seed_everything(config.seed + ctx.rank)
    data = load_training_set(config.data_paths, config.min_photos_per_identity)
    model = build_model(config, data.num_classes, data.num_images)
    state = load_checkpoint(checkpoint_path) if resume and checkpoint_path.exists() else None
    if state is not None:
        model.net.load_state_dict(state["net"])
        model.head.load_state_dict(state["head"])
    elif config.init_from:
        _init_from(model, config.init_from)
    if state is None and config.opt != "none":
        _refine_opt_neurons(model.net, config)
    model.to(ctx.device)
    if ctx.device.type == "cuda":
        model.net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        _param_groups(model, config.lr, config.weight_decay, config.orthogonality_weight > 0),
        lr=config.lr,
        momentum=config.momentum,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    trained: nn.Module = model
    if ctx.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        trained = DistributedDataParallel(model, device_ids=device_ids)
    loader, loader_kind = _make_loader(config, data, ctx, per_rank_batch)
    bf16 = _bf16_for(config, ctx.device)
    run = _Run(config, ctx, data, model, trained, optimizer, scheduler, loader, loader_kind, bf16, 0)
    if state is not None:
        _resume_from(run, state)
    if config.opt != "none":
        from training.opt import OPTTraining

        # the whole model: the head is OPT-trained too under CLS-OPT; one seed for every rank, so
        # that all draw the same S-OPT coordinates
        run.opt = OPTTraining(model, config.opt, config.opt_options, seed=config.seed)
    if config.hidden_mhe_weight > 0:
        from training.comhe import hidden_regulariser

        run.hidden_mhe = hidden_regulariser(
            config.hidden_mhe_weight, config.hidden_mhe_half_space, config.hidden_mhe_projection,
            config.hidden_mhe_options, seed=config.seed,
        )  # fmt: skip
    if config.distill_weight > 0:
        run.teacher = _load_teacher(config, ctx)
    if config.lfw and ctx.is_main:
        run.lfw_check = LFWCheck(
            config.lfw, config.lfw_pairs_per_fold, ctx.device, bf16, config.lfw_landmarks
        )
    if ctx.is_main:
        run.csv_log = CsvLog(run_dir / "log.csv", run.start_step)
        log.info(
            "training %s: %s + %s on %s (%s loader, %d processes x batch %d, %s), %d faces, %d classes, "
            "steps %d..%d", config.name, config.network, config.head, ctx.device, loader_kind,
            ctx.world_size, per_rank_batch, "bf16" if bf16 else "fp32", data.num_images,
            data.num_classes, run.start_step, config.steps,
        )  # fmt: skip
    return run


def _load_teacher(config: TrainConfig, ctx: DistributedContext) -> Any:
    from models.registry import resolve_model
    from training.distill import TeacherEmbedder

    try:
        teacher = TeacherEmbedder(resolve_model(config.distill_from), ctx.device, threads=config.threads)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    log.info("distilling %s's pairwise cosines, weight %g", teacher.model_id, config.distill_weight)
    return teacher


def _refine_opt_neurons(net: nn.Module, config: TrainConfig) -> None:
    """OPT's optional pre-training energy minimisation of the fixed neurons ``v`` (§3.7)."""
    from training.opt import describe_refinement, refine_as_configured

    energies = refine_as_configured(net, config.opt, config.opt_options)
    if energies:
        log.info("OPT: hyperspherical energy of v refined, per layer: %s", describe_refinement(energies))


def _resume_from(run: _Run, state: dict[str, Any]) -> None:
    """Optimizer, schedule, and this rank's RNG and loader position from a checkpoint."""
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.start_step = int(state["step"])
    run.first_feature_norm = state.get("first_feature_norm")
    processes = state.get("processes") or []
    if len(processes) == run.ctx.world_size:
        _restore_process_state(processes[run.ctx.rank], run.loader, run.ctx.device)
    else:
        log.warning(
            "the checkpoint was written by %d processes and this run has %d: the weights and "
            "optimizer continue, the data order and random state start afresh (not an exact resume)",
            len(processes), run.ctx.world_size,
        )  # fmt: skip
        run.loader.epoch = int(state.get("epoch", 0))


def _save_run_checkpoint(run: _Run, step: int, metrics: dict[str, Any]) -> None:
    """``checkpoint.pt`` (written by rank 0; collective: every rank must call it)."""
    processes = _gather_process_states(run.loader, run.ctx)
    if not run.ctx.is_main:
        return
    config, model = run.config, run.model
    _save_checkpoint(
        run.checkpoint_path,
        {
            "step": step,
            "epoch": run.loader.epoch,
            "config": asdict(config),
            "network": config.network,
            "embedding_size": int(model.net.embedding_size),
            "num_classes": run.data.num_classes,
            "identities": list(run.data.identities),
            "net": model.net.state_dict(),
            "head": model.head.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "processes": processes,
            "first_feature_norm": run.first_feature_norm,
            "metrics": metrics,
        },
    )


def _train_step(run: _Run, step: int, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """One optimiser step; returns the values to log (device tensors and host floats)."""
    if run.ctx.device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(device_type=run.ctx.device.type, dtype=torch.bfloat16, enabled=run.bf16):
        loss, logits, extras = run.trained(images, labels, step)
        total = loss + run.hidden_mhe(run.model.net) if run.hidden_mhe is not None else loss
        if run.config.orthogonality_weight > 0:
            total = total + run.config.orthogonality_weight * orthogonality_penalty(run.model.net)
        opt_penalty = run.opt.penalty() if run.opt is not None else None
        if opt_penalty is not None:
            total = total + opt_penalty
        distill = None
        if run.teacher is not None:
            distill = run.teacher.distillation_loss(extras["features"], images)
            total = total + run.config.distill_weight * distill
    run.optimizer.zero_grad(set_to_none=True)
    total.backward()
    if run.opt is not None:
        run.opt.after_backward(run.optimizer.param_groups[0]["lr"])
    run.optimizer.step()
    run.scheduler.step()
    if run.opt is not None:
        run.opt.after_step(run.optimizer, step)
    _renormalise_head(run.model.head)
    every = run.config.weight_projection_every
    if every and (step + 1) % every == 0:
        project_weights_(run.model.net)
    values: dict[str, Any] = {
        "loss": total.detach(),
        "accuracy": (logits.argmax(1) == labels).float().mean(),
        "feature_norm": extras["feature_norm"],
    }
    for key in ("lambda", "mhe"):
        if key in extras:
            values[key] = extras[key]
    if distill is not None:
        values["distill"] = distill.detach()
    return values


def _check_health(run: _Run, done: int, metrics: dict[str, Any]) -> None:
    """Stop on a NaN loss or collapsed features (every rank sees the same all-reduced means)."""
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(
            f"loss became {metrics['loss']} at step {done}; lower lr or the MHE weight "
            f"(the last good checkpoint is {run.checkpoint_path})"
        )
    norm = metrics.get("feature_norm")
    if norm is None or run.config.feature_norm_collapse <= 0:
        return
    if run.first_feature_norm is None:
        run.first_feature_norm = norm
        return
    if norm < run.config.feature_norm_collapse * run.first_feature_norm:
        raise FeatureCollapseError(
            f"the features collapsed at step {done}: mean ||x|| fell from {run.first_feature_norm:.3g} "
            f"to {norm:.3g} (loss {metrics['loss']:.3f}, ln C = {math.log(run.data.num_classes):.3f}; "
            f"training accuracy {100 * metrics['accuracy']:.1f}%). The network lowers the loss by "
            "shrinking its features and will not recover. Usual causes: lambda reaching its floor "
            "before the network has learnt (lambda_floor_epochs), a learning rate too high for the "
            "batch, or a margin too large for the data. Set feature_norm_collapse = 0 to train on "
            f"anyway; the last checkpoint is {run.checkpoint_path}"
        )


def _every(done: int, interval: int) -> bool:
    """Whether step ``done`` ends an interval of ``interval`` steps (0: no intervals)."""
    return interval > 0 and done % interval == 0


def _log_interval(run: _Run, done: int, stats: _IntervalStats, started: float, is_last: bool) -> dict:
    means = stats.means(run.ctx)
    now = time.perf_counter()
    metrics: dict[str, Any] = {
        "step": done,
        "epoch": run.loader.epoch,
        "loss": means["loss"],
        "accuracy": means["accuracy"],
        "lambda": means.get("lambda"),
        "mhe": means.get("mhe"),
        "distill": means.get("distill"),
        "feature_norm": means.get("feature_norm"),
        "lr": run.optimizer.param_groups[0]["lr"],
        "images_per_s": stats.images * run.ctx.world_size / max(now - stats.started, 1e-9),
        "elapsed_s": now - started,
    }
    try:
        _check_health(run, done, metrics)
    except (FloatingPointError, FeatureCollapseError) as exc:
        if run.csv_log is not None:  # the interval that stopped the run, for its curves and tables
            run.csv_log.write(metrics)
        if run.ctx.is_main:
            stopped = {"step": done, "reason": type(exc).__name__, "message": str(exc)}
            (run.config.run_dir / STOPPED_NAME).write_text(json.dumps(stopped, indent=2) + "\n")
        raise
    if run.lfw_check is not None and (is_last or _every(done, run.config.lfw_every)):
        lfw = run.lfw_check(run.model.net, full=is_last)
        metrics["lfw_accuracy"], metrics["lfw_std"] = lfw["accuracy"], lfw["std"]
        metrics["lfw"] = lfw
    if run.csv_log is not None:
        run.csv_log.write(metrics)
    return metrics


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


@dataclass
class _LoopResult:
    history: list[dict[str, Any]]
    metrics: dict[str, Any]
    last_lfw: dict[str, Any] | None
    train_seconds: float
    stopped_at: int


def _train_loop(run: _Run, until: int, progress: bool) -> _LoopResult:
    """Steps ``run.start_step .. until``; logs, checks health and checkpoints along the way."""
    from tqdm import tqdm

    config, ctx = run.config, run.ctx
    history: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    last_lfw: dict[str, Any] | None = None
    started, train_seconds = time.perf_counter(), 0.0
    stats = _IntervalStats()
    bar = tqdm(
        total=config.steps, initial=run.start_step, desc=config.name, unit="step",
        disable=not (progress and ctx.is_main), dynamic_ncols=True,
    )  # fmt: skip
    batches = iter(run.loader)
    run.trained.train()
    done = run.start_step
    try:
        for step in range(run.start_step, until):
            images, labels = next(batches)
            stats.add(_train_step(run, step, images, labels), len(labels))
            done = step + 1
            is_last = done == config.steps
            if done % config.log_every == 0 or done == until:
                train_seconds += time.perf_counter() - stats.started
                metrics = _log_interval(run, done, stats, started, is_last)
                last_lfw = metrics.pop("lfw", last_lfw)
                history.append(metrics)
                bar.set_postfix(_postfix(metrics, last_lfw))
                stats = _IntervalStats()
            bar.update(1)
            if _every(done, config.checkpoint_every) or done == until:
                _save_run_checkpoint(run, done, metrics)
    finally:
        bar.close()
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    return _LoopResult(history, metrics, last_lfw, train_seconds, done)


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
        "batch_size": config.batch_size,
        "processes": ctx.world_size,
        "device": str(ctx.device),
        "precision": "bf16" if run.bf16 else "fp32",
        "loader": run.loader_kind,
        "data": config.data_paths,
        "min_photos_per_identity": config.min_photos_per_identity,
        "num_images": data.num_images,
        "num_classes": data.num_classes,
        "epochs": config.steps * config.batch_size / data.num_images,
        "train_seconds_this_session": loop.train_seconds,
        "mean_images_per_s": float(np.mean([h["images_per_s"] for h in loop.history]))
        if loop.history
        else None,
        "final": loop.metrics,
        "first_feature_norm": run.first_feature_norm,
        "lfw": loop.last_lfw,
        "lfw_landmarks": config.lfw_landmarks if config.lfw else None,
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


def train(
    config: TrainConfig, *, resume: bool = False, progress: bool = True, until_step: int | None = None
) -> TrainResult:
    """Train ``config``; returns the run folder and its summary (what ``summary.json`` holds).

    ``until_step`` stops the session after that step with a checkpoint (for time-limited jobs:
    ``resume=True`` continues it exactly); the summary is written only when the run reaches
    ``config.steps``.

    Raises:
        ConfigError: the run folder already has a checkpoint and ``resume`` is False, or the
            config does not fit the data (e.g. a batch larger than the dataset).
        FloatingPointError: the loss became NaN or infinite.
        FeatureCollapseError: the features collapsed towards 0 (``feature_norm_collapse``).
    """
    config.validate()
    until = config.steps if until_step is None else min(int(until_step), config.steps)
    ctx = _init_distributed(config.device)
    try:
        run = _set_up_run(config, ctx, resume)
        loop = _train_loop(run, until, progress)
        summary: dict[str, Any] = {}
        if loop.stopped_at == config.steps:
            checksums = _gather_objects(_weights_checksum(run.model), ctx)
            if ctx.is_main:
                summary = _write_summary(run, loop, checksums)
    finally:
        if ctx.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return TrainResult(run_dir=config.run_dir, steps=loop.stopped_at, summary=summary)


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
