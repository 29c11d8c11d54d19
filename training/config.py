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
folder) when it starts, so each reported number has the exact settings beside it; a resume
keeps that file and may change only :attr:`TrainConfig.RESUME_MAY_CHANGE` (training.resume).
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from models.errors import SphereFaceError

if TYPE_CHECKING:
    from models.nets.hyperspherical import HypersphericalSettings
    from models.nets.opt import OPTSettings
    from training.augment import AugmentOptions
    from training.losses import LambdaSchedule


class ConfigError(SphereFaceError):
    """A config file or override is invalid; the message names the field."""

    code = "invalid_config"


#: Heads whose margin is annealed by lambda (thesis App. A.7): they get a :class:`LambdaSchedule`.
ANNEALED_HEADS = ("asoftmax", "sphereface_plus", "ga_softmax")
#: What ``batch_size`` counts (TrainConfig.batch_scope): all processes' images per step, or each one's.
BATCH_SCOPES = ("global", "process")
#: Hidden-layer MHE without projection (``none``) or one of the CoMHE projections (training.comhe).
HIDDEN_MHE_PROJECTIONS = ("none", "random", "angle", "group")


@dataclass
class RunConfig:
    """The settings both training loops read (the face trainer's and the CIFAR-10 runs').

    The defaults are the face trainer's (the SphereFace-20, m = 4 recipe of thesis §2.3.6 "CNNs
    Setup"); :class:`training.cifar.CifarConfig` declares its own defaults for the fields it runs
    differently. :meth:`validate` checks these fields; each subclass adds the checks of its own.
    """

    #: Run name; the run folder is ``out_dir/name``.
    name: str = "sphereface20_asoftmax_m4"
    out_dir: str = "runs"
    #: FC1 size; None: the network's default (512 for SphereFace, 128 for MobileFaceNet).
    embedding_size: int | None = None
    #: ``softmax|modified_softmax|asoftmax|sphereface_plus|cosface|arcface`` or SphereNet's
    #: ``w_softmax|ga_softmax|s_softmax`` (training.losses.HEADS).
    head: str = "asoftmax"
    #: Passed to the head, e.g. ``{ m = 4 }``, ``{ m = 4, mhe_weight = 1.0 }``, ``{ scale = 30 }``.
    head_options: dict[str, Any] = field(default_factory=dict)
    #: A-Softmax annealing ``lambda = max(min, base * (1 + gamma * i) ** -power)`` with Caffe's
    #: iteration ``i = step + 1`` (thesis App. A.7): 892.9 at the first step, 5 from step 1658 on,
    #: whatever the run's length (the authors' schedule is per iteration, not per run).
    lambda_base: float = 1000.0
    lambda_gamma: float = 0.12
    lambda_power: float = 1.0
    lambda_min: float = 5.0
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
    #: Images per step: over all torchrun processes, split evenly between them, unless the face
    #: trainer's ``batch_scope = "process"`` makes it each process's batch.
    batch_size: int = 256
    steps: int = 28000
    lr: float = 0.1
    #: Learning-rate drops (x0.1) as fractions of ``steps``: the papers' 16K and 24K of 28K.
    lr_drops: list[float] = field(default_factory=lambda: [16 / 28, 24 / 28])
    momentum: float = 0.9
    weight_decay: float = 5e-4
    #: Horizontal flip of training images with probability 0.5 (the papers' only augmentation).
    flip: bool = True
    #: Steps per line of ``log.csv``.
    log_every: int = 20
    seed: int = 0
    #: Threads for CPU training (0: torch's default).
    threads: int = 0

    #: The order of the fields in the files a run writes (``config.toml``, ``config.json``, the
    #: checkpoint's config): each subclass lists all of its fields, so the files of every run of a
    #: kind list them alike (compared line by line between runs).
    FIELD_ORDER: ClassVar[tuple[str, ...]] = ()
    #: ``table.option=value`` overrides reach into these table fields (None: into any table field).
    OVERRIDE_TABLES: ClassVar[tuple[str, ...] | None] = None
    #: Fields that existed once, with what to do instead (an old config gets this, not a bare error).
    REMOVED_FIELDS: ClassVar[dict[str, str]] = {}
    #: How the error on unknown fields names this kind of config (``"CIFAR "`` or ``""``).
    KIND: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The checked config of ``data`` (field name -> value; missing fields take the defaults)."""
        known = {f.name for f in fields(cls)}
        for name, message in cls.REMOVED_FIELDS.items():
            if name in data:
                raise ConfigError(message)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown {cls.KIND}config fields {unknown}; known: {sorted(known)}")
        config = cls(**data)
        config.validate()
        return config

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> Self:
        """Read a config file (with its ``base`` chain; None: the defaults) and apply ``key=value``
        overrides (:func:`apply_overrides` into :attr:`OVERRIDE_TABLES`)."""
        data = read_toml(Path(path)) if path is not None else {}
        return cls.from_dict(apply_overrides(data, overrides, cls.OVERRIDE_TABLES))

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def lr_milestones(self) -> list[int]:
        """Steps at which the learning rate is divided by 10."""
        return [max(1, round(f * self.steps)) for f in self.lr_drops]

    def as_dict(self) -> dict[str, Any]:
        """Every field (tables and lists copied), in :attr:`FIELD_ORDER`."""
        values = asdict(self)
        return {name: values[name] for name in self.FIELD_ORDER}

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that is out of range or inconsistent."""
        for ok, message in self._checks():
            if not ok:
                raise ConfigError(message)
        try:
            self._check_options()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _checks(self) -> list[tuple[bool, str]]:
        """(condition, message) of every shared field; subclasses add theirs."""
        from training.losses import HEADS

        return [
            (self.head in HEADS, f"head must be one of {HEADS}, not {self.head!r}"),
            (self.batch_size > 0, "batch_size must be positive"),
            (self.steps > 0, "steps must be positive"),
            (self.log_every > 0, "log_every must be positive"),
            (self.lr > 0, "lr must be positive"),
            (all(0 < f < 1 for f in self.lr_drops), "lr_drops are fractions of the run in (0, 1)"),
            (0 <= self.lambda_min <= self.lambda_base, "need lambda_base >= lambda_min >= 0"),
            (self.orthogonality_weight >= 0, "orthogonality_weight must be >= 0"),
            (self.weight_projection_every >= 0, "weight_projection_every must be >= 0"),
            (
                self.operator != "conv" or not any(self._operator_only_settings()),
                "the operator options and optimiser options need operator = sphereconv (or another "
                "hyperspherical operator), not conv",
            ),
            (
                self.opt == "none" or self.operator == "conv",
                "opt and a hyperspherical operator exclude each other",
            ),
            (self.opt != "none" or not self.opt_options, "opt_options need opt = gs (or another OPT method)"),
            (
                self.hidden_mhe_projection in HIDDEN_MHE_PROJECTIONS,
                "hidden_mhe_projection must be none, random, angle or group",
            ),
            (
                self.hidden_mhe_projection == "none" or self.hidden_mhe_weight > 0,
                "hidden_mhe_projection needs hidden_mhe_weight > 0",
            ),
            (
                self.hidden_mhe_projection != "none" or not self.hidden_mhe_options,
                "hidden_mhe_options need hidden_mhe_projection = random, angle or group",
            ),
        ]

    def _operator_only_settings(self) -> tuple[Any, ...]:
        """Settings that mean something only with a hyperspherical operator."""
        return (self.orthogonality_weight, self.weight_projection_every, self.weighted_gradients)

    def _check_options(self) -> None:
        """Parse the option tables (ValueError names the bad option)."""
        from training.comhe import CoMHEOptions

        self.operator_settings()
        self.opt_settings()
        CoMHEOptions.from_options(self.hidden_mhe_options)

    def operator_settings(self) -> HypersphericalSettings:
        """The network's operator choice (checked: unknown operators and options raise ValueError)."""
        from models.nets.hyperspherical import HypersphericalSettings, OperatorSpec

        if self.operator != "conv":
            OperatorSpec.from_options(self.operator, self.operator_options)
        return HypersphericalSettings(self.operator, dict(self.operator_options), self.operator_fc)

    def opt_settings(self) -> OPTSettings:
        """The network's OPT choice (checked: unknown methods and options raise ValueError)."""
        from training.opt import opt_settings

        return opt_settings(self.opt, self.opt_options)

    def lambda_schedule(self) -> LambdaSchedule | None:
        """The margin's annealing for the heads of :data:`ANNEALED_HEADS` (None for the others)."""
        from training.losses import LambdaSchedule

        if self.head not in ANNEALED_HEADS:
            return None
        return LambdaSchedule(
            base=self.lambda_base, gamma=self.lambda_gamma, power=self.lambda_power, minimum=self.lambda_min
        )


