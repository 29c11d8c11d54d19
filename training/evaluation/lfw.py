"""LFW face verification: the evaluation job, ensembles of models, and aligned crops for training.

The job (:class:`LFWJob`, :func:`run_lfw_evaluation`) scores a model folder with the official
SphereFace 10-fold protocol (:mod:`training.evaluation.verification`; SphereFace thesis §2.3.6,
"Testing"). Features come from :class:`models.embedder.Embedder`, the very path the service uses:
the network's outputs for the crop and its mirror, concatenated and *not* normalised, exactly as
``evaluation.m`` feeds them to the protocol. ROC data (and the thresholds at fixed false-accept
rates) are computed separately on the cosine the service returns: L2-normalised fused features,
no mean subtraction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.cache import detected_lfw_landmarks
from training.evaluation.errors import LFWDataError
from training.evaluation.landmarks import (
    NO_FACE_POLICY,
    detect_central_landmarks,
    landmark_error_stats,
    make_detector,
)
from training.evaluation.lfw_files import (
    IMAGES_DIR,
    LANDMARKS_FILE,
    LFWPairs,
    load_pairs,
    pair_features,
    read_landmarks,
)
from training.evaluation.parallel import ordered_map, progress_bar
from training.evaluation.report import new_axes, save_figure, write_json
from training.evaluation.verification import (
    RocCurve,
    TenFoldResult,
    lfw_10fold_accuracy,
    roc_curve,
    unit_rows,
)

log = logging.getLogger(__name__)

LANDMARK_MODES = ("file", "detect")


def plot_roc(curve: RocCurve, path: str | Path, title: str) -> Path:
    """Write the ROC curve as a PNG (Agg backend, log-scale FAR axis)."""
    fig, ax = new_axes((6.4, 5.2), dpi=120)
    visible = curve.far > 0
    ax.plot(curve.far[visible], curve.tar[visible], lw=1.8, label=f"ROC (AUC {curve.auc:.4f})")
    for label, value in curve.tar_at_far.items():
        if value is not None:
            ax.plot([float(label)], [value], "o", ms=5, label=f"TAR {100 * value:.2f}% @ FAR {label}")
    ax.set_xscale("log")
    ax.set_xlim(0.5 / curve.n_different, 1.0)
    low = curve.tar[np.searchsorted(curve.far, 1.0 / curve.n_different)] if len(curve.far) else 0.0
    ax.set_ylim(max(0.0, min(0.9, float(low) - 0.02)), 1.001)
    ax.set_xlabel(f"false accept rate (log scale, {curve.n_different} different pairs)")
    ax.set_ylabel(f"true accept rate ({curve.n_same} same pairs)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# The evaluation job
# --------------------------------------------------------------------------------------------


@dataclass
class LFWEvaluation:
    """Everything one LFW run measured; ``to_dict`` is what goes into the JSON file."""

    model_id: str
    provider: str
    landmarks: str
    n_pairs: int
    n_images: int
    protocol: TenFoldResult
    #: the same folds and threshold rule on the score the service computes (cosine, no mean subtracted)
    cosine: TenFoldResult
    roc: RocCurve
    timing: dict[str, float]
    no_face_list: list[str] = field(default_factory=list)
    detection: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``(n_images, D)`` fused, unnormalised features of ``names`` (kept for threshold calibration;
    #: not written to the JSON).
    features: np.ndarray | None = field(default=None, repr=False)
    names: list[str] = field(default_factory=list, repr=False)
    pairs: LFWPairs | None = field(default=None, repr=False)

    @property
    def accuracy(self) -> float:
        return self.protocol.accuracy

    @property
    def std(self) -> float:
        return self.protocol.std

    @property
    def threshold(self) -> float:
        return self.protocol.threshold

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "benchmark": "LFW View 2",
            "protocol": "official SphereFace evaluation.m: 10 folds, training-fold mean subtracted, "
            "L2-normalised, dot product, threshold = mean of all grid thresholds "
            "(-10000:10000)/10000 with maximal training accuracy",
            "model_id": self.model_id,
            "provider": self.provider,
            "landmarks": self.landmarks,
            "n_pairs": self.n_pairs,
            "n_images": self.n_images,
            **self.protocol.to_dict(),
            "std_ddof": 1,
            "cosine_protocol": {
                "what": "the same 10 folds and threshold rule on the cosine the service computes "
                "(L2-normalised fused features, no training-fold mean subtracted)",
                **self.cosine.to_dict(),
            },
            "no_face_images": len(self.no_face_list),
            "roc": self.roc.to_dict(),
            "timing_s": self.timing,
        }
        if self.detection is not None:
            out["no_face_list"] = self.no_face_list
            out.update(self.detection)
        out.update(self.extra)
        return out

    def manifest_entry(self) -> dict[str, Any]:
        """What a model's manifest records of this run (``manifest.lfw``)."""
        return {
            "accuracy": self.accuracy,
            "std": self.std,
            "accuracy_cosine": self.cosine.accuracy,
            "std_cosine": self.cosine.std,
            "landmarks": self.landmarks,
            "protocol": "official SphereFace 10-fold (sphereface evaluate lfw); accuracy_cosine: the same "
            "folds on the service's cosine score",
        }

    def summary(self) -> str:
        p = self.protocol
        lines = [
            f"LFW ({self.n_pairs} pairs in {len(p.fold_accuracies)} folds, {self.n_images} images, "
            f"landmarks={self.landmarks}) model {self.model_id} on {self.provider}",
            f"accuracy {100 * p.accuracy:.2f}% ± {100 * p.std:.2f}% (official SphereFace protocol: "
            f"training folds' mean subtracted; threshold {p.threshold:.4f})",
            f"accuracy {100 * self.cosine.accuracy:.2f}% ± {100 * self.cosine.std:.2f}% (the same folds on "
            f"the service's score: the cosine, no mean subtracted; threshold {self.cosine.threshold:.4f})",
            "folds (official): " + " ".join(f"{100 * a:.2f}" for a in p.fold_accuracies),
        ]
        tars = [f"{100 * v:.2f}% @ FAR {k}" for k, v in self.roc.tar_at_far.items() if v is not None]
        lines.append(f"ROC (raw cosine): AUC {self.roc.auc:.5f}; TAR " + ", ".join(tars))
        if self.detection is not None:
            d = self.detection
            err = d["landmark_error_px"]
            lines.append(
                f"MTCNN: face found in {100 * d['faces_found_share']:.2f}% of images, "
                f"{len(self.no_face_list)} without a face (central-box fallback)"
            )
            if err and err.get("mean") is not None:
                per_point = " ".join(f"{k} {v:.2f}" for k, v in err["per_point"].items())
                lines.append(
                    f"landmark error vs landmarks.txt: mean {err['mean']:.2f} px, median "
                    f"{err['median']:.2f} px over {err['images']} images ({per_point})"
                )
        lines.append(f"took {self.timing['total']:.1f} s ({self.timing['images_per_s']:.1f} images/s)")
        return "\n".join(lines)


