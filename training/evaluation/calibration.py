"""Cosine thresholds at false-accept rates a user can trust: every cross-identity pair of LFW.

LFW View 2 has 3,000 impostor pairs: FAR 1e-3 rests on 3 false accepts and FAR 1e-4 cannot be
measured at all. Here every photo of LFW (13,233 photos of 5,749 people) is embedded through the
service's own path (our MTCNN, the model's template, its flip fusion) and *every* pair is scored:
about 87.5 million impostor pairs (different people) and 242 thousand genuine pairs.

* The threshold for a FAR ``f`` is the cosine ``t`` with at most ``floor(f * n)`` impostor scores
  above it (:func:`~training.evaluation.verification.false_accepts_allowed`; the (k+1)-th highest
  impostor score), on
  all pairs: ``thresholds["verification"]`` at FAR 1e-3 and ``["identification"]`` at 1e-4.
* It is cross-validated over people: identities are split into 10 folds (seeded); each fold's
  threshold is chosen on the pairs among the other nine folds' people, and the false-accept and
  true-accept rates are measured on the pairs within the held-out fold (about 870 thousand
  impostor pairs each), so ``heldout_far`` says how far the FAR holds for people never seen.
* The TAR over all genuine pairs is dominated by the people with most photos (George W. Bush has
  530); ``tar_per_identity`` weights every person with 2+ photos equally.

Scores are computed in float32 in row blocks, keeping only the highest impostor scores, so memory
stays under a few hundred MB.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.cache import ModelKey, default_cache_dir, detect_landmarks, embed_faces
from training.evaluation.errors import LFWDataError
from training.evaluation.faces import FaceSet, load_face_set
from training.evaluation.lfw_files import IMAGES_DIR, LANDMARKS_FILE, read_landmarks, require_images
from training.evaluation.report import new_axes, save_figure
from training.evaluation.verification import false_accepts_allowed, far_label

log = logging.getLogger(__name__)

#: False-accept rates (per comparison) calibrated by default.
CALIBRATION_FARS = (1e-3, 1e-4, 1e-5, 1e-6)
CALIBRATION_SET = "lfw-all-pairs"
N_FOLDS = 10


@dataclass
class PairScores:
    """What :func:`score_all_pairs` keeps of every unordered pair of photos."""

    #: the highest impostor scores over all pairs (descending), with the folds of both photos
    top_impostor: np.ndarray
    top_folds: np.ndarray
    n_impostor: int
    #: every impostor score with both photos in the same fold, and that fold
    within_fold_impostor: np.ndarray
    within_fold: np.ndarray
    #: every genuine score, its fold and the identity index
    genuine: np.ndarray
    genuine_fold: np.ndarray
    genuine_identity: np.ndarray
    #: impostor pairs that touch no photo of fold k (the pairs fold k's threshold is chosen on)
    n_impostor_without_fold: np.ndarray


def identity_folds(identities: Sequence[str], n_folds: int = N_FOLDS, seed: int = 0) -> np.ndarray:
    """A fold in ``[0, n_folds)`` for each photo: identities shuffled (seeded), dealt round-robin."""
    names = sorted(set(identities))
    order = np.random.default_rng(seed).permutation(len(names))
    fold_of = {names[i]: rank % n_folds for rank, i in enumerate(order)}
    return np.array([fold_of[i] for i in identities], dtype=np.int16)


def _keep_top(values: np.ndarray, folds: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if len(values) <= k:
        return values, folds
    cut = np.argpartition(values, len(values) - k)[len(values) - k :]
    return values[cut], folds[cut]


def score_all_pairs(
    unit: np.ndarray,
    identities: Sequence[str],
    folds: np.ndarray,
    keep: int,
    block: int = 512,
    progress: bool = True,
) -> PairScores:
    """Score every unordered pair of rows of ``unit`` (L2-normalised features), keeping the
    ``keep`` highest impostor scores (with their fold pairs) and everything needed per fold."""
    from tqdm import tqdm

    unit = np.ascontiguousarray(unit, dtype=np.float32)
    names = sorted(set(identities))
    index = {n: i for i, n in enumerate(names)}
    ident = np.array([index[i] for i in identities], dtype=np.int32)
    n, n_folds = len(unit), int(folds.max()) + 1
    # Folds are stored as fi * n_folds + fj (fi <= fj) to filter the kept scores per fold later.
    top_v, top_f = np.empty(0, np.float32), np.empty(0, np.int16)
    within_v, within_f, gen_v, gen_f, gen_i = [], [], [], [], []
    n_imp = 0
    photos_per_fold = np.bincount(folds, minlength=n_folds)
    bar = tqdm(total=n, desc="all pairs", unit="photo", disable=not progress, dynamic_ncols=True)
    for start in range(0, n, block):
        stop = min(start + block, n)
        scores = unit[start:stop] @ unit.T
        rows, cols = np.triu_indices(stop - start, k=1, m=n - start)
        cols = cols + start
        rows = rows + start
        values = scores[rows - start, cols]
        same = ident[rows] == ident[cols]
        fi, fj = folds[rows], folds[cols]
        gen_v.append(values[same])
        gen_f.append(fi[same])
        gen_i.append(ident[rows][same])
        imp = ~same
        v, a, b = values[imp], fi[imp], fj[imp]
        n_imp += len(v)
        inside = a == b
        within_v.append(v[inside])
        within_f.append(a[inside])
        pair_fold = (np.minimum(a, b) * n_folds + np.maximum(a, b)).astype(np.int16)
        top_v, top_f = _keep_top(np.concatenate([top_v, v]), np.concatenate([top_f, pair_fold]), keep)
        bar.update(stop - start)
    bar.close()
    order = np.argsort(-top_v, kind="stable")
    # Impostor pairs that avoid fold k: all pairs among photos outside k minus the genuine ones.
    genuine_f = np.concatenate(gen_f)
    without = np.empty(n_folds, dtype=np.int64)
    for k in range(n_folds):
        m = n - int(photos_per_fold[k])
        without[k] = m * (m - 1) // 2 - int(np.count_nonzero(genuine_f != k))
    return PairScores(
        top_impostor=top_v[order],
        top_folds=top_f[order],
        n_impostor=n_imp,
        within_fold_impostor=np.concatenate(within_v),
        within_fold=np.concatenate(within_f),
        genuine=np.concatenate(gen_v),
        genuine_fold=genuine_f,
        genuine_identity=np.concatenate(gen_i),
        n_impostor_without_fold=without,
    )


def _threshold(top_desc: np.ndarray, n_total: int, far: float) -> float | None:
    """The (k+1)-th highest of ``n_total`` scores, k = floor(far * n_total), from the kept top."""
    allowed = false_accepts_allowed(far, n_total)
    if allowed is None:
        return None
    if allowed >= len(top_desc):
        raise ValueError(f"kept {len(top_desc)} scores, need {allowed + 1} for FAR {far:g}")
    return float(top_desc[allowed])


def _tar_per_identity(genuine: np.ndarray, identity: np.ndarray, threshold: float) -> float:
    accepted = np.bincount(identity, weights=(genuine > threshold).astype(np.float64))
    counts = np.bincount(identity)
    has = counts > 0
    return float(np.mean(accepted[has] / counts[has]))


def calibrate(scores: PairScores, fars: Sequence[float] = CALIBRATION_FARS, n_folds: int = N_FOLDS) -> dict:
    """Thresholds on all pairs and their cross-validated FAR/TAR (see the module docstring)."""
    out: dict[str, Any] = {}
    pair_a, pair_b = np.divmod(scores.top_folds, n_folds)
    for far in fars:
        threshold = _threshold(scores.top_impostor, scores.n_impostor, far)
        if threshold is None:
            out[far_label(far)] = None
            continue
        heldout_far, heldout_tar = [], []
        for k in range(n_folds):
            outside = (pair_a != k) & (pair_b != k)
            t = _threshold(scores.top_impostor[outside], int(scores.n_impostor_without_fold[k]), far)
            if t is None:
                continue
            imp = scores.within_fold_impostor[scores.within_fold == k]
            gen = scores.genuine[scores.genuine_fold == k]
            heldout_far.append(float(np.mean(imp > t)))
            heldout_tar.append(float(np.mean(gen > t)) if len(gen) else float("nan"))
        out[far_label(far)] = {
            "threshold": threshold,
            "false_accepts_allowed": false_accepts_allowed(far, scores.n_impostor),
            "tar": float(np.mean(scores.genuine > threshold)),
            "tar_per_identity": _tar_per_identity(scores.genuine, scores.genuine_identity, threshold),
            "heldout_far": float(np.mean(heldout_far)) if heldout_far else None,
            "heldout_far_range": [min(heldout_far), max(heldout_far)] if heldout_far else None,
            "heldout_tar": float(np.nanmean(heldout_tar)) if heldout_tar else None,
        }
    return out


def impostor_scores_to_keep(fars: Sequence[float], n_pairs: int) -> int:
    """How many top impostor scores to keep: twice the most any calibrated FAR needs."""
    return 2 * (max(false_accepts_allowed(f, n_pairs) or 0 for f in fars) + 1)


def run_calibration(
    model_dir: str | Path,
    lfw_dir: str | Path,
    *,
    landmarks: str = "detect",
    fars: Sequence[float] = CALIBRATION_FARS,
    cache_dir: str | Path | None = None,
    providers: str = "cpu",
    workers: int = 2,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Embed every LFW photo with the model (cached, resumable) and calibrate on all pairs.

    Args:
        landmarks: ``detect``: our MTCNN, face nearest the centre (what the service does);
            ``file``: ``landmarks.txt``.
    """
    started = time.perf_counter()
    lfw_dir = Path(lfw_dir)
    require_images(lfw_dir)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    faces = load_face_set(lfw_dir / IMAGES_DIR, "lfw-all", probes=True)
    points, found = _landmarks(faces, lfw_dir, landmarks, cache, providers, workers, progress)
    features, model_id = _embeddings(
        model_dir, faces, points, cache if landmarks == "detect" else cache / "file-landmarks",
        providers, workers, progress,
    )  # fmt: skip
    embedded = time.perf_counter()
    identities = faces.identities or []
    n = len(features)
    scores = score_all_pairs(
        features, identities, identity_folds(identities, seed=seed),
        keep=impostor_scores_to_keep(fars, n * (n - 1) // 2), progress=progress,
    )  # fmt: skip
    report = _report(scores, calibrate(scores, fars), lfw_dir, landmarks, model_id, identities, found, seed)
    report["timing_s"] = {"embedding": embedded - started, "total": time.perf_counter() - started}
    return report


def _landmarks(
    faces: FaceSet,
    lfw_dir: Path,
    landmarks: str,
    cache: Path,
    providers: str,
    workers: int,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 5, 2)`` landmarks of every photo and ``found`` flags: detected (cached), or from
    ``landmarks.txt`` (every photo counts as found)."""
    if landmarks == "detect":
        return detect_landmarks(faces, cache, providers=providers, workers=workers, progress=progress)
    if landmarks != "file":
        raise ValueError(f"landmarks must be 'detect' or 'file', not {landmarks!r}")
    table = read_landmarks(lfw_dir / LANDMARKS_FILE)
    missing = [k for k in faces.keys if k not in table]
    if missing:
        raise LFWDataError(
            f"{lfw_dir / LANDMARKS_FILE} has no landmarks for {len(missing)} photos, e.g. {missing[0]}"
        )
    return np.stack([table[k] for k in faces.keys]), np.ones(len(faces), dtype=bool)


def _embeddings(
    model_dir: str | Path,
    faces: FaceSet,
    points: np.ndarray,
    cache: Path,
    providers: str,
    workers: int,
    progress: bool,
) -> tuple[np.ndarray, str]:
    """The photos' L2-normalised fused embeddings (cached under ``cache``) and the model's id."""
    from models.embedder import Embedder

    model = ModelKey.of(model_dir)
    embedder = Embedder(model_dir, providers, batch_size=64, intra_op_threads=1 if workers > 1 else 0)
    features = embed_faces(faces, points, model, embedder, cache, workers=workers, progress=progress)
    return np.asarray(features), embedder.manifest.model_id


def _report(
    scores: PairScores,
    result: dict[str, Any],
    lfw_dir: Path,
    landmarks: str,
    model_id: str,
    identities: Sequence[str],
    found: np.ndarray,
    seed: int,
) -> dict[str, Any]:
    """The calibration report without its timing: the set, the pair counts and the thresholds."""
    n, n_people = len(identities), len(set(identities))
    return {
        "set": CALIBRATION_SET,
        "description": (
            f"every pair of LFW's {n:,} photos of {n_people:,} people ({lfw_dir}), "
            f"landmarks={landmarks}: {scores.n_impostor:,} impostor and "
            f"{len(scores.genuine):,} genuine pairs; "
            f"cosine of L2-normalised fused embeddings; cross-validated over {N_FOLDS} folds of people"
        ),
        "model_id": model_id,
        "landmarks": landmarks,
        "photos": n,
        "people": n_people,
        "no_face_photos": int(np.count_nonzero(~np.asarray(found))),
        "n_impostor": scores.n_impostor,
        "n_genuine": int(len(scores.genuine)),
        "folds": N_FOLDS,
        "seed": seed,
        "fars": result,
        "histogram": score_histograms(scores),
    }


def score_histograms(scores: PairScores, bins: int = 200) -> dict[str, Any]:
    """Genuine and within-fold impostor score histograms over the range the scores cover."""
    low = float(min(scores.genuine.min(), scores.within_fold_impostor.min()))
    high = float(max(scores.genuine.max(), scores.within_fold_impostor.max()))
    edges = np.linspace(low, high, bins + 1)
    return {
        "edges": edges.round(5).tolist(),
        "genuine": np.histogram(scores.genuine, edges)[0].tolist(),
        "impostor_within_folds": np.histogram(scores.within_fold_impostor, edges)[0].tolist(),
    }


def plot_calibration(report: dict[str, Any], path: str | Path) -> Path:
    """Genuine and impostor score densities (log scale, so the tails where the thresholds sit
    show) with the calibrated thresholds (PNG)."""
    hist = report["histogram"]
    edges = np.asarray(hist["edges"])
    centres = (edges[:-1] + edges[1:]) / 2
    fig, ax = new_axes((8, 4.5))
    for key, label, colour in (
        ("genuine", f"genuine pairs ({report['n_genuine']:,})", "tab:green"),
        ("impostor_within_folds", "impostor pairs (within folds of people)", "tab:red"),
    ):
        counts = np.asarray(hist[key], dtype=np.float64)
        share = counts / max(counts.sum(), 1)
        ax.semilogy(centres[share > 0], share[share > 0], label=label, color=colour)
    styles = iter(("--", "-.", ":", (0, (1, 3))))
    for label, entry in report["fars"].items():
        if entry:
            ax.axvline(
                entry["threshold"], color="0.25", linestyle=next(styles, ":"), linewidth=1,
                label=f"FAR {label}: cosine {entry['threshold']:.4f}, TAR {100 * entry['tar']:.1f}%",
            )  # fmt: skip
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("share of pairs (log)")
    ax.set_title(f"{report['model_id']}: LFW, every pair of {report['photos']:,} photos")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, path, dpi=110)


def write_calibration(
    model_dir: str | Path,
    report: dict[str, Any],
    verification_far: float = 1e-3,
    identification_far: float = 1e-4,
) -> Any:
    """Store the thresholds in the manifest: ``far_<rate>`` for each calibrated FAR, and the
    ``verification`` and ``identification`` roles; ``manifest.calibration`` records the set."""
    from models.manifest import Threshold, load_manifest_data, save_manifest

    manifest = load_manifest_data(model_dir)
    source = f"{report['set']}: {report['description']}"
    manifest.thresholds = {k: v for k, v in manifest.thresholds.items() if not k.startswith("far_")}
    for label, entry in report["fars"].items():
        if entry is not None:
            manifest.thresholds[f"far_{label}"] = Threshold(float(entry["threshold"]), float(label), source)
    for role, far in (("verification", verification_far), ("identification", identification_far)):
        chosen = manifest.thresholds.get(f"far_{far_label(far)}")
        if chosen is None:
            raise LFWDataError(f"FAR {far:g} was not calibrated ({report['n_impostor']:,} impostor pairs)")
        manifest.thresholds[role] = chosen
    manifest.calibration = {
        "set": report["set"],
        "landmarks": report["landmarks"],
        "photos": report["photos"],
        "n_impostor": report["n_impostor"],
        "n_genuine": report["n_genuine"],
        "fars": {
            label: {
                k: entry[k] for k in ("threshold", "tar", "tar_per_identity", "heldout_far", "heldout_tar")
            }
            for label, entry in report["fars"].items()
            if entry
        },
    }
    save_manifest(model_dir, manifest)
    return manifest
