"""``sphereface evaluate bin``: a model on insightface's ``.bin`` verification sets
(:mod:`training.evaluation.bin_sets`), scored three ways on the same contiguous 10 folds.

* ``cosine_protocol``: the cosine the service computes (the model's flip fusion, L2-normalised),
  with the threshold rule of SphereFace's ``evaluation.m`` (thesis §2.3.6, "Testing");
* ``insightface_protocol``: insightface's scoring of these sets: the network's outputs for the face
  and its mirror summed, L2-normalised, the squared L2 distance, each fold's threshold the first of
  ``0, 0.01, ..., 3.99`` with the best training accuracy
  (:func:`training.evaluation.verification.insightface_10fold_accuracy`);
* ``sphereface_protocol``: SphereFace's own protocol (training folds' mean subtracted), the number
  ``sphereface evaluate lfw`` leads with;

and the ROC of the two scores over all pairs, with the true-accept rate at a false-accept rate of
at most 1e-3 (and 1e-2, 1e-1).

Each face is cut to the model's template from the ArcFace 112x112 face
(:func:`models.arcface_crop.crop_from_arcface`: the SphereFace 112x96 crop exactly, any other
template re-warped, with the black padding its report states). The trainer's check of the sets a
config names scores the network being trained with :func:`score_pairs` too.
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

from training.evaluation.bin_sets import VerificationBin, decode_face, read_bin
from training.evaluation.parallel import ordered_map, progress_bar
from training.evaluation.report import write_json
from training.evaluation.verification import (
    RocCurve,
    TenFoldResult,
    contiguous_folds,
    insightface_10fold_accuracy,
    lfw_10fold_accuracy,
    roc_curve,
    unit_rows,
)

log = logging.getLogger(__name__)

#: The false-accept rate every report leads with.
HEADLINE_FAR = "1e-03"


@dataclass
class PairScores:
    """A set's pairs scored three ways on one set of folds."""

    cosine: TenFoldResult
    insightface: TenFoldResult
    sphereface: TenFoldResult
    roc_cosine: RocCurve
    roc_insightface: RocCurve

    def to_dict(self) -> dict[str, Any]:
        return {
            "cosine_protocol": {
                "what": "the service's cosine (the model's flip fusion, L2-normalised); threshold: mean "
                "of all grid values (-10000:10000)/10000 with the best training accuracy",
                **self.cosine.to_dict(),
            },
            "insightface_protocol": {
                "what": "insightface's scoring: outputs of the face and its mirror summed, L2-normalised, "
                "squared L2 distance; threshold: the first of 0, 0.01, ..., 3.99 with the best training "
                "accuracy (thresholds here are minus those distances)",
                **self.insightface.to_dict(),
            },
            "sphereface_protocol": {
                "what": "SphereFace's evaluation.m: fused features, training folds' mean subtracted, "
                "L2-normalised, dot product (the protocol `sphereface evaluate lfw` leads with)",
                **self.sphereface.to_dict(),
            },
            "roc_cosine": self.roc_cosine.to_dict(),
            "roc_insightface": {
                **self.roc_insightface.to_dict(),
                "scores": "minus the squared L2 distance of the L2-normalised flip-summed features",
            },
        }


def score_pairs(
    fused: np.ndarray, summed: np.ndarray, is_same: np.ndarray, folds: np.ndarray | None = None
) -> PairScores:
    """Score a set's pairs: row ``2i`` and ``2i + 1`` of each feature array are pair ``i``.

    Args:
        fused: ``(2P, F)`` the model's flip-fused features, not normalised.
        summed: ``(2P, D)`` the network's outputs for each face plus those for its mirror.
        is_same: ``(P,)`` bool.
        folds: ``(P,)`` fold labels (default: 10 contiguous folds, insightface's).
    """
    is_same = np.asarray(is_same, dtype=bool)
    folds = contiguous_folds(len(is_same)) if folds is None else np.asarray(folds)
    left, right = fused[0::2].astype(np.float64), fused[1::2].astype(np.float64)
    cosine = np.einsum("ij,ij->i", unit_rows(left), unit_rows(right))
    sum_left, sum_right = (
        unit_rows(summed[0::2].astype(np.float64)),
        unit_rows(summed[1::2].astype(np.float64)),
    )
    closeness = -np.sum(np.square(sum_left - sum_right), axis=1)
    return PairScores(
        cosine=lfw_10fold_accuracy(left, right, is_same, folds, subtract_mean=False),
        insightface=insightface_10fold_accuracy(summed[0::2], summed[1::2], is_same, folds),
        sphereface=lfw_10fold_accuracy(left, right, is_same, folds),
        roc_cosine=roc_curve(cosine, is_same),
        roc_insightface=roc_curve(closeness, is_same),
    )