@dataclass
class _Inputs:
    """What the load stage found: the pairs, their images, the landmarks file and the models."""

    pairs: LFWPairs
    names: list[str]
    reference: dict[str, np.ndarray] | None
    embedder: Any
    template: Any
    detector: Any
    embed_threads: int


@dataclass
class _Faces:
    """What the embed stage made, one row per image: fused features, landmarks, found flags."""

    features: np.ndarray
    points: np.ndarray
    found: np.ndarray
    embed_seconds: float


@dataclass
class LFWJob:
    """One LFW evaluation: the options, and one method per stage (:meth:`run` drives them).

    See :func:`run_lfw_evaluation` for the options.
    """

    model_dir: str | Path
    data_dir: str | Path
    landmarks: str = "file"
    json_out: str | Path | None = None
    plot_out: str | Path | None = None
    providers: str | Sequence[str] = "cpu"
    batch_size: int = 64
    pairs_per_fold: int | None = None
    workers: int = 2
    detector: Any = None
    embed_threads: int | None = None
    progress: bool = True
    #: when :meth:`run` started (ISO 8601, UTC, seconds)
    started_at: str = field(default="", init=False)

    def run(self) -> LFWEvaluation:
        """Load, embed, score and report; writes ``json_out`` and ``plot_out`` when set."""
        if self.landmarks not in LANDMARK_MODES:
            raise ValueError(f"landmarks must be one of {LANDMARK_MODES}, got {self.landmarks!r}")
        started = time.perf_counter()
        self.started_at = datetime.now(UTC).isoformat(timespec="seconds")
        inputs = self.load()
        loaded = time.perf_counter()
        faces = self.embed(inputs)
        embedded = time.perf_counter()
        protocol, cosine, curve = self.score(faces, inputs)
        finished = time.perf_counter()
        timing = {
            "total": finished - started,
            "load": loaded - started,
            "images_and_embedding": embedded - loaded,
            "embedding": faces.embed_seconds,
            "protocol_and_roc": finished - embedded,
            "images_per_s": len(inputs.names) / max(embedded - loaded, 1e-9),
        }
        evaluation = self.report(inputs, faces, protocol, cosine, curve, timing)
        self.write(evaluation)
        log.info("LFW accuracy %.4f ± %.4f", protocol.accuracy, protocol.std)
        return evaluation

    def load(self) -> _Inputs:
        """The pairs and their images, ``landmarks.txt`` (required in file mode, used in detect
        mode for the landmark error when there), the embedder and, in detect mode, the detector."""
        from models.align import get_template
        from models.embedder import Embedder

        data_dir = Path(self.data_dir)
        pairs = load_pairs(data_dir, self.pairs_per_fold)
        names = pairs.images()
        landmarks_path = data_dir / LANDMARKS_FILE
        reference: dict[str, np.ndarray] | None = None
        if self.landmarks == "file" or landmarks_path.is_file():
            reference = read_landmarks(landmarks_path)
        if self.landmarks == "file":
            assert reference is not None
            missing = [n for n in names if n not in reference]
            if missing:
                raise LFWDataError(
                    f"{landmarks_path} has no landmarks for {len(missing)} images of the pairs, e.g. "
                    + ", ".join(missing[:5])
                )
        embed_threads = self.embed_threads
        if embed_threads is None:
            embed_threads = 1 if self.landmarks == "detect" and self.workers > 1 else 0
        embedder = Embedder(
            self.model_dir, self.providers, batch_size=self.batch_size, intra_op_threads=embed_threads
        )
        template = get_template(embedder.manifest.template)
        detector = self.detector
        if self.landmarks == "detect" and detector is None:
            detector = make_detector(self.providers)
        return _Inputs(pairs, names, reference, embedder, template, detector, embed_threads)

    def embed(self, inputs: _Inputs) -> _Faces:
        """Every image read, its landmarks placed and aligned on ``workers`` threads while this one
        embeds the crops in batches (fused, not normalised)."""
        from models.align import align_face
        from models.image import read_image

        images = Path(self.data_dir) / IMAGES_DIR

        def work(name: str) -> tuple[np.ndarray, np.ndarray, bool]:
            image = read_image(images / name)
            if self.landmarks == "file":
                points, found = inputs.reference[name], True  # type: ignore[index]
            else:
                points, found = detect_central_landmarks(inputs.detector, image)
            return align_face(image, points, inputs.template), points, found

        n = len(inputs.names)
        faces = _Faces(
            np.empty((n, inputs.embedder.manifest.output_size), dtype=np.float32),
            np.empty((n, 5, 2), dtype=np.float64),
            np.empty(n, dtype=bool),
            0.0,
        )
        batch: list[np.ndarray] = []
        stream = ordered_map(work, inputs.names, self.workers, window=2 * self.batch_size)
        for i, (crop, points, found) in enumerate(progress_bar(stream, n, "LFW images", self.progress)):
            batch.append(crop)
            faces.points[i], faces.found[i] = points, found
            if len(batch) == self.batch_size or i == n - 1:
                t0 = time.perf_counter()
                faces.features[i + 1 - len(batch) : i + 1] = inputs.embedder.embed(
                    np.stack(batch), normalize=False
                )
                faces.embed_seconds += time.perf_counter() - t0
                batch.clear()
        return faces

    def score(self, faces: _Faces, inputs: _Inputs) -> tuple[TenFoldResult, TenFoldResult, RocCurve]:
        """The official protocol, the same folds on the service's cosine, and the ROC of that cosine."""
        pairs = inputs.pairs
        left, right = pair_features(faces.features, inputs.names, pairs)
        protocol = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold)
        cosine = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold, subtract_mean=False)
        # ROC and its thresholds on the cosine the service computes (no mean subtraction).
        raw_scores = np.einsum(
            "ij,ij->i", unit_rows(left.astype(np.float64)), unit_rows(right.astype(np.float64))
        )
        return protocol, cosine, roc_curve(raw_scores, pairs.is_same)

    def report(
        self,
        inputs: _Inputs,
        faces: _Faces,
        protocol: TenFoldResult,
        cosine: TenFoldResult,
        curve: RocCurve,
        timing: dict[str, float],
    ) -> LFWEvaluation:
        """Everything measured, with the run's settings (``extra``)."""
        manifest = inputs.embedder.manifest
        return LFWEvaluation(
            model_id=manifest.model_id,
            provider=inputs.embedder.provider,
            landmarks=self.landmarks,
            n_pairs=len(inputs.pairs),
            n_images=len(inputs.names),
            protocol=protocol,
            cosine=cosine,
            roc=curve,
            timing=timing,
            no_face_list=[n for n, ok in zip(inputs.names, faces.found, strict=True) if not ok],
            detection=self._detection(inputs, faces),
            features=faces.features,
            names=inputs.names,
            pairs=inputs.pairs,
            extra={
                "started_at": self.started_at,
                "data_dir": str(Path(self.data_dir)),
                "model_dir": str(self.model_dir),
                "pairs_per_fold": self.pairs_per_fold,
                "batch_size": self.batch_size,
                "workers": self.workers,
                "embed_threads": inputs.embed_threads,
                "template": manifest.template,
                "flip_fusion": manifest.flip_fusion,
            },
        )

    def _detection(self, inputs: _Inputs, faces: _Faces) -> dict[str, Any] | None:
        """Detect mode: the share of images with a face, the detector's provider and the landmark
        error against ``landmarks.txt`` (when there). None in file mode."""
        if self.landmarks != "detect":
            return None
        names, found, reference = inputs.names, faces.found, inputs.reference
        detection: dict[str, Any] = {
            "no_face_policy": NO_FACE_POLICY,
            "faces_found_share": float(found.mean()),
            "detector_provider": str(getattr(inputs.detector, "provider", self.providers)),
            "landmark_error_px": None,
        }
        if reference is not None:
            with_ref = np.array([ok and n in reference for n, ok in zip(names, found, strict=True)])
            refs = np.array([reference[n] for n, ok in zip(names, with_ref, strict=True) if ok])
            detection["landmark_error_px"] = landmark_error_stats(faces.points[with_ref], refs)
        return detection

    def write(self, evaluation: LFWEvaluation) -> None:
        """The JSON report to ``json_out`` and the ROC figure to ``plot_out`` (each when set)."""
        if self.json_out is not None:
            write_json(self.json_out, evaluation.to_dict(), indent=2)
        if self.plot_out is not None:
            p = evaluation.protocol
            title = (
                f"LFW ROC: {evaluation.model_id} (landmarks: {self.landmarks})\n"
                f"10-fold accuracy {100 * p.accuracy:.2f}% ± {100 * p.std:.2f}%"
            )
            plot_roc(evaluation.roc, self.plot_out, title)


