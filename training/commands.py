"""``sphereface`` subcommands of the training package: prepare data, train, export and combine model
folders, evaluate (LFW, MegaFace), calibrate thresholds, report. Registered through the
``sphereface.commands`` entry points (see :mod:`models.cli`); each imports what it needs only when it
runs, so ``sphereface --help`` does not load torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.cli import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``prepare``, ``train``, ``export``, ``combine``, ``evaluate``, ``calibrate`` and ``report``."""
    _add_prepare(sub)
    _add_train(sub)
    _add_export(sub)
    _add_combine(sub)
    _add_evaluate(sub)
    _add_calibrate(sub)
    _add_report(sub)


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
        "prepare", help="detect and align a folder of identities (CASIA-WebFace layout) into packed crops"
    )
    p.add_argument("source", help="folder with one sub-folder of photos per identity")
    p.add_argument("--out", required=True, help="folder to write (resumable: finished shards are kept)")
    p.add_argument(
        "--exclude-identities", default=None, help="file of identity names to leave out, one per line"
    )
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU core)")
    p.add_argument("--shard-size", type=int, default=8192, help="faces per shard file")
    p.add_argument("--providers", default="cpu", help="ONNX Runtime providers for MTCNN")
    p.add_argument(
        "--min-face-size",
        type=_face_size,
        default=20.0,
        help="smallest face to look for, in pixels (default 20, MTCNN's; at least 12): lower it for "
        "low-resolution photos",
    )
    p.set_defaults(func=_run_prepare)



def _run_prepare(args: argparse.Namespace) -> int:
    from training.prepare import prepare_dataset

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
    p.add_argument("--resume", action="store_true", help="continue the run from its checkpoint.pt")
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



def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="evaluation jobs")
    which = p.add_subparsers(dest="benchmark", required=True)
    lfw = which.add_parser("lfw", help="LFW, official SphereFace 10-fold protocol")
    lfw.add_argument(
        "--model", default="default", help="model name (`sphereface models`) or folder; default: default"
    )
    lfw.add_argument("--data", required=True, help="LFW folder with images/, pairs.txt")
    lfw.add_argument(
        "--landmarks",
        choices=("file", "detect"),
        default="file",
        help="file: DATA/landmarks.txt; detect: our MTCNN on the photos (face nearest the centre)",
    )
    lfw.add_argument("--json", dest="json_out", default=None, help="write every number here")
    lfw.add_argument("--plot", default=None, help="write the ROC curve here (PNG)")
    lfw.add_argument("--providers", default="cpu", help="execution providers, e.g. cuda,cpu")
    lfw.add_argument("--batch-size", type=int, default=64)
    lfw.add_argument(
        "--write-lfw",
        action="store_true",
        help="record the accuracy in the model's manifest (`sphereface models`)",
    )
    lfw.add_argument(
        "--with",
        dest="with_models",
        action="append",
        default=[],
        metavar="MODEL",
        help="also evaluate MODEL (repeatable) and the ensemble of all: each model's normalised "
        "features side by side, equal weights (--json then holds every model and the ensemble)",
    )
    lfw.set_defaults(func=_run_evaluate_lfw)

    marks = which.add_parser(
        "landmarks", help="our MTCNN on every LFW photo against lfw/landmarks.txt (found share, px error)"
    )
    marks.add_argument("--data", required=True, help="LFW folder with images/, landmarks.txt")
    marks.add_argument("--json", dest="json_out", default=None, help="write the report here")
    marks.add_argument("--limit", type=int, default=None, help="only the first N photos")
    marks.add_argument("--providers", default="cpu")
    marks.set_defaults(func=_run_evaluate_landmarks)

    mega = which.add_parser(
        "megaface",
        help="MegaFace Challenge 1 rule: rank-1/10 identification vs distractor count, TAR at FAR 1e-3..1e-6",
        description="Embeds probes and distractors once (cached under --cache, resumable), then for every "
        "probe identity and image: that image in a gallery with N distractors, searched with the others "
        "(N = 10, 100, ..., 1M, as many as there are). See docs/megaface.md.",
    )
    mega.add_argument(
        "--model", default="default", help="model name (`sphereface models`) or folder; default: default"
    )
    mega.add_argument(
        "--protocol",
        choices=("custom", "megaface", "local"),
        default="custom",
        help="local: the versioned protocol built from --data (../shared/data); megaface: FaceScrub probes "
        "and MegaFace distractors (the papers' numbers are comparable); custom: any other sets",
    )
    mega.add_argument("--data", default=None, help="the ../shared/data folder (--protocol local)")
    mega.add_argument(
        "--probes", default=None, help="folder with one sub-folder per identity, or a list file"
    )
    mega.add_argument(
        "--distractors", default=None, help="folder (any tree) of distractor images, or a list file"
    )
    mega.add_argument(
        "--augment-to",
        type=int,
        default=None,
        metavar="N",
        help="add embedded augmented copies of the distractor faces until there are N distractors",
    )
    mega.add_argument(
        "--extra-features",
        default=None,
        nargs="+",
        metavar="FILE.npy",
        help="more distractors as L2-normalised float32 (n, D) features of this model, made elsewhere "
        "(several files: e.g. the shards of `evaluate megaface-shard`)",
    )
    mega.add_argument(
        "--sizes",
        default=None,
        help="distractor counts, comma-separated (default 10,100,...,1M up to the set)",
    )
    mega.add_argument(
        "--remove-probes", default=None, metavar="LIST", help="probe images to remove (noise list)"
    )
    mega.add_argument(
        "--remove-distractors", default=None, metavar="LIST", help="distractor images to remove (noise list)"
    )
    mega.add_argument(
        "--max-per-identity", type=int, default=None, help="use at most this many images per probe identity"
    )
    mega.add_argument("--json", dest="json_out", default=None, help="write every number here")
    mega.add_argument("--plots", default=None, help="write the PNG plots into this folder")
    mega.add_argument("--cache", default=None, help="landmark and embedding cache (default .cache/megaface)")
    mega.add_argument("--providers", default="cpu", help="ONNX Runtime providers for faces, e.g. cuda,cpu")
    mega.add_argument("--device", default="cpu", help="search device: cpu (numpy) or cuda (torch)")
    mega.add_argument("--chunk-mb", type=float, default=256.0, help="score-matrix memory per search chunk")
    mega.add_argument("--workers", type=int, default=2, help="threads reading, detecting and aligning photos")
    mega.add_argument("--batch-size", type=int, default=64)
    mega.add_argument("--seed", type=int, default=0, help="distractor order and augmentation seed")
    mega.add_argument("--no-progress", action="store_true", help="no progress bars")
    mega.set_defaults(func=_run_evaluate_megaface)

    shard = which.add_parser(
        "megaface-shard",
        help="embed one shard of a large distractor set (one pod of a Kubernetes Indexed Job)",
        description="Detects, aligns and embeds every N-th distractor image from the shard index on, and "
        "writes L2-normalised float32 features (.npy, with a .json beside it). Pass every shard's file to "
        "`evaluate megaface --extra-features` for the search (docs/deploy.md, deploy/megaface).",
    )
    shard.add_argument("--model", default="default", help="model name or folder; default: default")
    shard.add_argument("--distractors", required=True, help="folder of distractor images, or a list file")
    shard.add_argument("--shard", type=int, required=True, help="this shard's index, 0..shards-1")
    shard.add_argument("--shards", type=int, required=True, help="how many shards the set is split into")
    shard.add_argument("--out", required=True, help="the shard's features, FILE.npy")
    shard.add_argument("--cache", default=None, help="landmark and embedding cache (default .cache/megaface)")
    shard.add_argument("--providers", default="cpu", help="ONNX Runtime providers, e.g. cuda,cpu")
    shard.add_argument(
        "--workers", type=int, default=2, help="threads reading, detecting and aligning photos"
    )
    shard.add_argument("--batch-size", type=int, default=64)
    shard.add_argument("--no-progress", action="store_true", help="no progress bars")
    shard.set_defaults(func=_run_evaluate_megaface_shard)



