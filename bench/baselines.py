"""The PyTorch eager baselines the benchmarks time our ONNX models against: the network behind a
model folder (checked to compute what the folder computes), and a verify service built the way
people build one today (facenet-pytorch's MTCNN + PyTorch eager)."""

from __future__ import annotations

import io
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.timing import log
from models.align import align_faces, get_template
from models.embedder import Embedder, preprocess
from models.manifest import MANIFEST_NAME, MODEL_NAME


def ensure_model(model_dir: Path, checkpoint: Path) -> bool:
    """Import the checkpoint into ``model_dir`` when it is not a model folder yet; True if imported."""
    if (model_dir / MANIFEST_NAME).is_file() and (model_dir / MODEL_NAME).is_file():
        return False
    from models.importers import import_mobilefacenet

    log(f"{model_dir} is not a model folder: importing {checkpoint} into it")
    import_mobilefacenet(checkpoint, model_dir)
    return True


def load_torch_net(checkpoint: Path):
    from models.nets.mobilefacenet import load_mobilefacenet

    data = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = data["net_state_dict"] if "net_state_dict" in data else data
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return load_mobilefacenet(state).eval()


def torch_baseline_name(model_dir: Path) -> str:
    """What :func:`load_torch_baseline` runs for this model folder, in words (for reports)."""
    from models.manifest import load_manifest
    from models.nets.dlib_resnet import DLIB_ARCHITECTURE

    if load_manifest(model_dir).architecture == DLIB_ARCHITECTURE:
        return "dlib's ResNet (rebuilt in PyTorch from dlib's own file)"
    return "MobileFaceNet (the reference checkpoint)"


def load_torch_baseline(model_dir: Path, checkpoint: Path):
    """The PyTorch network behind a model folder, for the eager baseline: dlib's ResNet rebuilt
    from dlib's own file (``make install`` caches it) for the dlib model, else MobileFaceNet
    from ``checkpoint``."""
    from models.manifest import load_manifest
    from models.nets.dlib_resnet import DLIB_ARCHITECTURE

    if load_manifest(model_dir).architecture == DLIB_ARCHITECTURE:
        from models.dlib_format import DLIB_RESNET_FILE, parse_dlib_face_resnet
        from models.importers import cached_dlib_file
        from models.nets.dlib_resnet import DlibFaceResNet

        path = cached_dlib_file(DLIB_RESNET_FILE)
        net = DlibFaceResNet.from_dlib(parse_dlib_face_resnet(path.read_bytes(), path.name)).eval()
    else:
        net = load_torch_net(checkpoint)
    require_same_network(net, model_dir, f"MobileFaceNet from {checkpoint}")
    return net


class BaselineMismatchError(ValueError):
    """The PyTorch eager baseline does not compute what the model folder computes."""


def require_same_network(net, model_dir: Path, what: str, min_cosine: float = 0.999) -> None:
    """Refuse a baseline whose raw embedding of random crops differs from the ONNX model's (an
    ensemble, or any model not exported from the checkpoint, would be timed against another
    network)."""
    embedder = Embedder(model_dir, "cpu", intra_op_threads=1)
    manifest = embedder.manifest
    crops = np.random.default_rng(0).integers(
        0, 256, size=(2, manifest.input_height, manifest.input_width, 3), dtype=np.uint8
    )
    ours = embedder.raw(crops)
    with torch.inference_mode():
        eager = net(torch.from_numpy(preprocess(crops, manifest))).numpy()
    if eager.shape != ours.shape:
        raise BaselineMismatchError(
            f"{model_dir} embeds into {ours.shape[1:]} but the eager baseline ({what}) into "
            f"{eager.shape[1:]}: it is not the model's network; benchmark dlib_resnet_v1 or the model "
            "exported from --checkpoint"
        )
    cosine = np.sum(eager * ours, axis=1) / (np.linalg.norm(eager, axis=1) * np.linalg.norm(ours, axis=1))
    if float(cosine.min()) < min_cosine:
        raise BaselineMismatchError(
            f"the eager baseline ({what}) and {model_dir} disagree on random crops (cosine "
            f"{float(cosine.min()):.4f} < {min_cosine}): it is not the model's network; benchmark "
            "dlib_resnet_v1 or the model exported from --checkpoint"
        )


class HandRolledVerifier:
    """What a verify service built from facenet-pytorch and PyTorch looks like (the baseline)."""

    def __init__(self, mtcnn_cls, standin, net, manifest, detector_settings: dict[str, Any]) -> None:
        self.standin = standin
        self.nms_seconds: list[float] = []  # per call: time in the pure-torch stand-in NMS
        self.mtcnn = mtcnn_cls(
            min_face_size=detector_settings["min_face_size"],
            thresholds=list(detector_settings["thresholds"]),
            factor=detector_settings["factor"],
            select_largest=True,  # detect() returns the largest face first, like policy "largest"
            keep_all=False,
            device=torch.device("cpu"),
        )
        self.mtcnn.eval()
        self.net = net
        self.template = get_template(manifest.template)
        # Per channel (dlib's model has one mean per channel), as (1, C, 1, 1) tensors.
        self.mean = torch.tensor(manifest.pixel_mean, dtype=torch.float32).reshape(1, -1, 1, 1)
        self.std = torch.tensor(manifest.pixel_std, dtype=torch.float32).reshape(1, -1, 1, 1)
        self.bgr = manifest.color_order == "BGR"
        self.fusion = manifest.flip_fusion
        self.stages: dict[str, float] = defaultdict(float)

    def embed_photo(self, data: bytes) -> np.ndarray:
        from PIL import Image, ImageOps

        t0 = time.perf_counter()
        image = Image.open(io.BytesIO(data))
        image = ImageOps.exif_transpose(image).convert("RGB")
        rgb = np.asarray(image)
        t1 = time.perf_counter()
        boxes, _probs, points = self.mtcnn.detect(rgb, landmarks=True)
        if boxes is None or len(boxes) == 0:
            raise RuntimeError("baseline: no face found")
        t2 = time.perf_counter()
        crop = align_faces(rgb, np.asarray(points[0], dtype=np.float64)[None], self.template)
        t3 = time.perf_counter()
        x = torch.from_numpy(crop).permute(0, 3, 1, 2).float()
        if self.bgr:
            x = x.flip(1)
        x = (x - self.mean) / self.std
        with torch.inference_mode():
            if self.fusion == "none":
                fused = self.net(x).reshape(-1)
            else:
                out = self.net(torch.cat([x, x.flip(3)])).reshape(2, -1)
                fused = torch.cat([out[0], out[1]]) if self.fusion == "concat" else out[0] + out[1]
            fused = fused / fused.norm().clamp_min(1e-12)
        t4 = time.perf_counter()
        for stage, dt in (("decode", t1 - t0), ("detect", t2 - t1), ("align", t3 - t2), ("embed", t4 - t3)):
            self.stages[stage] += dt
        return fused.numpy()

    def __call__(self, pair: dict[str, Any]) -> float:
        nms_before = self.standin.TIMING["batched_nms_seconds"]
        a = self.embed_photo(pair["bytes1"])
        b = self.embed_photo(pair["bytes2"])
        self.nms_seconds.append(self.standin.TIMING["batched_nms_seconds"] - nms_before)
        return float(np.clip(a @ b, -1.0, 1.0))
