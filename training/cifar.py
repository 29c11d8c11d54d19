"""CIFAR-10 runs for SphereNet's claims (SphereNet §4): a plain CNN-N, any operator, any head.

``sphereface train CONFIG`` runs one when the config says ``task = "cifar10"``::

    task = "cifar10"
    name = "cnn9_sigmoid_w_softmax"
    operator = "sphereconv"
    operator_options = { angular = "sigmoid", k = 0.3 }
    head = "w_softmax"
    head_options = { g = "cosine" }

What it does (SphereNet §4.1, scaled to a CPU; every setting is in :class:`CifarConfig`):

* data: the 50,000 training and 10,000 test images of ``../shared/data/cifar10`` (JPEG copies of
  CIFAR-10), decoded once into ``.cache/data/cifar10.npz``; per-channel mean/std normalisation;
  horizontal flips only (the paper's "CIFAR-10" setting, not "CIFAR-10+");
* network: :class:`models.nets.plain_cnn.PlainCNN` (Table B.1) at a chosen width, with its
  convolutions (and FC) turned into the chosen hyperspherical operator;
* ADAM at lr 0.001, batch 128, the learning rate divided by 10 at 34/64 and 54/64 of the run (the
  paper's 34K and 54K of 64K iterations); the margin heads' lambda anneals as A-Softmax's;
* a CSV log of training loss and accuracy every ``log_every`` steps and test accuracy every
  ``eval_every`` steps (``log.csv``), the final accuracy on all 10,000 test images, the time per
  step, the parameter count (``summary.json``) and a PNG of the curves.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from training.callbacks import Callback, Callbacks, History, Interval, ProgressBar
from training.config import ConfigError, RunConfig, read_toml
from training.opt import apply_classifier_opt_as_configured, layer_energies, trainable_parameters
from training.regularisers import build_step_hooks
from training.step_hooks import StepHooks, StepInputs

log = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: Per-channel mean and std of the CIFAR-10 training images (RGB, 0-1 scale).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
LOG_COLUMNS = ("step", "loss", "accuracy", "test_accuracy", "lr", "lambda", "elapsed_s")


@dataclass
class CifarConfig(RunConfig):
    """Every setting of a CIFAR-10 run (defaults: SphereNet §4.1 at a CPU's width and length).

    The fields the face trainer shares (head, operator, OPT, hidden MHE, optimiser, ...) are
    :class:`training.config.RunConfig`'s; here are the CIFAR-10 ones and the defaults that differ.
    """

    task: str = "cifar10"
    name: str = "cnn9"
    out_dir: str = "runs/hyperspherical"
    #: The archive of ../shared/data/cifar10 and the decoded cache.
    archive: str = "../shared/data/cifar10/cifar10-jpg.tar.gz"
    cache: str = ".cache/data/cifar10.npz"
    #: Convolutions per stage: CNN-3n (3 -> CNN-9, Table B.1).
    convs_per_stage: int = 3
    #: Channels of the three stages; the paper's are [64, 96, 128].
    widths: list[int] = field(default_factory=lambda: [64, 96, 128])
    embedding_size: int = 256
    batch_norm: bool = True
    relu: bool = True
    #: Also make the FC layer a hyperspherical one (SphereNet: FC is SphereConv's special case).
    operator_fc: bool = True
    head: str = "softmax"
    batch_size: int = 128
    steps: int = 64000
    lr: float = 1e-3
    #: The paper's 34K and 54K of 64K iterations.
    lr_drops: list[float] = field(default_factory=lambda: [34 / 64, 54 / 64])
    weight_decay: float = 0.0
    #: ``adam`` (SphereNet's CIFAR runs) or ``sgd`` with ``momentum`` (the OPT paper's: lr 0.1, 0.9).
    optimizer: str = "adam"
    #: Use only the first N training images of each class (None: all 5,000).
    train_per_class: int | None = None
    log_every: int = 25
    eval_every: int = 200
    #: Test images used by the periodic check, a fixed random sample of every class (the final check
    #: uses all 10,000).
    eval_images: int = 2000
    threads: int = 1

    FIELD_ORDER: ClassVar[tuple[str, ...]] = (
        "task", "name", "out_dir", "archive", "cache", "convs_per_stage", "widths", "embedding_size",
        "batch_norm", "relu", "operator", "operator_options", "operator_fc", "orthogonality_weight",
        "weight_projection_every", "weighted_gradients", "head", "head_options", "lambda_base",
        "lambda_gamma", "lambda_power", "lambda_min", "batch_size", "steps", "lr", "lr_drops",
        "weight_decay", "optimizer", "momentum", "opt", "opt_options", "hidden_mhe_weight",
        "hidden_mhe_half_space", "hidden_mhe_projection", "hidden_mhe_options", "flip", "train_per_class",
        "log_every", "eval_every", "eval_images", "seed", "threads",
    )  # fmt: skip
    KIND: ClassVar[str] = "CIFAR "

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (self.task == "cifar10", "task must be cifar10"),
            (self.convs_per_stage >= 1, "convs_per_stage must be at least 1"),
            (len(self.widths) == 3 and min(self.widths) >= 1, "widths are three positive channel counts"),
            *super()._checks(),
            (self.train_per_class is None or 1 <= self.train_per_class <= 5000, "train_per_class is 1..5000"),
            (1 <= self.eval_images <= 10000, "eval_images is 1..10000"),
            (self.optimizer in ("adam", "sgd"), "optimizer must be adam or sgd"),
        ]

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at ``step``: /10 at each milestone."""
        return 0.1 ** sum(step >= m for m in self.lr_milestones())


def is_cifar_config(path: str | Path | None) -> bool:
    """Whether a config file describes a CIFAR-10 run (``task = "cifar10"``)."""
    return path is not None and read_toml(Path(path)).get("task") == "cifar10"


def load_cifar_config(path: str | Path, overrides: list[str] | None = None) -> CifarConfig:
    """A CIFAR config file (with its ``base`` chain) and ``key=value`` overrides (any table's
    option as ``table.option=value``)."""
    return CifarConfig.load(path, overrides)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def _decode_archive(archive: Path) -> dict[str, np.ndarray]:
    """``train/<class>/N.jpg`` and ``test/<class>/N.jpg`` of the archive -> uint8 arrays and labels."""
    from PIL import Image
    from tqdm import tqdm

    images: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    labels: dict[str, list[int]] = {"train": [], "test": []}
    with tarfile.open(archive) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jpg")), key=lambda m: m.name
        )
        for member in tqdm(members, desc="decoding CIFAR-10", unit="image", mininterval=2):
            parts = Path(member.name).parts
            split, cls = parts[-3], parts[-2]
            if split not in images or cls not in CLASSES:
                continue
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            images[split].append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            labels[split].append(CLASSES.index(cls))
    out = {}
    for split in ("train", "test"):
        out[f"{split}_images"] = np.stack(images[split])
        out[f"{split}_labels"] = np.asarray(labels[split], dtype=np.int64)
    if len(out["train_labels"]) != 50000 or len(out["test_labels"]) != 10000:
        raise ConfigError(
            f"{archive} holds {len(out['train_labels'])} training and {len(out['test_labels'])} test "
            "images; CIFAR-10 has 50,000 and 10,000 (see ../shared/data/README.md)"
        )
    return out