def run_lfw_evaluation(
    model_dir: str | Path,
    data_dir: str | Path,
    landmarks: str = "file",
    json_out: str | Path | None = None,
    plot_out: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    batch_size: int = 64,
    *,
    pairs_per_fold: int | None = None,
    workers: int = 2,
    detector: Any = None,
    embed_threads: int | None = None,
    progress: bool = True,
) -> LFWEvaluation:
    """Evaluate a model folder on LFW with the official protocol; optionally write JSON and ROC PNG.

    Args:
        model_dir: model folder (``model.onnx`` + ``manifest.json``).
        data_dir: LFW folder with ``images/``, ``pairs.txt`` and (for ``landmarks="file"``, and for
            the landmark error in detect mode) ``landmarks.txt``.
        landmarks: ``"file"`` (landmarks.txt) or ``"detect"`` (our MTCNN, face nearest the centre).
        pairs_per_fold: evaluate only the first ``n/2`` same and ``n/2`` different pairs per fold.
        workers: threads decoding, detecting and aligning images while the main thread embeds.
        detector: a detector object for detect mode (default: a new ``MTCNNDetector``).
        embed_threads: ONNX Runtime intra-op threads of the embedder (0: one per core). Default:
            1 in detect mode with several workers (the detector threads keep the cores busy; measured
            faster on 2 cores than a 2-thread embedder competing with them), else 0.
    """
    return LFWJob(
        model_dir, data_dir, landmarks, json_out, plot_out, providers, batch_size,
        pairs_per_fold=pairs_per_fold, workers=workers, detector=detector, embed_threads=embed_threads,
        progress=progress,
    ).run()  # fmt: skip


