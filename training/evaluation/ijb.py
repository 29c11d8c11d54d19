"""``sphereface evaluate ijb``: IJB-B and IJB-C 1:1 template verification, as insightface runs it
(its ``recognition/_evaluation_/ijb`` code; the meta files are the ones it distributes).

The folder (``--data``) holds ``loose_crop/`` (the face images) and ``meta/`` with, for protocol
``IJBC`` (``ijbb_`` for ``IJBB``), space-separated text files:

* ``ijbc_name_5pts_score.txt``: ``image x1 y1 ... x5 y5 faceness``, one line per face: five
  landmarks in the loose crop's pixels (left eye, right eye, nose, left and right mouth corner) and
  the detector's faceness score;
* ``ijbc_face_tid_mid.txt``: ``image template_id media_id``, line for line the same faces;
* ``ijbc_template_pair_label.txt``: ``template_id template_id label`` (1: the same person).

The protocol:

1. each face aligned onto the model's template with its landmarks, embedded with its mirror, and
   the two outputs summed (insightface's flip test "F2"), not normalised (its norm is kept);
2. multiplied by its faceness score;
3. averaged over the faces of each media (the frames of one video, or one still) of a template;
4. summed over the template's medias, then L2-normalised;
5. a pair's score is the cosine of its two templates;
6. the true-accept rate at false-accept rates 1e-6 ... 1e-1 over all pairs.

Step 6 is reported twice: ``tar_at_far`` at a false-accept rate of at most the target
(:func:`training.evaluation.verification.tar_at_far`, the project's rule everywhere), and
``tar_at_far_insightface``, insightface's table: the ROC point whose false-accept rate is nearest
the target, the highest true-accept rate among equally near ones (it may lie above the target).

The per-face features are cached (:class:`training.evaluation.cache.RowCache`, per model, per
set), so a stopped run resumes and a second one only scores.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.errors import VerificationSetError
from training.evaluation.report import write_json
from training.evaluation.verification import far_label, roc_curve, unit_rows

log = logging.getLogger(__name__)

PROTOCOLS = ("IJBB", "IJBC")
#: The false-accept rates of the IJB 1:1 table.
IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
CROPS_DIR = "loose_crop"
META_DIR = "meta"


def meta_files(root: Path, protocol: str) -> dict[str, Path]:
    """The three meta files of ``protocol`` under ``root/meta``."""
    prefix = protocol.lower()
    meta = root / META_DIR
    return {
        "points": meta / f"{prefix}_name_5pts_score.txt",
        "templates": meta / f"{prefix}_face_tid_mid.txt",
        "pairs": meta / f"{prefix}_template_pair_label.txt",
    }


def find_root(data: str | Path, protocol: str) -> Path:
    """The protocol's folder: ``data`` itself when it holds ``meta/``, else ``data/<protocol>``.

    Raises:
        VerificationSetError: an unknown protocol, or no folder with its meta files.
    """
    if protocol not in PROTOCOLS:
        raise VerificationSetError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    data = Path(data)
    for root in (data, data / protocol):
        if meta_files(root, protocol)["points"].is_file():
            return root
    raise VerificationSetError(
        f"{data} holds no {META_DIR}/{meta_files(data, protocol)['points'].name} (nor does {data / protocol})"
    )


def _lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise VerificationSetError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows = [line.split() for line in text.splitlines()]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise VerificationSetError(f"{path} is empty")
    return rows


def _bad_line(path: Path, rows: list[list[str]], fields: int, parse: Any) -> int | None:
    """The 1-based number of the first line without ``fields`` fields that ``parse`` reads."""
    for k, row in enumerate(rows):
        try:
            if len(row) != fields:
                return k + 1
            parse(row)
        except ValueError:
            return k + 1
    return None


def read_points(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``*_name_5pts_score.txt``: image names, ``(n, 5, 2)`` landmarks and ``(n,)`` faceness."""
    rows = _lines(path)
    bad = _bad_line(path, rows, 12, lambda row: [float(v) for v in row[1:]])
    if bad is not None:
        raise VerificationSetError(
            f"{path}:{bad}: expected 'image x1 y1 ... x5 y5 faceness' (12 fields), "
            f"got {' '.join(rows[bad - 1])!r}"
        )
    values = np.array([[float(v) for v in row[1:]] for row in rows], dtype=np.float64)
    if not np.isfinite(values).all():
        raise VerificationSetError(f"{path}: landmarks and scores must be finite numbers")
    return [row[0] for row in rows], values[:, :10].reshape(-1, 5, 2), values[:, 10]