def load_cifar10(archive: str | Path, cache: str | Path) -> dict[str, np.ndarray]:
    """CIFAR-10 as ``{train,test}_images`` (N, 32, 32, 3) uint8 and ``{train,test}_labels`` int64.

    Decoded from ``archive`` once (about a minute) into ``cache`` (a .npz of 180 MB).
    """
    cache = Path(cache)
    if cache.exists():
        with np.load(cache) as data:
            return {k: data[k] for k in data.files}
    archive = Path(archive)
    if not archive.exists():
        raise ConfigError(
            f"CIFAR-10 archive {archive} does not exist (../shared/data/cifar10, see its README)"
        )
    data = _decode_archive(archive)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(".partial.npz")
    np.savez(partial, **data)
    partial.replace(cache)
    return data


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, 32, 32, 3) uint8 -> (N, 3, 32, 32) float32, normalised per channel."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x - mean) / std


def _training_subset(data: dict[str, np.ndarray], per_class: int | None) -> tuple[np.ndarray, np.ndarray]:
    images, labels = data["train_images"], data["train_labels"]
    if per_class is None:
        return images, labels
    keep = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(len(CLASSES))])
    return images[keep], labels[keep]


class _Batches:
    """Shuffled epochs of (images, labels) batches with random horizontal flips."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch: int, flip: bool, seed: int) -> None:
        self.images, self.labels, self.batch, self.flip = images, labels, batch, flip
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.long)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch > len(self.order):
            self.order = torch.randperm(len(self.labels), generator=self.generator)
            self.position = 0
        index = self.order[self.position : self.position + self.batch]
        self.position += self.batch
        x = self.images[index]
        if self.flip:
            flip = torch.rand(len(index), generator=self.generator) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        return x, self.labels[index]


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class CifarClassifier(nn.Module):
    """The CNN and its classifier head."""

    def __init__(self, net: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.net, self.head = net, head


def build_cifar_model(config: CifarConfig) -> CifarClassifier:
    from models.nets.hyperspherical import enable_weighted_gradients
    from models.nets.plain_cnn import PlainCNN
    from training.losses import build_head

    net = PlainCNN(
        config.convs_per_stage, tuple(config.widths), config.embedding_size, config.batch_norm, config.relu
    )
    config.operator_settings().apply(net)
    config.opt_settings().apply(net)
    if config.weighted_gradients:
        enable_weighted_gradients(net)
    options = dict(config.head_options)
    schedule = config.lambda_schedule()
    if schedule is not None:
        options.setdefault("lambda_schedule", schedule)
    head = build_head(config.head, config.embedding_size, len(CLASSES), **options)
    apply_classifier_opt_as_configured(head, config.opt, config.opt_options)
    return CifarClassifier(net, head)


@torch.no_grad()
def evaluate(model: CifarClassifier, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Top-1 accuracy (prediction: argmax of the head's logits without margin)."""
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch):
        x, y = images[start : start + batch], labels[start : start + batch]
        out = model.head(model.net(x), y)
        correct += int((out.logits.argmax(1) == y).sum())
    model.train()
    return correct / len(labels)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def periodic_sample(num_test: int, size: int) -> torch.Tensor:
    """Indices of the periodic check's test images: a fixed random sample (the test set is stored
    class by class, so its first images are all airplanes and automobiles)."""
    return torch.randperm(num_test, generator=torch.Generator().manual_seed(0))[:size]