# --------------------------------------------------------------------------------------------
# Ensembles: several models' features side by side
# --------------------------------------------------------------------------------------------


@dataclass
class EnsembleEvaluation:
    """LFW of several models at once: their fused features side by side (equal weights)."""

    model_ids: list[str]
    protocol: TenFoldResult
    cosine: TenFoldResult
    roc: RocCurve

    @property
    def accuracy(self) -> float:
        return self.protocol.accuracy

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": self.model_ids,
            "features": "each model's flip-fused features L2-normalised, side by side (equal weights)",
            **self.protocol.to_dict(),
            "cosine_protocol": self.cosine.to_dict(),
            "roc": self.roc.to_dict(),
        }

    def summary(self) -> str:
        return (
            f"ensemble of {' + '.join(self.model_ids)}: accuracy {100 * self.protocol.accuracy:.2f}% ± "
            f"{100 * self.protocol.std:.2f}% (official protocol), {100 * self.cosine.accuracy:.2f}% ± "
            f"{100 * self.cosine.std:.2f}% on the cosine; AUC {self.roc.auc:.5f}"
        )


def lfw_ensemble(evaluations: Sequence[LFWEvaluation]) -> EnsembleEvaluation:
    """The official protocol, the service's cosine and the ROC on the models' features side by side.

    Raises:
        ValueError: fewer than two evaluations, or evaluations of different images or pairs.
    """
    if len(evaluations) < 2:
        raise ValueError("an ensemble needs at least two models")
    first, pairs = evaluations[0], evaluations[0].pairs
    if first.features is None or pairs is None:
        raise ValueError(f"{first.model_id} has no features to combine")
    for other in evaluations[1:]:
        if other.features is None or other.names != first.names or other.pairs is None:
            raise ValueError(f"{other.model_id} was not evaluated on the same LFW images as {first.model_id}")
        if not np.array_equal(other.pairs.is_same, pairs.is_same):
            raise ValueError(f"{other.model_id} was not evaluated on the same pairs as {first.model_id}")
    from models.ensemble import concatenated_unit_features

    features = concatenated_unit_features([e.features for e in evaluations])  # type: ignore[misc]
    left, right = pair_features(features, first.names, pairs)
    return EnsembleEvaluation(
        model_ids=[e.model_id for e in evaluations],
        protocol=lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold),
        cosine=lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold, subtract_mean=False),
        roc=roc_curve(np.einsum("ij,ij->i", left, right), pairs.is_same),
    )