def _run_evaluate_lfw(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.lfw import run_lfw_evaluation

    args.model = resolve_model(args.model)
    if args.with_models:
        return _run_evaluate_lfw_ensemble(args)
    result = run_lfw_evaluation(
        model_dir=args.model,
        data_dir=args.data,
        landmarks=args.landmarks,
        json_out=args.json_out,
        plot_out=args.plot,
        providers=args.providers,
        batch_size=args.batch_size,
    )
    print(result.summary())
    if args.write_lfw:
        from models.manifest import load_manifest_data, save_manifest

        manifest = load_manifest_data(args.model)
        manifest.lfw = result.manifest_entry()
        save_manifest(args.model, manifest)
        print(f"wrote the LFW accuracy to {args.model}/manifest.json")
    return 0



def _run_evaluate_lfw_ensemble(args: argparse.Namespace) -> int:
    """``evaluate lfw --with``: every model on its own, then their ensemble."""
    import json

    from models.registry import resolve_model
    from training.evaluation.lfw import lfw_ensemble, plot_roc, run_lfw_evaluation

    if args.write_lfw:
        raise UsageError("--write-lfw records one model's accuracy; leave it out with --with")
    results = []
    for model in [args.model, *(resolve_model(m) for m in args.with_models)]:
        results.append(
            run_lfw_evaluation(
                model_dir=model,
                data_dir=args.data,
                landmarks=args.landmarks,
                providers=args.providers,
                batch_size=args.batch_size,
            )
        )
        print(results[-1].summary())
    ensemble = lfw_ensemble(results)
    print(ensemble.summary())
    if args.json_out:
        report = {"models": [r.to_dict() for r in results], "ensemble": ensemble.to_dict()}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_roc(
            ensemble.roc,
            args.plot,
            f"LFW ROC: ensemble of {len(results)} models (landmarks: {args.landmarks}), "
            f"{100 * ensemble.accuracy:.2f}%\n" + " + ".join(ensemble.model_ids),
        )
    return 0



def _run_evaluate_landmarks(args: argparse.Namespace) -> int:
    import json

    from training.evaluation.landmarks import detector_landmark_report

    report = detector_landmark_report(args.data, limit=args.limit, providers=args.providers)
    err = report["landmark_error_px"]
    print(
        f"face found in {report['faces_found']}/{report['images']} photos "
        f"({100 * report['faces_found_share']:.2f}%); landmark error vs landmarks.txt: "
        f"mean {err['mean']:.2f} px, median {err['median']:.2f} px, p95 {err['p95']:.2f} px"
    )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0



def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(float(part)) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--sizes must be comma-separated counts, got {text!r}") from None
    if not sizes or min(sizes) < 0:
        raise UsageError(f"--sizes must be counts >= 0, got {text!r}")
    return sizes



def _run_evaluate_megaface_shard(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.megaface import embed_distractor_shard

    summary = embed_distractor_shard(
        resolve_model(args.model),
        args.distractors,
        args.shard,
        args.shards,
        args.out,
        cache_dir=args.cache,
        providers=args.providers,
        workers=args.workers,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    print(
        f"shard {summary['shard']} of {summary['shards']}: {summary['images']} images, "
        f"{summary['faces_found']} faces found -> {summary['features']}"
    )
    return 0



def _run_evaluate_megaface(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.megaface import run_megaface, summary_lines

    report = run_megaface(
        resolve_model(args.model),
        protocol=args.protocol,
        data_dir=args.data,
        probes=args.probes,
        distractors=args.distractors,
        augment_to=args.augment_to,
        extra_features=args.extra_features,
        sizes=_sizes(args.sizes),
        remove_probes=args.remove_probes,
        remove_distractors=args.remove_distractors,
        max_per_identity=args.max_per_identity,
        json_out=args.json_out,
        plots_dir=args.plots,
        cache_dir=args.cache,
        providers=args.providers,
        device=args.device,
        chunk_mb=args.chunk_mb,
        workers=args.workers,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print("\n".join(summary_lines(report)))
    return 0



def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="cosine thresholds at FAR 1e-3..1e-6 from every pair of LFW's 13,233 photos",
        description="Embeds every LFW photo through the service's path (cached under .cache/megaface), "
        "scores every pair, and writes verification (FAR 1e-3) and identification (FAR 1e-4) thresholds "
        "into the model's manifest, with the set and pair counts. See training/evaluation/calibration.py.",
    )
    p.add_argument("--model", default="default", help="model name (`sphereface models`) or folder")
    p.add_argument("--lfw", default=None, help="LFW folder (default: ../shared/data/lfw)")
    p.add_argument("--landmarks", choices=("detect", "file"), default="detect")
    p.add_argument("--verification-far", type=float, default=1e-3)
    p.add_argument("--identification-far", type=float, default=1e-4)
    p.add_argument("--json", dest="json_out", default=None, help="write the whole report here")
    p.add_argument("--plot", default=None, help="write the score distributions with the thresholds (PNG)")
    p.add_argument("--no-write", action="store_true", help="measure only; leave the manifest as it is")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run_calibrate)



def _run_calibrate(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.calibration import plot_calibration, run_calibration, write_calibration
    from training.evaluation.report import write_json

    model_dir = resolve_model(args.model)
    lfw = (
        Path(args.lfw)
        if args.lfw
        else Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "lfw"
    )
    report = run_calibration(
        model_dir, lfw, landmarks=args.landmarks, workers=args.workers, progress=not args.no_progress
    )
    print(f"{report['model_id']}: {report['n_impostor']:,} impostor / {report['n_genuine']:,} genuine pairs")
    for label, entry in report["fars"].items():
        if entry:
            print(
                f"  FAR {label}: cosine {entry['threshold']:.4f}  TAR {100 * entry['tar']:.2f}% "
                f"(per person {100 * entry['tar_per_identity']:.2f}%)  "
                f"held-out FAR {entry['heldout_far']:.2e}"
            )
    if args.json_out:
        write_json(args.json_out, report)
    if args.plot:
        plot_calibration(report, args.plot)
    if not args.no_write:
        manifest = write_calibration(model_dir, report, args.verification_far, args.identification_far)
        for role in ("verification", "identification"):
            t = manifest.thresholds[role]
            print(f"wrote {role} threshold {t.value:.4f} (FAR {t.far:g}) to {model_dir}")
    return 0



def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="MegaFace-protocol JSON reports side by side as a Markdown table, next to the papers' numbers",
    )
    p.add_argument("reports", nargs="+", help="JSON files written by 'evaluate megaface --json'")
    p.add_argument("--names", default=None, help="comma-separated row names (default: the model ids)")
    p.add_argument("--out", default=None, help="write the Markdown here (default: print it)")
    p.set_defaults(func=_run_report)



def _run_report(args: argparse.Namespace) -> int:
    from training.evaluation.megaface_report import load_reports, markdown_report

    names = args.names.split(",") if args.names else None
    if names is not None and len(names) != len(args.reports):
        raise UsageError(f"--names has {len(names)} names for {len(args.reports)} reports")
    text = markdown_report(load_reports(args.reports), names)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0
