"""The trainer: SphereFace / SphereFace+ (and baseline heads) from a prepared dataset.

One entry point, :func:`train`, run directly or under ``torchrun`` (DistributedDataParallel,
several GPUs and nodes; NCCL on GPUs, Gloo on CPU). What it does, per SPEC.md §1.8:

* SGD, momentum 0.9, weight decay 5e-4 (not on biases, PReLU slopes and BatchNorm, as the
  authors' Caffe nets), learning rate 0.1 divided by 10 at 16/28 and 24/28 of the run (the
  papers' 16K and 24K of 28K iterations, scaled to the run's length).
* Horizontal flip; bf16 autocast on CUDA (the classifier heads compute in float32).
* A-Softmax's lambda annealed per step (logged), optional hidden-layer MHE (Eq. 5.4).
* A checkpoint every ``checkpoint_every`` steps and at the end (``checkpoint.pt``, with optimizer,
  schedule, RNG and loader state): ``resume=True`` continues a killed run where it stopped.
* An LFW check (official 10-fold protocol on landmarks.txt-aligned crops) every ``lfw_every``
  steps and at the end; a CSV log (``log.csv``) of loss, accuracy, lambda, MHE, learning rate,
  images/s and LFW; a PNG of the curves; ``summary.json`` with the final numbers, the angular
  Fisher score of LFW features (Eq. A.1) and the hyperspherical energy of the classifier.
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

from training.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
LOG_COLUMNS = (
    "step", "epoch", "loss", "accuracy", "lambda", "mhe", "lr", "images_per_s",
    "lfw_accuracy", "lfw_std", "elapsed_s",
)  # fmt: skip


class FaceClassifier(nn.Module):
    """The embedding network and its training-only classifier head, as one module for DDP."""

    def __init__(self, net: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.head = head

    def forward(self, images: torch.Tensor, labels: torch.Tensor, step: int) -> tuple[Any, Any, dict]:
        """``(B, 3, 112, 96)``, ``(B,)`` -> (loss, logits ``(B, C)``, extras)."""
        out = self.head(self.net(images), labels, step=step)
        return out.loss, out.logits, out.extras


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


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on conv / linear / classifier weights only (not biases, PReLU, BatchNorm)."""
    no_decay_types = (nn.PReLU, nn.BatchNorm1d, nn.BatchNorm2d)
    decay, no_decay = [], []
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if isinstance(sub, no_decay_types) or name == "bias" or param.ndim < 2:
                no_decay.append(param)
            else:
                decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
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

    net = build_network(config.network, config.embedding_size)
    embedding_size = int(getattr(net, "embedding_size"))  # noqa: B009 - every registered net has it
    options = dict(config.head_options)
    if config.head in ("asoftmax", "sphereface_plus"):
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
        elif config.lambda_scale_to_run:
            schedule = schedule.scaled(config.steps)
        options.setdefault("lambda_schedule", schedule)
    head = build_head(config.head, embedding_size, num_classes, **options)
    return FaceClassifier(net, head)


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
    """LFW accuracy of the network being trained, on crops aligned once with ``landmarks.txt``."""

    def __init__(
        self, lfw_dir: str | Path, pairs_per_fold: int | None, device: torch.device, bf16: bool
    ) -> None:
        from training.lfw import aligned_lfw_crops

        started = time.perf_counter()
        self.crops, self.names, self.pairs = aligned_lfw_crops(lfw_dir, workers=2)
        self.quick_pairs = self.pairs.subset(pairs_per_fold) if pairs_per_fold else self.pairs
        quick_names = set(self.quick_pairs.images())
        self.quick_rows = np.array([i for i, n in enumerate(self.names) if n in quick_names])
        self.device = device
        self.bf16 = bf16
        log.info("LFW check: %d crops aligned in %.1f s", len(self.crops), time.perf_counter() - started)

    def __call__(self, net: nn.Module, full: bool) -> dict[str, Any]:
        from training.lfw import lfw_10fold_accuracy, pair_features

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
    from training.lfw import identity_of
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
    """Loss, training accuracy, lambda / learning rate and LFW accuracy against step (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = read_log(log_path)
    fig = Figure(figsize=(10, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    step = cols["step"]
    axes[0, 0].plot(step, cols["loss"], lw=1.2)
    axes[0, 0].set_title("training loss")
    axes[0, 1].plot(step, 100 * cols["accuracy"], lw=1.2)
    axes[0, 1].set_title("training accuracy (%, logits without margin)")
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


def _make_loader(config: TrainConfig, data: Any, ctx: DistributedContext, per_rank_batch: int) -> Any:
    from training.data import DeviceResidentLoader, StreamingLoader, fits_on_device

    kind = config.loader
    nbytes = sum(int(np.prod(images.shape)) for images, _ in data.shards)
    if kind == "auto":
        kind = "device" if fits_on_device(nbytes, ctx.device) else "stream"
    common = {"flip": config.flip, "seed": config.seed, "rank": ctx.rank, "world_size": ctx.world_size}
    if kind == "device":
        images, labels = data.concatenate()
        return DeviceResidentLoader(images, labels, per_rank_batch, ctx.device, **common), kind
    return StreamingLoader(data.shards, per_rank_batch, ctx.device, **common), kind


def _classifier_geometry(head: nn.Module) -> dict[str, Any]:
    from training.metrics import hyperspherical_energy, neuron_angles

    weights = head.weight.detach().float().cpu().numpy()
    return {
        "classifier_energy_s2": hyperspherical_energy(weights, power=2),
        "classifier_energy_s0": hyperspherical_energy(weights, power=0),
        "classifier_angles_deg": neuron_angles(weights),
    }


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> TrainResult:
    """Train ``config``; returns the run folder and its summary (what ``summary.json`` holds).

    Raises:
        ConfigError: the run folder already has a checkpoint and ``resume`` is False, or the
            config does not fit the data (e.g. a batch larger than the dataset).
    """
    from tqdm import tqdm

    from training.prepare import load_prepared

    config.validate()
    ctx = _init_distributed(config.device)
    if config.threads and ctx.device.type == "cpu":
        torch.set_num_threads(config.threads)
    if config.batch_size % ctx.world_size:
        raise ConfigError(f"batch_size {config.batch_size} is not divisible by {ctx.world_size} processes")
    per_rank_batch = config.batch_size // ctx.world_size
    bf16 = config.precision == "bf16" or (config.precision == "auto" and ctx.device.type == "cuda")
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
    data = load_prepared(config.data)
    model = build_model(config, data.num_classes, data.num_images)
    start_step, state = 0, None
    if resume and checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path)
        model.net.load_state_dict(state["net"])
        model.head.load_state_dict(state["head"])
        start_step = int(state["step"])
    elif config.init_from:
        _init_from(model, config.init_from)
    model.to(ctx.device)
    if ctx.device.type == "cuda":
        model.net.to(memory_format=torch.channels_last)

    optimizer = torch.optim.SGD(
        _param_groups(model, config.weight_decay), lr=config.lr, momentum=config.momentum
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
    trained: nn.Module = model
    if ctx.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        trained = DistributedDataParallel(model, device_ids=device_ids)

    loader, loader_kind = _make_loader(config, data, ctx, per_rank_batch)
    loader.epoch = int(state["epoch"]) if state is not None else 0
    hidden_mhe = None
    if config.hidden_mhe_weight > 0:
        from training.losses import HiddenMHE

        hidden_mhe = HiddenMHE(weight=config.hidden_mhe_weight, half_space=config.hidden_mhe_half_space)
    lfw_check = None
    if config.lfw and ctx.is_main:
        lfw_check = LFWCheck(config.lfw, config.lfw_pairs_per_fold, ctx.device, bf16)
    csv_log = CsvLog(run_dir / "log.csv", start_step) if ctx.is_main else None
    if ctx.is_main:
        log.info(
            "training %s: %s + %s on %s (%s loader, %d processes x batch %d, %s), %d faces, %d classes, "
            "steps %d..%d", config.name, config.network, config.head, ctx.device, loader_kind,
            ctx.world_size, per_rank_batch, "bf16" if bf16 else "fp32", data.num_images,
            data.num_classes, start_step, config.steps,
        )  # fmt: skip

    def checkpoint(step: int, metrics: dict[str, Any]) -> None:
        if not ctx.is_main:
            return
        _save_checkpoint(
            checkpoint_path,
            {
                "step": step,
                "epoch": loader.epoch,
                "config": asdict(config),
                "network": config.network,
                "embedding_size": int(model.net.embedding_size),
                "num_classes": data.num_classes,
                "net": model.net.state_dict(),
                "head": model.head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng_cpu": torch.get_rng_state(),
                "metrics": metrics,
            },
        )

    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    interval_start, interval_images, train_seconds = time.perf_counter(), 0, 0.0
    sums: dict[str, torch.Tensor] = {}
    count = 0
    last_lfw: dict[str, Any] | None = None
    metrics: dict[str, Any] = {}
    bar = tqdm(
        total=config.steps, initial=start_step, desc=config.name, unit="step",
        disable=not (progress and ctx.is_main), dynamic_ncols=True,
    )  # fmt: skip
    batches = iter(loader)
    trained.train()
    for step in range(start_step, config.steps):
        images, labels = next(batches)
        if ctx.device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, logits, extras = trained(images, labels, step)
            total = loss + hidden_mhe(model.net) if hidden_mhe is not None else loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            batch_stats = {"loss": total.detach(), "accuracy": (logits.argmax(1) == labels).float().mean()}
            for key in ("lambda", "mhe"):
                if key in extras:
                    batch_stats[key] = torch.as_tensor(extras[key], dtype=torch.float32, device=ctx.device)
            for key, value in batch_stats.items():
                sums[key] = sums[key] + value if key in sums else value.clone()
        count += 1
        interval_images += len(labels) * ctx.world_size
        done = step + 1
        is_last = done == config.steps
        if done % config.log_every == 0 or is_last:
            means = {k: float(v) / count for k, v in sums.items()}  # one device sync per interval
            now = time.perf_counter()
            train_seconds += now - interval_start
            metrics = {
                "step": done,
                "epoch": loader.epoch,
                "loss": means["loss"],
                "accuracy": means["accuracy"],
                "lambda": means.get("lambda"),
                "mhe": means.get("mhe"),
                "lr": optimizer.param_groups[0]["lr"],
                "images_per_s": interval_images / max(now - interval_start, 1e-9),
                "elapsed_s": now - started,
            }
            if not math.isfinite(metrics["loss"]):
                raise FloatingPointError(
                    f"loss became {metrics['loss']} at step {done}; lower lr or the MHE weight "
                    f"(the last good checkpoint is {checkpoint_path})"
                )
            if lfw_check is not None and (is_last or (config.lfw_every and done % config.lfw_every == 0)):
                last_lfw = lfw_check(model.net, full=is_last)
                metrics["lfw_accuracy"], metrics["lfw_std"] = last_lfw["accuracy"], last_lfw["std"]
            if csv_log is not None:
                csv_log.write(metrics)
            history.append(metrics)
            bar.set_postfix(
                loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                lam=f"{metrics['lambda']:.1f}" if metrics["lambda"] is not None else "-",
                ips=f"{metrics['images_per_s']:.0f}",
                lfw=f"{100 * last_lfw['accuracy']:.2f}" if last_lfw else "-",
            )  # fmt: skip
            sums, count, interval_images = {}, 0, 0
            interval_start = time.perf_counter()
        bar.update(1)
        if ctx.is_main and (done % config.checkpoint_every == 0 or is_last):
            checkpoint(done, metrics)
    bar.close()

    summary: dict[str, Any] = {}
    if ctx.is_main:
        summary = {
            "name": config.name,
            "network": config.network,
            "head": config.head,
            "head_options": config.head_options,
            "init_from": config.init_from,
            "steps": config.steps,
            "batch_size": config.batch_size,
            "processes": ctx.world_size,
            "device": str(ctx.device),
            "precision": "bf16" if bf16 else "fp32",
            "loader": loader_kind,
            "num_images": data.num_images,
            "num_classes": data.num_classes,
            "epochs": config.steps * config.batch_size / data.num_images,
            "train_seconds_this_session": train_seconds,
            "mean_images_per_s": float(np.mean([h["images_per_s"] for h in history])) if history else None,
            "final": metrics,
            "lfw": last_lfw,
            **_classifier_geometry(model.head),
            "checkpoint": str(checkpoint_path),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:
            title = f"{config.name}: {config.network} + {config.head}"
            plot_training_curves(run_dir / "log.csv", run_dir / "curves.png", title)
        except Exception as exc:  # a plot must never lose a finished run
            log.warning("could not plot the training curves: %s", exc)
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return TrainResult(run_dir=run_dir, steps=config.steps, summary=summary)


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