@dataclass
class BinEvaluation:
    """One model on one ``.bin`` set; ``to_dict`` is its entry in the JSON report."""

    name: str
    path: str
    n_pairs: int
    scores: PairScores
    timing: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "n_pairs": self.n_pairs,
            "n_images": 2 * self.n_pairs,
            "folds": "10 contiguous folds in file order (insightface's)",
            "std_ddof": 1,
            **self.scores.to_dict(),
            "timing_s": self.timing,
        }

    def summary(self) -> str:
        s = self.scores

        def line(label: str, result: TenFoldResult, roc: RocCurve | None) -> str:
            tar = roc.tar_at_far.get(HEADLINE_FAR) if roc is not None else None
            at_far = f"; TAR {100 * tar:.2f}% @ FAR {HEADLINE_FAR}" if tar is not None else ""
            return f"  {label:<22} {100 * result.accuracy:6.2f}% ± {100 * result.std:.2f}%{at_far}"

        return "\n".join(
            [
                f"{self.name} ({self.n_pairs} pairs, {self.path}): 10-fold accuracy",
                line("service cosine", s.cosine, s.roc_cosine),
                line("insightface scoring", s.insightface, s.roc_insightface),
                line("SphereFace protocol", s.sphereface, None),
                f"  took {self.timing['total']:.1f} s ({self.timing['images_per_s']:.1f} images/s)",
            ]
        )


@dataclass
class _Features:
    fused: np.ndarray
    summed: np.ndarray
    embed_seconds: float = 0.0


def embed_bin(
    embedder: Any, verification_set: VerificationBin, *, workers: int = 2, progress: bool = False
) -> _Features:
    """Every face of the set decoded and cut to the model's template on ``workers`` threads while
    this one embeds them (with their mirrors) in the embedder's batches."""
    from models.align import get_template
    from models.arcface_crop import crop_from_arcface

    template = get_template(embedder.manifest.template)
    n, source = len(verification_set.images), verification_set.name

    def work(index: int) -> np.ndarray:
        return crop_from_arcface(decode_face(verification_set.images[index], index, source), template)

    features: _Features | None = None
    batch: list[np.ndarray] = []
    stream = ordered_map(work, range(n), workers, window=2 * embedder.batch_size)
    for i, crop in enumerate(progress_bar(stream, n, source, progress)):
        batch.append(crop)
        if len(batch) == embedder.batch_size or i == n - 1:
            crops = np.stack(batch)
            started = time.perf_counter()
            both = embedder.raw(np.concatenate([crops, crops[:, :, ::-1]]))
            original, mirrored = both[: len(crops)], both[len(crops) :]
            fused = embedder.fuse(original, mirrored)
            if features is None:
                features = _Features(
                    np.empty((n, fused.shape[1]), np.float32), np.empty((n, original.shape[1]), np.float32)
                )
            features.fused[i + 1 - len(crops) : i + 1] = fused
            features.summed[i + 1 - len(crops) : i + 1] = original + mirrored
            features.embed_seconds += time.perf_counter() - started
            batch.clear()
    assert features is not None  # a set has at least 20 images
    return features


def evaluate_bin(
    embedder: Any, path: str | Path, *, workers: int = 2, progress: bool = False
) -> BinEvaluation:
    """One ``.bin`` set read, embedded and scored with ``embedder`` (:class:`models.embedder.Embedder`)."""
    started = time.perf_counter()
    verification_set = read_bin(path)
    loaded = time.perf_counter()
    features = embed_bin(embedder, verification_set, workers=workers, progress=progress)
    embedded = time.perf_counter()
    scores = score_pairs(features.fused, features.summed, verification_set.is_same)
    finished = time.perf_counter()
    timing = {
        "total": finished - started,
        "read": loaded - started,
        "images_and_embedding": embedded - loaded,
        "embedding": features.embed_seconds,
        "protocols_and_roc": finished - embedded,
        "images_per_s": len(verification_set.images) / max(embedded - loaded, 1e-9),
    }
    return BinEvaluation(verification_set.name, str(path), len(verification_set), scores, timing)


@dataclass
class BinReport:
    """A model on several sets: what ``evaluate bin --json`` writes."""

    model_id: str
    provider: str
    template: str
    padding_share: float
    evaluations: list[BinEvaluation]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "insightface .bin verification sets",
            "model_id": self.model_id,
            "provider": self.provider,
            "template": self.template,
            "crop": "the model's template cut from the ArcFace 112x112 face (models.arcface_crop); "
            f"{100 * self.padding_share:.1f}% of the crop lies outside the face and is black",
            "padding_share": self.padding_share,
            "sets": [e.to_dict() for e in self.evaluations],
            **self.extra,
        }


def run_bin_evaluation(
    model_dir: str | Path,
    paths: Sequence[str | Path],
    *,
    json_out: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> BinReport:
    """Evaluate a model folder on each ``.bin`` set of ``paths``; writes ``json_out`` when set.

    Raises:
        VerificationSetError: a set cannot be read (the message names the file and the image).
    """
    from models.align import get_template
    from models.arcface_crop import padding_share
    from models.embedder import Embedder

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    embedder = Embedder(model_dir, providers, batch_size=batch_size)
    manifest = embedder.manifest
    evaluations = []
    for path in paths:
        evaluations.append(evaluate_bin(embedder, path, workers=workers, progress=progress))
        log.debug("%s: %s", evaluations[-1].name, evaluations[-1].summary())
    report = BinReport(
        model_id=manifest.model_id,
        provider=embedder.provider,
        template=manifest.template,
        padding_share=padding_share(get_template(manifest.template)),
        evaluations=evaluations,
        extra={
            "started_at": started_at,
            "model_dir": str(model_dir),
            "flip_fusion": manifest.flip_fusion,
            "batch_size": batch_size,
            "workers": workers,
        },
    )
    if json_out is not None:
        write_json(json_out, report.to_dict(), indent=2)
    return report
