"""``sphereface`` subcommands of the training package: prepare data, train, export and combine model
folders, and the evaluation jobs' evaluate (LFW, MegaFace), calibrate and report (their parsers live
in :mod:`training.evaluation.commands`). Registered through the
``sphereface.commands`` entry points (see :mod:`models.cli`); each imports what it needs only when it
runs, so ``sphereface --help`` does not load torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.cli import UsageError
from training.evaluation import commands as evaluation_commands


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``prepare``, ``train``, ``export``, ``combine``, ``evaluate``, ``calibrate`` and ``report``."""
    _add_prepare(sub)
    _add_train(sub)
    _add_export(sub)
    _add_combine(sub)
    evaluation_commands.register(sub)  # evaluate, calibrate, report


def _face_size(text: str) -> float:
    """A minimum face size in pixels: a number of at least 12 (P-Net's window)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of pixels") from None
    if value < 12:
        raise argparse.ArgumentTypeError(f"{value:g} is under 12 pixels, the smallest face MTCNN finds")
    return value



def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="detect and align a folder of identities (CASIA-WebFace layout), or crop an insightface "
        "RecordIO set, into packed crops",
    )
    p.add_argument(
        "source",
        help="folder with one sub-folder of photos per identity (or WebFace42M's folders of identity "
        "folders), or an insightface RecordIO set: train.rec (train.idx beside it) or the folder holding it",
    )
    p.add_argument("--out", required=True, help="folder to write (resumable: finished shards are kept)")
    p.add_argument(
        "--exclude-identities", default=None, help="file of identity names to leave out, one per line"
    )
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU core)")
    p.add_argument("--shard-size", type=int, default=8192, help="faces per shard file")
    p.add_argument("--providers", default="cpu", help="ONNX Runtime providers for MTCNN (photo folders only)")
    p.add_argument(
        "--min-face-size",
        type=_face_size,
        default=20.0,
        help="smallest face to look for, in pixels (default 20, MTCNN's; at least 12): lower it for "
        "low-resolution photos",
    )
    p.set_defaults(func=_run_prepare)



def _run_prepare(args: argparse.Namespace) -> int:
    from training.formats.insightface import recordio_pair
    from training.prepare import prepare_dataset

    if recordio_pair(args.source) is not None:
        return _run_prepare_recordio(args)
    result = prepare_dataset(
        args.source,
        args.out,
        exclude_identities=args.exclude_identities,
        workers=args.workers,
        shard_size=args.shard_size,
        providers=args.providers,
        min_face_size=args.min_face_size,
    )
    print(result.summary())
    return 0


def _run_prepare_recordio(args: argparse.Namespace) -> int:
    """``prepare`` of a RecordIO set: its faces are aligned already (no MTCNN: ``--providers`` and
    ``--min-face-size`` do not apply)."""
    from training.formats.prepare_recordio import prepare_recordio

    result = prepare_recordio(
        args.source,
        args.out,
        exclude_identities=args.exclude_identities,
        workers=args.workers,
        shard_size=args.shard_size,
    )
    print(result.summary())
    return 0



def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train SphereFace / SphereFace+ (or a baseline head) on a prepared dataset; torchrun for GPUs",
    )
    p.add_argument("config", nargs="?", default=None, help="experiment config (TOML) in training/configs/")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable), e.g. --set steps=200 --set head_options.m=2",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run from its checkpoint.pt (start it when there is none) with the run's own "
        "config: a change beyond logging, checkpoint and check settings is refused",
    )
    p.add_argument(
        "--until-step",
        type=int,
        default=None,
        metavar="N",
        help="stop after step N with a checkpoint (for time-limited jobs); --resume continues exactly",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.set_defaults(func=_run_train)



def _run_train(args: argparse.Namespace) -> int:
    from training.cifar import is_cifar_config
    from training.config import load_config
    from training.trainer import train

    if is_cifar_config(args.config):
        return _run_cifar_train(args)
    config = load_config(args.config, args.overrides)
    result = train(config, resume=args.resume, progress=not args.no_progress, until_step=args.until_step)
    if result.steps < config.steps:
        print(f"stopped after step {result.steps} of {config.steps}; continue with --resume")
    if result.summary:
        lfw = result.summary.get("lfw") or {}
        acc = f", LFW {100 * lfw['accuracy']:.2f}% ± {100 * lfw['std']:.2f}%" if lfw else ""
        print(f"finished {result.steps} steps in {result.run_dir}{acc}")
    return 0



def _run_cifar_train(args: argparse.Namespace) -> int:
    from training.cifar import load_cifar_config, train_cifar
    from training.config import ConfigError

    if args.resume or args.until_step is not None:
        raise ConfigError("CIFAR-10 runs are short and cannot be resumed: delete the run folder and rerun")
    config = load_cifar_config(args.config, args.overrides)
    summary = train_cifar(config, progress=not args.no_progress)
    print(
        f"finished {config.steps} steps in {config.run_dir}: "
        f"test accuracy {100 * summary['test_accuracy']:.2f}%"
    )
    return 0



def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a training checkpoint -> ONNX model folder with calibrated thresholds")
    p.add_argument("checkpoint", help="checkpoint.pt (or the run folder holding it)")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--name", default=None, help="model name (default: the run's name)")
    p.add_argument("--version", default=None, help="model version (default: step<N>)")
    _add_lfw_calibration_arguments(p)
    p.set_defaults(func=_run_export)



def _add_lfw_calibration_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lfw", default=None, help="LFW folder: evaluate and calibrate thresholds on it")
    p.add_argument(
        "--landmarks",
        choices=("detect", "file"),
        default="detect",
        help="LFW landmarks source: detect (default): our MTCNN, as the service and `sphereface prepare` "
        "align faces; file: LFW/landmarks.txt (about 1 px off ours), to compare with published numbers",
    )
    p.add_argument("--verification-far", type=float, default=1e-3)
    p.add_argument("--identification-far", type=float, default=1e-4)



def _run_export(args: argparse.Namespace) -> int:
    from training.export import export_checkpoint

    manifest, report = export_checkpoint(
        args.checkpoint,
        args.out,
        name=args.name,
        version=args.version,
        lfw_dir=args.lfw,
        landmarks=args.landmarks,
        verification_far=args.verification_far,
        identification_far=args.identification_far,
    )
    print(f"wrote {args.out} ({manifest.model_id}; ONNX parity {report['onnx_parity_max_abs_diff']:.2g})")
    _print_lfw_and_thresholds(report, manifest)
    return 0



def _print_lfw_and_thresholds(report: dict, manifest) -> None:
    """What `export --lfw` and `combine --lfw` measured: LFW accuracy and the calibrated thresholds."""
    if "lfw_accuracy" not in report:
        return
    print(f"LFW {100 * report['lfw_accuracy']:.2f}% ± {100 * report['lfw_std']:.2f}%")
    for role in ("verification", "identification"):
        t = manifest.thresholds[role]
        print(f"{role} threshold {t.value:.4f} at FAR {t.far:g}")



def _add_combine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "combine",
        help="several models -> one ensemble model folder (their unit features side by side)",
        description="One ONNX graph runs every model on the same crop, L2-normalises each output and "
        "concatenates them (/ sqrt(k)): the cosine of two such embeddings is the mean of the models' "
        "cosines. The models must take the same crop. With --lfw the folder is evaluated and "
        "calibrated as `sphereface export --lfw` does.",
    )
    p.add_argument("models", nargs="+", help="model names (`sphereface models`) or folders, at least 2")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--name", required=True, help="model name")
    p.add_argument("--version", required=True, help="model version")
    p.add_argument(
        "--licence", default=None, help="licence text (default: the parts' licence, when they agree)"
    )
    _add_lfw_calibration_arguments(p)
    p.set_defaults(func=_run_combine)



def _run_combine(args: argparse.Namespace) -> int:
    from models.ensemble import combine_models
    from models.registry import resolve_model

    parts = [resolve_model(model) for model in args.models]
    out = Path(args.out)
    if any(part.resolve() == out.resolve() for part in parts):
        raise UsageError(f"--out {out} is one of the models combined: write the ensemble elsewhere")
    manifest, diff = combine_models(parts, out, name=args.name, version=args.version, licence=args.licence)
    print(f"wrote {out} ({manifest.model_id}, {manifest.embedding_size}-d; parity with the parts {diff:.2g})")
    if args.lfw is not None:
        from training.export import evaluate_and_calibrate

        manifest, report = evaluate_and_calibrate(
            out, args.lfw, landmarks=args.landmarks, verification_far=args.verification_far,
            identification_far=args.identification_far,
        )  # fmt: skip
        _print_lfw_and_thresholds(report, manifest)
    return 0
