"""``sphereface evaluate`` (``lfw``, ``landmarks``, ``megaface``, ``megaface-shard``, ``bin``, ``ijb``),
``sphereface calibrate`` and ``sphereface report``: the evaluation jobs' subcommands, added by
:func:`register` (which :mod:`training.commands` calls). Each imports what it needs only when it
runs, so ``sphereface --help`` stays instant."""

from __future__ import annotations

import argparse
from pathlib import Path

from models.cli import UsageError

#: Where ``sphereface calibrate`` looks for LFW without ``--lfw``: ``../shared/data/lfw`` beside the
#: repository.
DEFAULT_LFW_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "lfw"


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``evaluate`` (with its benchmarks), ``calibrate`` and ``report``."""
    _add_evaluate(sub)
    _add_calibrate(sub)
    _add_report(sub)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="evaluation jobs")
    which = p.add_subparsers(dest="benchmark", required=True)
    _add_evaluate_lfw(which)
    _add_evaluate_landmarks(which)
    _add_evaluate_megaface(which)
    _add_evaluate_megaface_shard(which)
    _add_evaluate_bin(which)
    _add_evaluate_ijb(which)


def _add_evaluate_lfw(which: argparse._SubParsersAction) -> None:
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


def _add_evaluate_landmarks(which: argparse._SubParsersAction) -> None:
    marks = which.add_parser(
        "landmarks", help="our MTCNN on every LFW photo against lfw/landmarks.txt (found share, px error)"
    )
    marks.add_argument("--data", required=True, help="LFW folder with images/, landmarks.txt")
    marks.add_argument("--json", dest="json_out", default=None, help="write the report here")
    marks.add_argument("--limit", type=int, default=None, help="only the first N photos")
    marks.add_argument("--providers", default="cpu")
    marks.set_defaults(func=_run_evaluate_landmarks)


def _add_evaluate_megaface(which: argparse._SubParsersAction) -> None:
    mega = which.add_parser(
        "megaface",
        help="MegaFace Challenge 1 rule: rank-1/10 identification vs distractor count, TAR at FAR 1e-3..1e-6",
        description="Embeds probes and distractors once (cached under --cache, resumable), then for every "
        "probe identity and image: that image in a gallery with N distractors, searched with the others "
        "(N = 10, 100, ..., 1M, as many as there are). See docs/reference/megaface-protocol.md.",
    )
    _add_megaface_sets(mega)
    _add_megaface_run(mega)
    mega.set_defaults(func=_run_evaluate_megaface)


def _add_megaface_sets(mega: argparse.ArgumentParser) -> None:
    """The model, the protocol and its probe and distractor sets, noise lists and sizes."""
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


def _add_megaface_run(mega: argparse.ArgumentParser) -> None:
    """Where the results go, the cache, and how the faces are embedded and searched."""
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


def _add_evaluate_megaface_shard(which: argparse._SubParsersAction) -> None:
    shard = which.add_parser(
        "megaface-shard",
        help="embed one shard of a large distractor set (one pod of a Kubernetes Indexed Job)",
        description="Detects, aligns and embeds every N-th distractor image from the shard index on, and "
        "writes L2-normalised float32 features (.npy, with a .json beside it). Pass every shard's file to "
        "`evaluate megaface --extra-features` for the search (docs/guides/deploy.md, deploy/megaface).",
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


def _add_evaluate_bin(which: argparse._SubParsersAction) -> None:
    ver = which.add_parser(
        "bin",
        help="insightface .bin verification sets (LFW, CFP-FP, AgeDB-30, CALFW, CPLFW): 10-fold accuracy",
        description="Reads each set's pickle of 112x112 ArcFace-aligned faces and same/different labels "
        "(only lists of bytes and bools are accepted), cuts the model's crop from each face, and reports "
        "10-fold accuracy on the service's cosine, on insightface's scoring and on SphereFace's protocol, "
        "with TAR at FAR 1e-3. See docs/reference/verification-sets.md.",
    )
    ver.add_argument("sets", nargs="+", metavar="FILE.bin", help="insightface .bin files")
    ver.add_argument(
        "--model", default="default", help="model name (`sphereface models`) or folder; default: default"
    )
    ver.add_argument("--json", dest="json_out", default=None, help="write every number here")
    ver.add_argument("--providers", default="cpu", help="execution providers, e.g. cuda,cpu")
    ver.add_argument("--batch-size", type=int, default=64)
    ver.add_argument("--workers", type=int, default=2, help="threads decoding and cropping the faces")
    ver.add_argument("--no-progress", action="store_true", help="no progress bars")
    ver.set_defaults(func=_run_evaluate_bin)


def _add_evaluate_ijb(which: argparse._SubParsersAction) -> None:
    ijb = which.add_parser(
        "ijb",
        help="IJB-B / IJB-C 1:1 template verification: TAR at FAR 1e-6..1e-1",
        description="Faces of DATA/loose_crop aligned with the landmarks of DATA/meta, flip-summed, "
        "weighted by their faceness score, averaged per media and summed per template; the cosine of "
        "every template pair of the protocol (features cached under --cache, resumable). See "
        "docs/reference/verification-sets.md.",
    )
    ijb.add_argument("--data", required=True, help="folder with loose_crop/ and meta/ (or its parent)")
    ijb.add_argument("--protocol", required=True, choices=("IJBB", "IJBC"))
    ijb.add_argument(
        "--model", default="default", help="model name (`sphereface models`) or folder; default: default"
    )
    ijb.add_argument("--json", dest="json_out", default=None, help="write every number here")
    ijb.add_argument("--cache", default=None, help="feature cache (default .cache/megaface)")
    ijb.add_argument("--providers", default="cpu", help="execution providers, e.g. cuda,cpu")
    ijb.add_argument("--batch-size", type=int, default=64)
    ijb.add_argument("--workers", type=int, default=2, help="threads reading and aligning the faces")
    ijb.add_argument("--no-progress", action="store_true", help="no progress bars")
    ijb.set_defaults(func=_run_evaluate_ijb)


def _run_evaluate_bin(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.bin_eval import run_bin_evaluation

    report = run_bin_evaluation(
        resolve_model(args.model),
        args.sets,
        json_out=args.json_out,
        providers=args.providers,
        batch_size=args.batch_size,
        workers=args.workers,
        progress=not args.no_progress,
    )
    print(f"model {report.model_id} on {report.provider} (template {report.template})")
    for evaluation in report.evaluations:
        print(evaluation.summary())
    return 0


def _run_evaluate_ijb(args: argparse.Namespace) -> int:
    from models.registry import resolve_model
    from training.evaluation.ijb import run_ijb, summary_lines

    report = run_ijb(
        resolve_model(args.model),
        args.data,
        args.protocol,
        json_out=args.json_out,
        cache_dir=args.cache,
        providers=args.providers,
        batch_size=args.batch_size,
        workers=args.workers,
        progress=not args.no_progress,
    )
    print("\n".join(summary_lines(report)))
    return 0


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
    from models.registry import resolve_model
    from training.evaluation.lfw import lfw_ensemble, plot_roc, run_lfw_evaluation
    from training.evaluation.report import write_json

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
        write_json(args.json_out, report, indent=2)
    if args.plot:
        plot_roc(
            ensemble.roc,
            args.plot,
            f"LFW ROC: ensemble of {len(results)} models (landmarks: {args.landmarks}), "
            f"{100 * ensemble.accuracy:.2f}%\n" + " + ".join(ensemble.model_ids),
        )
    return 0


def _run_evaluate_landmarks(args: argparse.Namespace) -> int:
    from training.evaluation.landmarks import detector_landmark_report
    from training.evaluation.report import write_json

    report = detector_landmark_report(args.data, limit=args.limit, providers=args.providers)
    err = report["landmark_error_px"]
    print(
        f"face found in {report['faces_found']}/{report['images']} photos "
        f"({100 * report['faces_found_share']:.2f}%); landmark error vs landmarks.txt: "
        f"mean {err['mean']:.2f} px, median {err['median']:.2f} px, p95 {err['p95']:.2f} px"
    )
    if args.json_out:
        write_json(args.json_out, report, indent=2)
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
    lfw = Path(args.lfw) if args.lfw else DEFAULT_LFW_DIR
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
    from training.evaluation.report import write_text

    names = args.names.split(",") if args.names else None
    if names is not None and len(names) != len(args.reports):
        raise UsageError(f"--names has {len(names)} names for {len(args.reports)} reports")
    text = markdown_report(load_reports(args.reports), names)
    if args.out:
        write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0