# --------------------------------------------------------------------------------------------
# Aligned crops for training and export
# --------------------------------------------------------------------------------------------


def aligned_lfw_crops(
    data_dir: str | Path,
    pairs_per_fold: int | None = None,
    *,
    landmarks: str = "file",
    workers: int = 2,
    progress: bool = False,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    template: Any = None,
) -> tuple[np.ndarray, list[str], LFWPairs]:
    """Every image of the LFW pairs, aligned onto the SphereFace template (or ``template``, a
    :class:`models.align.AlignmentTemplate`), without a model.

    The crops of :func:`run_lfw_evaluation` for the trainer's periodic LFW check, which embeds
    them with the network being trained.

    Args:
        landmarks: ``"file"``: ``landmarks.txt``; ``"detect"``: our MTCNN, exactly as the
            evaluation's detect mode and ``sphereface prepare`` (which aligns the training data)
            place them, through :func:`detected_lfw_landmarks` and its cache in ``cache_dir``.
            The two sources differ by about 1 px (docs/results/face-path.md): compare a model on crops
            from the source it was trained on.
        providers: execution providers of the detector (detect mode; part of the cache key).

    Returns:
        ``crops`` ``(n_images, 112, 96, 3)`` (the template's size) uint8 RGB, ``names`` (sorted,
        relative to images/) and the pairs (subset to ``pairs_per_fold`` when given).

    Raises:
        ValueError: ``landmarks`` is not one of :data:`LANDMARK_MODES`.
    """
    from models.align import SPHEREFACE_TEMPLATE_112x96, align_face
    from models.image import read_image

    if landmarks not in LANDMARK_MODES:
        raise ValueError(f"landmarks must be one of {LANDMARK_MODES}, got {landmarks!r}")
    data_dir = Path(data_dir)
    pairs = load_pairs(data_dir, pairs_per_fold)
    names = pairs.images()
    if landmarks == "file":
        reference = read_landmarks(data_dir / LANDMARKS_FILE)
        missing = [n for n in names if n not in reference]
        if missing:
            raise LFWDataError(
                f"{data_dir / LANDMARKS_FILE} has no landmarks for {len(missing)} images, e.g. {missing[0]}"
            )
    else:
        points, _, _ = detected_lfw_landmarks(
            data_dir, names, cache_dir=cache_dir, providers=providers, workers=workers, progress=progress
        )
        reference = dict(zip(names, points, strict=True))
    template = SPHEREFACE_TEMPLATE_112x96 if template is None else template

    def work(name: str) -> np.ndarray:
        return align_face(read_image(data_dir / IMAGES_DIR / name), reference[name], template)

    crops = np.empty((len(names), template.height, template.width, 3), dtype=np.uint8)
    stream = ordered_map(work, names, workers, window=256)
    for i, crop in enumerate(progress_bar(stream, len(names), "LFW crops", progress)):
        crops[i] = crop
    return crops, names, pairs