def _write_log(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, LOG_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else f"{row[k]:.6g}" for k in LOG_COLUMNS})


def read_cifar_log(path: str | Path) -> dict[str, np.ndarray]:
    """``log.csv`` as columns of floats (NaN where a row has no value)."""
    with Path(path).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {k: np.array([float(r[k]) if r.get(k) else np.nan for r in rows]) for k in LOG_COLUMNS}


def optimiser_step(model: CifarClassifier, optimiser: torch.optim.Optimizer, step: int, x: torch.Tensor,
                   y: torch.Tensor, hooks: StepHooks) -> tuple[float, float, float]:  # fmt: skip
    """One training step: the head's loss plus the hooks' penalties, backward, the hooks' and the
    optimiser's updates. Returns (head loss, batch accuracy, lambda)."""
    features = model.net(x)
    out = model.head(features, y, step=step)
    loss, _ = hooks.add_penalties(out.loss, StepInputs(model.net, x, features))
    optimiser.zero_grad(set_to_none=True)
    loss.backward()
    hooks.after_backward(optimiser)
    optimiser.step()
    hooks.after_step(optimiser, step)
    accuracy = float((out.logits.argmax(1) == y).float().mean())
    # the head's loss (the regulariser left out): comparable between runs with and without it
    return float(out.loss.detach()), accuracy, float(out.extras.get("lambda", 0.0))


