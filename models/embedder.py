"""Face embeddings on ONNX Runtime: batched, flip-fused, L2-normalised (thesis §2.3.6 "Testing")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from models.manifest import MODEL_NAME, ModelManifest, load_manifest
from models.runtime import create_session, session_provider


def preprocess(crops: np.ndarray, manifest: ModelManifest) -> np.ndarray:
    """Aligned RGB uint8 crops ``(N, H, W, 3)`` -> network input ``(N, 3, H, W)`` float32.

    Applies the manifest's colour order and ``(x - mean) / std`` normalisation (mean and std
    either one number or one per channel, in the model's colour order).
    """
    if crops.ndim != 4 or crops.shape[1:] != (manifest.input_height, manifest.input_width, 3):
        raise ValueError(
            f"crops must be (N, {manifest.input_height}, {manifest.input_width}, 3) uint8, got {crops.shape}"
        )
    x = crops.astype(np.float32)
    if manifest.color_order == "BGR":
        x = x[..., ::-1]
    mean = np.asarray(manifest.pixel_mean, dtype=np.float32)
    x = (x - mean) / np.asarray(manifest.pixel_std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def l2_normalize(x: np.ndarray, axis: int = -1, eps: float = 1e-12) -> np.ndarray:
    norm = np.linalg.norm(x, axis=axis, keepdims=True)
    return x / np.maximum(norm, eps)


class Embedder:
    """Runs a model folder's ``model.onnx`` on aligned crops.

    ``embed`` returns the fused representation of the papers: the embedding of the crop and of
    its horizontal mirror, concatenated (``flip_fusion="concat"``, 2 x embedding_size), summed
    (``"sum"``) or the crop alone (``"none"``), then L2-normalised, so that the dot product of
    two outputs is their cosine similarity in [-1, 1].
    """

    def __init__(
        self,
        model_dir: str | Path,
        providers: str | Sequence[str] = "cpu",
        *,
        batch_size: int = 64,
        intra_op_threads: int = 0,
        allow_fallback: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = load_manifest(self.model_dir)
        self.batch_size = batch_size
        self.session = create_session(
            self.model_dir / MODEL_NAME,
            providers,
            intra_op_threads=intra_op_threads,
            allow_fallback=allow_fallback,
        )
        self._input_name = self.session.get_inputs()[0].name

    @property
    def provider(self) -> str:
        """The execution provider the session really runs on."""
        return session_provider(self.session)

    @property
    def output_size(self) -> int:
        return self.manifest.output_size

    def raw(self, crops: np.ndarray) -> np.ndarray:
        """Network output for crops as they are (no flip, not normalised): ``(N, D)``."""
        x = preprocess(crops, self.manifest)
        out = [
            self.session.run(None, {self._input_name: x[i : i + self.batch_size]})[0]
            for i in range(0, len(x), self.batch_size)
        ]
        if not out:
            return np.zeros((0, self.manifest.embedding_size), dtype=np.float32)
        return np.concatenate(out).reshape(len(x), -1).astype(np.float32, copy=False)

    def embed(self, crops: np.ndarray, *, normalize: bool = True) -> np.ndarray:
        """Aligned RGB uint8 crops ``(N, H, W, 3)`` -> ``(N, output_size)`` fused embeddings.

        With ``normalize`` (the default) rows are unit vectors, so a dot product is a cosine in
        [-1, 1]. ``normalize=False`` keeps the raw fused features, as the official LFW protocol
        needs them (it subtracts a mean before normalising).
        """
        if self.manifest.flip_fusion == "none":
            fused = self.raw(crops)
        else:
            n = len(crops)
            # Original and mirrored crops in one pass so batches stay full.
            both = self.raw(np.concatenate([crops, crops[:, :, ::-1]]))
            fused = self.fuse(both[:n], both[n:])
        return l2_normalize(fused) if normalize else fused

    def fuse(self, original: np.ndarray, mirrored: np.ndarray) -> np.ndarray:
        """The manifest's flip fusion of the network's ``(N, D)`` outputs for crops and for their
        mirrors (:meth:`raw`): concatenated, summed, or the crops' alone; not normalised."""
        fusion = self.manifest.flip_fusion
        if fusion == "concat":
            return np.concatenate([original, mirrored], axis=1)
        if fusion == "sum":
            return original + mirrored
        return original