@dataclass
class TrainConfig(RunConfig):
    """Every setting of a face training run (defaults: the SphereFace-20, m = 4 recipe, thesis
    §2.3.6 "CNNs Setup"); the fields both loops share are :class:`RunConfig`'s."""

    #: A folder written by ``sphereface prepare``, or a list of them trained as one set
    #: (identities merged by folder name; training.prepare.load_training_set).
    data: str | list[str] = ".cache/data/casia_webface"
    #: Leave out identities with fewer aligned faces than this (over all ``data`` folders).
    min_photos_per_identity: int = 1
    #: ``sphereface4|10|20|36|64`` or ``mobilefacenet`` (models.nets.NETWORKS).
    network: str = "sphereface20"
    #: When set: gamma is chosen so lambda reaches its floor after this many epochs (an
    #: experiment option; the papers' runs leave it unset).
    lambda_floor_epochs: float | None = None
    #: What ``batch_size`` counts: ``global``, the images of one step over all torchrun processes
    #: (split evenly between them), or ``process``, each process's own batch, as Caffe's multi-GPU
    #: solver runs the prototxt's batch on every GPU (``batch_size = 256`` on 2 processes: 512
    #: images per step). :meth:`global_batch` and :meth:`batch_per_process` resolve it.
    batch_scope: str = "global"
    #: Linear warm-up steps from lr/10 (0: none, as the papers).
    warmup_steps: int = 0
    #: More augmentation (training.augment; every option off when absent), e.g.
    #: ``{ shift = 0.04, scale = 0.05, rotate = 5, brightness = 0.2, grayscale = 0.1, erase = 0.2 }``.
    augment: dict[str, Any] = field(default_factory=dict)
    #: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16`` or ``fp32``.
    precision: str = "auto"
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
    #: insightface ``.bin`` verification sets (e.g. ``["data/lfw.bin", "data/cfp_fp.bin"]``) checked
    #: at the LFW check's steps (``lfw_every`` and the end), all pairs (training.verification_check).
    verification_sets: list[str] = field(default_factory=list)
    #: Stop with a clear error when the mean feature norm ||x|| of a log interval falls below this
    #: fraction of the first interval's (the collapse of docs/results/loss-comparison.md §1: loss -> ln C,
    #: accuracy -> 0); 0 turns the check off.
    feature_norm_collapse: float = 0.02
    #: 0: only at the end (and at ``--until-step``).
    checkpoint_every: int = 1000
    #: Start from this checkpoint's network (and head, when the class count matches): fine-tuning,
    #: e.g. SphereFace+ from a trained SphereFace model as the papers do.
    init_from: str | None = None
    #: A teacher model (a name of `sphereface models` or a folder) whose pairwise cosines the
    #: network learns to reproduce (training.distill), with this weight; 0 turns it off.
    distill_from: str | None = None
    distill_weight: float = 0.0

    FIELD_ORDER: ClassVar[tuple[str, ...]] = (
        "name", "data", "min_photos_per_identity", "out_dir", "network", "embedding_size", "head",
        "head_options", "lambda_base", "lambda_gamma", "lambda_power", "lambda_min", "lambda_floor_epochs",
        "operator", "operator_options", "operator_fc", "orthogonality_weight", "weight_projection_every",
        "weighted_gradients", "opt", "opt_options", "hidden_mhe_weight", "hidden_mhe_half_space",
        "hidden_mhe_projection", "hidden_mhe_options", "batch_size", "batch_scope", "steps", "lr",
        "lr_drops", "warmup_steps", "momentum", "weight_decay", "flip", "augment", "precision", "seed",
        "loader", "device", "lfw", "lfw_landmarks", "lfw_every", "lfw_pairs_per_fold", "verification_sets",
        "log_every", "feature_norm_collapse", "checkpoint_every", "init_from", "threads", "distill_from",
        "distill_weight",
    )  # fmt: skip
    OVERRIDE_TABLES: ClassVar[tuple[str, ...] | None] = ("head_options", "augment")
    #: The fields a resume (``--resume``) may change (training.resume): where the run folder lives,
    #: what is logged, checked and checkpointed, and the CPU threads; none of them changes what a
    #: step computes. ``steps`` may also grow, after the last lr drop (training.resume). Every
    #: other difference from the run's own config is refused, naming the fields.
    RESUME_MAY_CHANGE: ClassVar[tuple[str, ...]] = (
        "out_dir", "log_every", "checkpoint_every", "lfw", "lfw_landmarks", "lfw_every", "lfw_pairs_per_fold",
        "verification_sets", "feature_norm_collapse", "threads",
    )  # fmt: skip
    REMOVED_FIELDS: ClassVar[dict[str, str]] = {
        "lambda_scale_to_run": (
            "lambda_scale_to_run was removed: squeezing the lambda schedule into a short run dropped "
            "lambda to its floor within a few steps and collapsed the features "
            "(docs/results/loss-comparison.md §1). "
            "The schedule now follows the authors' iterations; delete the line (or set "
            "lambda_floor_epochs for a different warm phase)"
        ),
    }

    @property
    def data_paths(self) -> list[str]:
        """``data`` as a list of prepared folders."""
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def global_batch(self, processes: int = 1) -> int:
        """Images per optimiser step over ``processes`` torchrun processes (:attr:`batch_scope`)."""
        return self.batch_size * processes if self.batch_scope == "process" else self.batch_size

    def batch_per_process(self, processes: int = 1) -> int:
        """Images per step of each of ``processes`` processes; a global batch that does not
        split evenly raises :class:`ConfigError`."""
        if self.batch_scope == "process":
            return self.batch_size
        if self.batch_size % processes:
            raise ConfigError(
                f"batch_size {self.batch_size} is not divisible by {processes} processes "
                "(batch_scope = \"global\" splits it; \"process\" gives each process batch_size)"
            )
        return self.batch_size // processes

    def _checks(self) -> list[tuple[bool, str]]:
        from models.nets import NETWORKS

        return [
            (self.network in NETWORKS, f"network must be one of {NETWORKS}, not {self.network!r}"),
            *super()._checks(),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: only at the end)"),
            (self.lfw_every >= 0, "lfw_every must be >= 0 (0: only at the end)"),
            (self.precision in ("auto", "bf16", "fp32"), "precision must be auto, bf16 or fp32"),
            (self.loader in ("auto", "device", "stream"), "loader must be auto, device or stream"),
            (self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda"),
            (self.batch_scope in BATCH_SCOPES, "batch_scope must be global or process"),
            (self.min_photos_per_identity >= 1, "min_photos_per_identity must be at least 1"),
            (self.lfw_landmarks in ("detect", "file"), "lfw_landmarks must be detect or file"),
            (
                isinstance(self.verification_sets, list)
                and all(isinstance(p, str) and p for p in self.verification_sets),
                "verification_sets must be a list of .bin file paths",
            ),
            (0 <= self.feature_norm_collapse < 1, "feature_norm_collapse is a fraction in [0, 1)"),
            (bool(self.data_paths), "data needs at least one prepared folder"),
            (self.distill_weight >= 0, "distill_weight must be >= 0"),
            (
                (self.distill_weight > 0) == bool(self.distill_from),
                "distillation needs both distill_from (a teacher model) and distill_weight > 0",
            ),
        ]

    def _operator_only_settings(self) -> tuple[Any, ...]:
        return (*super()._operator_only_settings(), self.operator_options, self.operator_fc)

    def _check_options(self) -> None:
        super()._check_options()
        self.augment_options()

    def augment_options(self) -> AugmentOptions:
        """The checked ``augment`` table (unknown or out-of-range options raise ValueError)."""
        from training.augment import AugmentOptions

        return AugmentOptions.from_options(self.augment)

    def to_toml(self) -> str:
        """The resolved config as TOML (None values are left out: they mean the default)."""
        lines = []
        for key, value in self.as_dict().items():
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


def apply_overrides(
    data: dict[str, Any], overrides: list[str] | None, tables: tuple[str, ...] | None
) -> dict[str, Any]:
    """``key=value`` overrides applied to ``data`` (in place; returned).

    ``table.option=value`` sets one option of a table field when ``table`` is in ``tables``
    (``None``: any table); other keys replace the field as a whole.
    """
    for text in overrides or []:
        key, value = parse_override(text)
        table, dot, option = key.partition(".")
        if dot and (tables is None or table in tables):
            data.setdefault(table, {})[option] = value
        else:
            data[key] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a face config file (with its ``base`` chain) and apply ``key=value`` overrides."""
    return TrainConfig.load(path, overrides)