def _param_groups(model: nn.Module, config: CifarConfig) -> list[dict[str, Any]]:
    from models.nets.hyperspherical import HYPERSPHERICAL_LAYERS, operator_parameters
    from models.nets.opt import ogd_parameters, rotation_parameters

    undecayed = operator_parameters(model) | {id(p) for p in rotation_parameters(model)}
    own_update = {id(p) for p in ogd_parameters(model)}
    decay, plain = [], []
    for sub in model.modules():
        for name, param in sub.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in own_update:
                continue
            skip = (
                isinstance(sub, (nn.BatchNorm1d, nn.BatchNorm2d)) or id(param) in undecayed or name == "bias"
            )
            skip = skip or (config.orthogonality_weight > 0 and isinstance(sub, HYPERSPHERICAL_LAYERS))
            (plain if skip else decay).append(param)
    return [{"params": decay, "weight_decay": config.weight_decay}, {"params": plain, "weight_decay": 0.0}]


def _make_optimiser(model: nn.Module, config: CifarConfig) -> torch.optim.Optimizer:
    groups = _param_groups(model, config)
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.Adam(groups, lr=config.lr)


def build_training(config: CifarConfig) -> tuple[CifarClassifier, torch.optim.Optimizer, StepHooks]:
    """The model, its optimiser and its step hooks, from the global torch seed; the hooks' work
    before training (OPT's refinement of v, if configured) is done here."""
    model = build_cifar_model(config)
    optimiser = _make_optimiser(model, config)
    hooks = build_step_hooks(config, model, hidden_mhe_last=True)
    hooks.before_training()
    return model, optimiser, hooks


class PeriodicTest(Callback):
    """Test accuracy on a fixed sample of test images every ``every`` steps (not at the last step,
    which the whole test set scores)."""

    def __init__(
        self, model: CifarClassifier, images: torch.Tensor, labels: torch.Tensor, every: int
    ) -> None:
        self.model, self.images, self.labels, self.every = model, images, labels, every

    def on_interval(self, interval: Interval) -> None:
        if interval.done % self.every == 0 and not interval.is_last:
            interval.row["test_accuracy"] = evaluate(self.model, self.images, self.labels)


def _postfix(row: dict[str, Any]) -> dict[str, str]:
    return {"loss": f"{row['loss']:.3f}", "acc": f"{100 * row['accuracy']:.1f}%"}


