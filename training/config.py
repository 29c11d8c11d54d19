"""Experiment configuration: one TOML file per experiment, optionally inheriting a base file.

A config file is a flat TOML table of :class:`TrainConfig` fields plus an optional
``base = "other.toml"`` (a path relative to the file) whose values it overrides (a table such
as ``head_options`` is replaced as a whole). Paths inside configs are relative to the directory
the command runs in (the repository root). ``sphereface train CONFIG --set key=value`` overrides
single fields from the command line (values parsed as TOML, falling back to strings)::

    base = "base.toml"
    name = "sf4_asoftmax_m4"
    network = "sphereface4"
    head = "asoftmax"
    head_options = { m = 4 }
    steps = 2000

Every run writes the resolved config next to its checkpoints (``config.toml`` in the run
folder), so each reported number has the exact settings beside it.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.errors import SphereFaceError

if TYPE_CHECKING:
    from models.nets.hyperspherical import HypersphericalSettings
    from models.nets.opt import OPTSettings
    from training.augment import AugmentOptions


class ConfigError(SphereFaceError):
    """A config file or override is invalid; the message names the field."""

    code = "invalid_config"


@dataclass
class TrainConfig:
    """Every setting of a training run (defaults: the SphereFace-20, m = 4 recipe, SPEC.md §1.8)."""

    #: Run name; the run folder is ``out_dir/name``.
    name: str = "sphereface20_asoftmax_m4"
    #: A folder written by ``sphereface prepare``, or a list of them trained as one set
    #: (identities merged by folder name; training.prepare.load_training_set).
    data: str | list[str] = ".cache/data/casia_webface"
    #: Leave out identities with fewer aligned faces than this (over all ``data`` folders).
    min_photos_per_identity: int = 1
    out_dir: str = "runs"
    #: ``sphereface4|10|20|36|64`` or ``mobilefacenet`` (models.nets.NETWORKS).
    network: str = "sphereface20"
    #: FC1 size; None: the network's default (512 for SphereFace, 128 for MobileFaceNet).
    embedding_size: int | None = None
    #: ``softmax|modified_softmax|asoftmax|sphereface_plus|cosface|arcface`` (training.losses.HEADS).
    head: str = "asoftmax"
    #: Passed to the head, e.g. ``{ m = 4 }``, ``{ m = 4, mhe_weight = 1.0 }``, ``{ scale = 30 }``.
    head_options: dict[str, Any] = field(default_factory=dict)
    #: A-Softmax annealing ``lambda = max(min, base * (1 + gamma * i) ** -power)`` with Caffe's
    #: iteration ``i = step + 1`` (SPEC.md §1.4): 892.9 at the first step, 5 from step 1658 on,
    #: whatever the run's length (the authors' schedule is per iteration, not per run).
    lambda_base: float = 1000.0
    lambda_gamma: float = 0.12
    lambda_power: float = 1.0
    lambda_min: float = 5.0
    #: When set: gamma is chosen so lambda reaches its floor after this many epochs (an
    #: experiment option; the papers' runs leave it unset).
    lambda_floor_epochs: float | None = None
    #: ``conv`` (the network as defined) or a hyperspherical operator in place of every convolution
    #: (models.nets.hyperspherical.OPERATORS: ``sphereconv``, ``ballconv``, ``tanhconv``,
    #: ``linearconv``, ``segconv``, ``logconv``, ``mixconv``; SphereNet and DCNet).
    operator: str = "conv"
    #: The operator's options (OperatorSpec), e.g. ``{ angular = "sigmoid", k = 0.3 }``,
    #: ``{ angular = "sigmoid", learnable_k = true }``, ``{ rescale = true }`` (SphereNorm).
    operator_options: dict[str, Any] = field(default_factory=dict)
    #: Also replace the fully connected layers (FC1) by the operator.
    operator_fc: bool = False
    #: SphereNet's orthogonality regulariser ``w ||W^T W - I||_F^2`` over the operator's layers,
    #: which then get no weight decay (SphereNet §2.4); 0 turns it off.
    orthogonality_weight: float = 0.0
    #: DCNet weight projection ``w <- w / ||w||`` of the operator's kernels every N steps (0: never).
    weight_projection_every: int = 0
    #: DCNet weighted gradients: each operator kernel's gradient times ``||w||`` (Eq. 4.17-4.18).
    weighted_gradients: bool = False
    #: Orthogonal over-parameterised training (OPT, models.nets.opt): ``none`` or how R is learned,
    #: ``gs``, ``hr``, ``ls``, ``cp``, ``ogd``, ``or`` (relaxed) or ``upt`` (unconstrained control).
    opt: str = "none"
    #: OPT's layer and training options (training.opt), e.g. ``{ stochastic_dims = 144 }`` (S-OPT),
    #: ``{ block_size = 64, shared_blocks = false }``, ``{ skip = ["fc1"] }``, ``{ refine_steps = 500 }``.
    opt_options: dict[str, Any] = field(default_factory=dict)
    #: Hidden-layer MHE (Eq. 5.4) weight; 0 turns it off.
    hidden_mhe_weight: float = 0.0
    hidden_mhe_half_space: bool = False
    #: Compressive MHE (training.comhe): ``none`` (plain MHE), ``random``, ``angle`` or ``group``,
    #: and its options, e.g. ``{ dim = 30, projections = 5 }`` or ``{ unrolled = true }``.
    hidden_mhe_projection: str = "none"
    hidden_mhe_options: dict[str, Any] = field(default_factory=dict)
    #: Global batch size (split evenly over the torchrun processes).
    batch_size: int = 256
    steps: int = 28000
    lr: float = 0.1
    #: Learning-rate drops (x0.1) as fractions of ``steps``: the papers' 16K and 24K of 28K.
    lr_drops: list[float] = field(default_factory=lambda: [16 / 28, 24 / 28])
    #: Linear warm-up steps from lr/10 (0: none, as the papers).
    warmup_steps: int = 0
    momentum: float = 0.9
    weight_decay: float = 5e-4
    #: Horizontal flip of training images with probability 0.5 (the papers' only augmentation).
    flip: bool = True
    #: More augmentation (training.augment; every option off when absent), e.g.
    #: ``{ shift = 0.04, scale = 0.05, rotate = 5, brightness = 0.2, grayscale = 0.1, erase = 0.2 }``.
    augment: dict[str, Any] = field(default_factory=dict)
    #: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16`` or ``fp32``.
    precision: str = "auto"
    seed: int = 0
    #: ``auto``, ``device`` (whole uint8 dataset in device memory) or ``stream`` (shards via pinned memory).
    loader: str = "auto"
    #: ``auto`` (cuda when available), ``cpu``, ``cuda``.
    device: str = "auto"
    #: LFW folder for the periodic check (empty: no check); every ``lfw_every`` steps and at the end.
    lfw: str = "../shared/data/lfw"
    #: Landmarks aligning LFW for that check: ``detect`` (our MTCNN, as the training data and the
    #: service) or ``file`` (landmarks.txt). One source of landmarks per comparison.
    lfw_landmarks: str = "detect"
    #: 0: only at the end.
    lfw_every: int = 2000
    #: Pairs per fold for the periodic check (None: all 600); the final check always uses all.
    lfw_pairs_per_fold: int | None = None
    log_every: int = 20
    #: Stop with a clear error when the mean feature norm ||x|| of a log interval falls below this
    #: fraction of the first interval's (the collapse of docs/training.md §6: loss -> ln C,
    #: accuracy -> 0); 0 turns the check off.
    feature_norm_collapse: float = 0.02
    #: 0: only at the end (and at ``--until-step``).
    checkpoint_every: int = 1000
    #: Start from this checkpoint's network (and head, when the class count matches): fine-tuning,
    #: e.g. SphereFace+ from a trained SphereFace model as the papers do.
    init_from: str | None = None
    #: Threads for CPU training (0: torch's default).
    threads: int = 0
    #: A teacher model (a name of `sphereface models` or a folder) whose pairwise cosines the
    #: network learns to reproduce (training.distill), with this weight; 0 turns it off.
    distill_from: str | None = None
    distill_weight: float = 0.0

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    @property
    def data_paths(self) -> list[str]:
        """``data`` as a list of prepared folders."""
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def lr_milestones(self) -> list[int]:
        """Steps at which the learning rate is divided by 10."""
        return [max(1, round(f * self.steps)) for f in self.lr_drops]

    def validate(self) -> None:
        from models.nets import NETWORKS
        from training.losses import HEADS

        checks = [
            (self.network in NETWORKS, f"network must be one of {NETWORKS}, not {self.network!r}"),
            (self.head in HEADS, f"head must be one of {HEADS}, not {self.head!r}"),
            (self.batch_size > 0, "batch_size must be positive"),
            (self.steps > 0, "steps must be positive"),
            (self.log_every > 0, "log_every must be positive"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: only at the end)"),
            (self.lfw_every >= 0, "lfw_every must be >= 0 (0: only at the end)"),
            (self.lr > 0, "lr must be positive"),
            (self.precision in ("auto", "bf16", "fp32"), "precision must be auto, bf16 or fp32"),
            (self.loader in ("auto", "device", "stream"), "loader must be auto, device or stream"),
            (self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda"),
            (all(0 < f < 1 for f in self.lr_drops), "lr_drops are fractions of the run in (0, 1)"),
            (0 <= self.lambda_min <= self.lambda_base, "need lambda_base >= lambda_min >= 0"),
            (self.min_photos_per_identity >= 1, "min_photos_per_identity must be at least 1"),
            (self.lfw_landmarks in ("detect", "file"), "lfw_landmarks must be detect or file"),
            (0 <= self.feature_norm_collapse < 1, "feature_norm_collapse is a fraction in [0, 1)"),
            (bool(self.data_paths), "data needs at least one prepared folder"),
            (self.orthogonality_weight >= 0, "orthogonality_weight must be >= 0"),
            (self.weight_projection_every >= 0, "weight_projection_every must be >= 0"),
            (
                self.operator != "conv"
                or not (
                    self.orthogonality_weight
                    or self.weight_projection_every
                    or self.weighted_gradients
                    or self.operator_options
                    or self.operator_fc
                ),
                "the operator options and optimiser options need operator = sphereconv (or another "
                "hyperspherical operator), not conv",
            ),
            (
                self.opt == "none" or self.operator == "conv",
                "opt and a hyperspherical operator exclude each other",
            ),
            (self.opt != "none" or not self.opt_options, "opt_options need opt = gs (or another OPT method)"),
            (
                self.hidden_mhe_projection in ("none", "random", "angle", "group"),
                "hidden_mhe_projection must be none, random, angle or group",
            ),
            (
                self.hidden_mhe_projection == "none" or self.hidden_mhe_weight > 0,
                "hidden_mhe_projection needs hidden_mhe_weight > 0",
            ),
            (self.distill_weight >= 0, "distill_weight must be >= 0"),
            (
                (self.distill_weight > 0) == bool(self.distill_from),
                "distillation needs both distill_from (a teacher model) and distill_weight > 0",
            ),
            (
                self.hidden_mhe_projection != "none" or not self.hidden_mhe_options,
                "hidden_mhe_options need hidden_mhe_projection = random, angle or group",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        try:
            self.operator_settings()
            self.opt_settings()
            from training.comhe import CoMHEOptions

            CoMHEOptions.from_options(self.hidden_mhe_options)
            self.augment_options()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def operator_settings(self) -> HypersphericalSettings:
        """The network's operator choice (checked: unknown operators and options raise ValueError)."""
        from models.nets.hyperspherical import HypersphericalSettings, OperatorSpec

        if self.operator != "conv":
            OperatorSpec.from_options(self.operator, self.operator_options)
        return HypersphericalSettings(self.operator, dict(self.operator_options), self.operator_fc)

    def augment_options(self) -> AugmentOptions:
        """The checked ``augment`` table (unknown or out-of-range options raise ValueError)."""
        from training.augment import AugmentOptions

        return AugmentOptions.from_options(self.augment)

    def opt_settings(self) -> OPTSettings:
        """The network's OPT choice (checked: unknown methods and options raise ValueError)."""
        from training.opt import opt_settings

        return opt_settings(self.opt, self.opt_options)

    def to_toml(self) -> str:
        """The resolved config as TOML (None values are left out: they mean the default)."""
        lines = []
        for key, value in asdict(self).items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} as TOML")