def read_template_media(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``*_face_tid_mid.txt``: image names, ``(n,)`` template ids and ``(n,)`` media ids."""
    rows = _lines(path)
    bad = _bad_line(path, rows, 3, lambda row: (int(row[1]), int(row[2])))
    if bad is not None:
        raise VerificationSetError(
            f"{path}:{bad}: expected 'image template_id media_id', got {' '.join(rows[bad - 1])!r}"
        )
    ids = np.array([(int(row[1]), int(row[2])) for row in rows], dtype=np.int64)
    return [row[0] for row in rows], ids[:, 0], ids[:, 1]


def read_template_pairs(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``*_template_pair_label.txt``: ``(m,)`` first and second template ids and bool labels.

    Read as one block of integers (IJB-C has 15.7 million lines); a malformed line is named."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise VerificationSetError(f"cannot read {path}: {exc}") from None
    text = text.rstrip()
    n_lines = text.count("\n") + 1 if text else 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            values = np.fromstring(text, dtype=np.int64, sep=" ")
    except (ValueError, DeprecationWarning):
        values = np.zeros(0, dtype=np.int64)
    if values.size != 3 * n_lines or n_lines == 0:
        rows = _lines(path)
        bad = _bad_line(path, rows, 3, lambda row: [int(v) for v in row])
        raise VerificationSetError(
            f"{path}:{bad or n_lines}: expected 'template_id template_id label' on every line"
        )
    values = values.reshape(-1, 3)
    if not np.isin(values[:, 2], (0, 1)).all():
        raise VerificationSetError(f"{path}: labels must be 0 or 1")
    return values[:, 0], values[:, 1], values[:, 2] == 1


@dataclass
class IJBMeta:
    """A protocol's faces (one row per line of the meta files) and template pairs."""

    protocol: str
    root: Path
    names: list[str]
    landmarks: np.ndarray
    faceness: np.ndarray
    templates: np.ndarray
    medias: np.ndarray
    first: np.ndarray
    second: np.ndarray
    is_same: np.ndarray

    def image_path(self, i: int) -> Path:
        return self.root / CROPS_DIR / self.names[i]


def load_ijb(data: str | Path, protocol: str) -> IJBMeta:
    """Read and cross-check a protocol's meta files.

    Raises:
        VerificationSetError: a file is missing or malformed, the two face files disagree line for
            line, or a pair names a template without faces (the message names the file and line).
    """
    root = find_root(data, protocol)
    files = meta_files(root, protocol)
    names, landmarks, faceness = read_points(files["points"])
    names_t, templates, medias = read_template_media(files["templates"])
    if len(names_t) != len(names):
        raise VerificationSetError(
            f"{files['templates']} has {len(names_t)} faces, {files['points']} has {len(names)}"
        )
    differ = next((k for k, (a, b) in enumerate(zip(names, names_t, strict=True)) if a != b), None)
    if differ is not None:
        raise VerificationSetError(
            f"{files['templates']}:{differ + 1} names {names_t[differ]}, {files['points']}:{differ + 1} "
            f"names {names[differ]}: the two files list the faces line for line"
        )
    first, second, is_same = read_template_pairs(files["pairs"])
    unknown = np.setdiff1d(np.union1d(first, second), templates)
    if unknown.size:
        raise VerificationSetError(
            f"{files['pairs']}: {unknown.size} templates have no faces in {files['templates'].name}, e.g. "
            + ", ".join(str(t) for t in unknown[:5])
        )
    return IJBMeta(protocol, root, names, landmarks, faceness, templates, medias, first, second, is_same)


# --------------------------------------------------------------------------------------------
# Templates and scores
# --------------------------------------------------------------------------------------------


def _group_sums(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Row sums of ``values`` per group label ``0..n_groups-1`` (one sort, no Python loop)."""
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], np.arange(n_groups))
    return np.add.reduceat(values[order], starts, axis=0)


def template_features(
    face_features: np.ndarray, faceness: np.ndarray, templates: np.ndarray, medias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 2 to 4 of the protocol: one L2-normalised feature per template.

    Args:
        face_features: ``(n, D)`` flip-summed features of the faces, not normalised.
        faceness: ``(n,)`` the faces' detector scores (weights).
        templates, medias: ``(n,)`` each face's template and media id.

    Returns:
        the sorted template ids ``(T,)`` and their ``(T, D)`` features.
    """
    # float32, as the features are cached: IJB-C's half a million faces x 512 floats stay under 1 GB
    weighted = np.asarray(face_features, dtype=np.float32) * np.asarray(faceness, dtype=np.float32)[:, None]
    keys = np.stack([templates, medias], axis=1)
    media_keys, media_of_face, faces_per_media = np.unique(
        keys, axis=0, return_inverse=True, return_counts=True
    )
    media_of_face = media_of_face.reshape(-1)
    media_means = _group_sums(weighted, media_of_face, len(media_keys)) / faces_per_media[:, None]
    template_ids, template_of_media = np.unique(media_keys[:, 0], return_inverse=True)
    summed = _group_sums(media_means, template_of_media.reshape(-1), len(template_ids))
    return template_ids, unit_rows(summed)


def pair_scores(
    template_ids: np.ndarray,
    features: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    chunk: int | None = None,
) -> np.ndarray:
    """Step 5: the cosine of every pair's two template features (``template_ids`` sorted), ``chunk``
    pairs at a time (default: as many as take about 256 MB of gathered features; IJB-C has 15.7
    million pairs)."""
    a = np.searchsorted(template_ids, first)
    b = np.searchsorted(template_ids, second)
    chunk = chunk or max(1, (1 << 25) // max(1, features.shape[1]))
    scores = np.empty(len(a), dtype=np.float64)
    for start in range(0, len(a), chunk):
        end = start + chunk
        scores[start:end] = np.einsum("ij,ij->i", features[a[start:end]], features[b[start:end]])
    return scores


def nearest_point_tar(far: np.ndarray, tar: np.ndarray, target: float) -> float:
    """insightface's reading of an ROC at ``target``: the point whose false-accept rate is nearest,
    the highest true-accept rate among equally near points."""
    gap = np.abs(far - target)
    return float(tar[gap == gap.min()].max())


def tar_table(scores: np.ndarray, is_same: np.ndarray, fars: Sequence[float] = IJB_FARS) -> dict[str, Any]:
    """Step 6: both readings of the true-accept rate at ``fars``, the thresholds, and the AUC."""
    curve = roc_curve(scores, is_same, fars)
    return {
        "tar_at_far": curve.tar_at_far,
        "threshold_at_far": curve.threshold_at_far,
        "tar_at_far_insightface": {far_label(f): nearest_point_tar(curve.far, curve.tar, f) for f in fars},
        "auc": curve.auc,
        "n_genuine": curve.n_same,
        "n_impostor": curve.n_different,
    }


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def embed_ijb_faces(
    meta: IJBMeta,
    embedder: Any,
    cache_folder: Path,
    cache_meta: dict[str, Any],
    *,
    workers: int = 2,
    progress: bool = False,
) -> np.ndarray:
    """Step 1 for every face: ``(n, D)`` flip-summed network outputs, from the row cache in
    ``cache_folder`` (what is not there yet is aligned, embedded and committed)."""
    from models.align import align_face, get_template
    from models.image import read_image
    from training.evaluation.cache import RowCache

    template = get_template(embedder.manifest.template)

    def crop(i: int) -> np.ndarray:
        return align_face(read_image(meta.image_path(i)), meta.landmarks[i], template)

    columns = {"summed": ((embedder.manifest.embedding_size,), np.float32)}
    with RowCache(cache_folder, cache_meta, len(meta.names), columns) as cache:

        def store(first: int, crops: list[np.ndarray]) -> None:
            batch = np.stack(crops)
            both = embedder.raw(np.concatenate([batch, batch[:, :, ::-1]]))
            cache["summed"][first : first + len(crops)] = both[: len(crops)] + both[len(crops) :]

        cache.fill(
            crop, store, batch_size=embedder.batch_size, workers=workers, desc=f"embed {meta.protocol}",
            progress=progress,
        )  # fmt: skip
        return np.asarray(cache["summed"])


def score_ijb(meta: IJBMeta, summed: np.ndarray) -> dict[str, Any]:
    """Steps 2 to 6 on the faces' flip-summed features: the report's numbers."""
    template_ids, features = template_features(summed, meta.faceness, meta.templates, meta.medias)
    scores = pair_scores(template_ids, features, meta.first, meta.second)
    return {
        "n_faces": len(meta.names),
        "n_medias": int(len(np.unique(np.stack([meta.templates, meta.medias], axis=1), axis=0))),
        "n_templates": len(template_ids),
        "n_pairs": len(scores),
        **tar_table(scores, meta.is_same),
    }


def _cache_meta(meta: IJBMeta, model_digest: str) -> dict[str, Any]:
    """What decides the cached features: the meta files' content, the images, and the model."""
    from training.evaluation.cache import file_sha256
    from training.evaluation.faces import FaceSet

    paths = [meta.image_path(i) for i in range(len(meta.names))]
    faces = FaceSet(meta.protocol, paths, list(meta.names))
    files = meta_files(meta.root, meta.protocol)
    return {
        "set": meta.protocol,
        "points": file_sha256(files["points"]),
        "images": faces.digest(),
        "model": model_digest,
        "features": "flip-summed network outputs",
    }


def run_ijb(
    model_dir: str | Path,
    data: str | Path,
    protocol: str,
    *,
    json_out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate a model folder on IJB-B or IJB-C 1:1; returns (and writes to ``json_out``) the report.

    Raises:
        VerificationSetError: the meta files or an image cannot be used.
    """
    from models.embedder import Embedder
    from training.evaluation.cache import ModelKey, default_cache_dir

    started, started_at = time.perf_counter(), datetime.now(UTC).isoformat(timespec="seconds")
    meta = load_ijb(data, protocol)
    loaded = time.perf_counter()
    embedder = Embedder(model_dir, providers, batch_size=batch_size)
    model = ModelKey.of(model_dir)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    summed = embed_ijb_faces(
        meta, embedder, folder / "features" / model.folder / f"ijb-{protocol.lower()}",
        _cache_meta(meta, model.digest), workers=workers, progress=progress,
    )  # fmt: skip
    embedded = time.perf_counter()
    report = {
        "benchmark": f"{protocol} 1:1 template verification",
        "protocol": "faces aligned with the meta file's landmarks, outputs of the face and its mirror "
        "summed, times the faceness score, averaged per media, summed per template, L2-normalised; "
        "cosine of the templates",
        "model_id": embedder.manifest.model_id,
        "provider": embedder.provider,
        "template": embedder.manifest.template,
        "data": str(meta.root),
        **score_ijb(meta, summed),
        "far_rules": {
            "tar_at_far": "false-accept rate at most the target (None: fewer than 1/target impostor pairs)",
            "tar_at_far_insightface": "the ROC point nearest the target (insightface's table)",
        },
        "started_at": started_at,
        "timing_s": {
            "total": time.perf_counter() - started,
            "meta": loaded - started,
            "faces": embedded - loaded,
            "scores": time.perf_counter() - embedded,
        },
    }
    if json_out is not None:
        write_json(json_out, report, indent=2)
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The report as a few lines of text."""
    lines = [
        f"{report['benchmark']}: model {report['model_id']} on {report['provider']}; {report['n_faces']} "
        f"faces, {report['n_templates']} templates, {report['n_genuine']} genuine / "
        f"{report['n_impostor']} impostor pairs; AUC {report['auc']:.5f}",
        "FAR        TAR (FAR <= target)  TAR (insightface: nearest ROC point)",
    ]
    for label, tar in report["tar_at_far"].items():
        strict = f"{100 * tar:.2f}%" if tar is not None else "not measurable"
        lines.append(f"{label:<10} {strict:<20} {100 * report['tar_at_far_insightface'][label]:.2f}%")
    return lines