def _train_loop(
    config: CifarConfig,
    model: CifarClassifier,
    optimiser: torch.optim.Optimizer,
    hooks: StepHooks,
    batches: _Batches,
    callbacks: list[Callback],
) -> list[dict[str, Any]]:
    """Every step of the run; returns the log rows (one per ``log_every`` steps and the last)."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimiser, config.lr_factor)
    history = History()
    run_callbacks = Callbacks([*callbacks, history])
    interval: list[tuple[float, float]] = []
    started = time.perf_counter()
    try:
        for step in range(config.steps):
            used_lr = optimiser.param_groups[0]["lr"]  # the lr of this step, logged as such
            loss, accuracy, lam = optimiser_step(model, optimiser, step, *batches.next(), hooks)
            scheduler.step()
            if not np.isfinite(loss):
                raise FloatingPointError(
                    f"{config.name}: the loss became {loss} at step {step + 1}; lower lr"
                )
            interval.append((loss, accuracy))
            done = step + 1
            if done % config.log_every == 0 or done == config.steps:
                row = {"step": done, "loss": float(np.mean([v[0] for v in interval])),
                       "accuracy": float(np.mean([v[1] for v in interval])),
                       "lr": used_lr, "lambda": lam,
                       "elapsed_s": time.perf_counter() - started}  # fmt: skip
                interval.clear()
                run_callbacks.on_interval(Interval(done, done == config.steps, row))
            run_callbacks.on_step(done)
    finally:
        run_callbacks.close()
    return history.rows


def train_cifar(config: CifarConfig, progress: bool = True) -> dict[str, Any]:
    """Train one run; writes ``log.csv``, ``summary.json`` and ``curves.png``; returns the summary."""
    if config.threads:
        torch.set_num_threads(config.threads)
    run_dir = config.run_dir
    if (run_dir / "summary.json").exists():
        raise ConfigError(f"{run_dir} already holds a finished run: choose another name or delete it")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.as_dict(), indent=2) + "\n")
    torch.manual_seed(config.seed)
    data = load_cifar10(config.archive, config.cache)
    train_images, train_labels = _training_subset(data, config.train_per_class)
    batches = _Batches(
        to_tensor(train_images), torch.from_numpy(train_labels), config.batch_size, config.flip, config.seed
    )
    test_x, test_y = to_tensor(data["test_images"]), torch.from_numpy(data["test_labels"])
    sample = periodic_sample(len(test_y), config.eval_images)
    model, optimiser, hooks = build_training(config)
    initial_energies = layer_energies(model.net)
    started = time.perf_counter()
    callbacks = [
        PeriodicTest(model, test_x[sample], test_y[sample], config.eval_every),
        ProgressBar(config.steps, config.name, _postfix, enabled=progress, mininterval=2),
    ]
    rows = _train_loop(config, model, optimiser, hooks, batches, callbacks)
    train_seconds = time.perf_counter() - started
    rows[-1]["test_accuracy"] = final = evaluate(model, test_x, test_y)
    _write_log(run_dir / "log.csv", rows)
    summary = _summary(config, model, rows, final, train_seconds)
    summary["layer_energy"] = {"initial": initial_energies, "final": layer_energies(model.net)}
    _save_run(config, model, summary)
    log.info("%s: test accuracy %.2f%% after %d steps (%.0f s)", config.name, 100 * final, config.steps,
             train_seconds)  # fmt: skip
    return summary


def _save_run(config: CifarConfig, model: CifarClassifier, summary: dict[str, Any]) -> None:
    """``summary.json`` (with the OPT numbers), ``model.pt`` and ``curves.png`` of a finished run."""
    run_dir = config.run_dir
    summary["trainable_parameters"] = trainable_parameters(model.net)
    if config.opt != "none":
        from models.nets.opt import orthogonality_error

        summary["orthogonality_error"] = orthogonality_error(model)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save({"config": config.as_dict(), "net": model.net.state_dict(), "head": model.head.state_dict()},
               run_dir / "model.pt")  # fmt: skip
    plot_cifar_curves([run_dir], run_dir / "curves.png", config.name)


def _summary(config: CifarConfig, model: CifarClassifier, rows: list[dict[str, Any]], final: float,
             seconds: float) -> dict[str, Any]:  # fmt: skip
    return {
        "name": config.name,
        "config": config.as_dict(),
        "test_accuracy": final,
        "final_train_loss": rows[-1]["loss"],
        "final_train_accuracy": rows[-1]["accuracy"],
        "steps": config.steps,
        "epochs": config.steps * config.batch_size / (config.train_per_class or 5000) / len(CLASSES),
        "train_seconds": seconds,
        "seconds_per_step": seconds / config.steps,
        "parameters": sum(p.numel() for p in model.net.parameters()),
        "threads": torch.get_num_threads(),
        "periodic_eval": f"{config.eval_images} test images drawn at random (seed 0)",
    }


def _random_periodic_eval(run_dir: Path) -> bool:
    """Whether the run's periodic test accuracy came from a random sample of every class.

    A run folder whose summary has no ``periodic_eval`` checked the first ``eval_images`` test
    images, which are the first two classes: its periodic points are not plotted, only the final
    accuracy on all 10,000.
    """
    summary = run_dir / "summary.json"
    return summary.exists() and "periodic_eval" in json.loads(summary.read_text())


def plot_cifar_curves(run_dirs: list[Path], out: Path, title: str, labels: list[str] | None = None) -> Path:
    """Training loss, training accuracy and test accuracy against step for one or several runs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for i, run_dir in enumerate(run_dirs):
        cols = read_cifar_log(Path(run_dir) / "log.csv")
        label = labels[i] if labels else Path(run_dir).name
        axes[0].plot(cols["step"], cols["loss"], lw=1.1, label=label)
        axes[1].plot(cols["step"], 100 * cols["accuracy"], lw=1.1, label=label)
        has = np.isfinite(cols["test_accuracy"])
        if not _random_periodic_eval(Path(run_dir)):
            has &= cols["step"] == cols["step"][-1]  # a two-class periodic sample: the final point only
        axes[2].plot(cols["step"][has], 100 * cols["test_accuracy"][has], "o-", ms=3, lw=1.1, label=label)
    for ax, name in zip(axes, ("training loss", "training accuracy (%)", "test accuracy (%)"), strict=True):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