def read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file as a dict, its ``base`` chain merged in (the file's values win)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config inheritance loops through {path}")
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    base = data.pop("base", None)
    if base is None:
        return data
    merged = read_toml(path.parent / base, (*seen, path))
    merged.update(data)
    return merged


def parse_override(text: str) -> tuple[str, Any]:
    """``"steps=200"`` -> ``("steps", 200)``; the value is read as TOML, else kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


#: Fields that existed once, with what to do instead (an old config gets this, not a bare error).
REMOVED_FIELDS = {
    "lambda_scale_to_run": (
        "lambda_scale_to_run was removed: squeezing the lambda schedule into a short run dropped "
        "lambda to its floor within a few steps and collapsed the features (docs/training.md §6). "
        "The schedule now follows the authors' iterations; delete the line (or set "
        "lambda_floor_epochs for a different warm phase)"
    ),
}


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    for name, message in REMOVED_FIELDS.items():
        if name in data:
            raise ConfigError(message)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config fields {unknown}; known: {sorted(known)}")
    config = TrainConfig(**data)
    config.validate()
    return config


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a config file (with its ``base`` chain) and apply ``key=value`` overrides."""
    data = read_toml(Path(path)) if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        table, dot, option = key.partition(".")
        if dot and table in ("head_options", "augment"):
            data.setdefault(table, {})[option] = value
        else:
            data[key] = value
    return config_from_dict(data)
