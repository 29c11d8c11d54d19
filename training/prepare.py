"""Training-data preparation: detect and align every photo of an identity-folder dataset ONCE.

The source is laid out like CASIA-WebFace: one sub-folder per identity, photos inside::

    src/<identity>/<photo>.jpg

or, as WebFace42M, folders of identity folders read as one set (:func:`identity_folders`)::

    src/<group>/<identity>/<photo>.jpg

Every photo is read (:func:`models.image.read_image`), its faces are found by MTCNN, the face
nearest the photo centre is kept (``select_faces(..., "central", ...)``) and aligned onto the
SphereFace template, giving one ``(112, 96, 3)`` uint8 RGB crop. Photos that cannot be read or
show no face are skipped and recorded with a reason.

The output folder holds packed arrays that training reads with ``np.load(mmap_mode="r")``::

    out/images_00000.npy   uint8 (n, 112, 96, 3) aligned crops, RGB
    out/labels_00000.npy   int32 (n,)            class of each crop (index into identities)
    out/meta_00000.json    per shard: photo range, kept source paths in row order, skipped photos
    ...
    out/manifest.json      written last: identities, counts, shards, skipped photos, settings

The photo list (sorted identities, sorted photos) is cut into fixed shards of ``shard_size``
photos, in order. A shard is written to temporary names and moved into place with
``os.replace``, its meta file last, so a killed run leaves no half shard that looks complete; a
re-run redoes only the shards without a meta file. Labels are contiguous ``0..C-1`` over the
identities that kept at least one face (they are re-mapped when an identity loses all its
photos), and the manifest says which identity each label is.

:func:`load_training_set` combines several prepared folders into one training set, merging
identities by folder name and keeping those with at least ``min_photos`` faces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import SphereFaceError
from training.align_workers import DEFAULT_MIN_FACE_SIZE, FACE_POLICY, TEMPLATE, aligned_results
from training.worker_pool import WorkerDied, died_in_shards

log = logging.getLogger(__name__)

FORMAT_NAME = "sphereface_prepared"
FORMAT_VERSION = 1
TRAINING_SET_KIND = "training_set"
MANIFEST_FILE = "manifest.json"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
IMAGE_SHAPE = (TEMPLATE.height, TEMPLATE.width, 3)
DEFAULT_SHARD_SIZE = 8192

_SHARD_FILES = ("images_{:05d}.npy", "labels_{:05d}.npy", "meta_{:05d}.json")
_META_RE = re.compile(r"^meta_(\d{5,})\.json$")


class DatasetError(SphereFaceError):
    """The source folder or a prepared folder is missing, empty or malformed."""

    code = "dataset_error"


class DatasetMismatchError(DatasetError):
    """An output folder already holds shards prepared from another photo list or other settings."""

    code = "dataset_mismatch"


# --------------------------------------------------------------------------------------------
# The prepared dataset
# --------------------------------------------------------------------------------------------


class PreparedDataset:
    """A prepared folder, loaded.

    Attributes:
        path: the folder (for a combined training set: its first source folder).
        manifest: ``manifest.json`` as a dict (for a combined training set: a synthesized dict
            with ``"kind": "training_set"``, see :func:`load_training_set`).
        identities: kept identity names; label ``i`` is ``identities[i]``.
        num_classes: ``len(identities)``.
        num_images: number of aligned crops over all shards.
        shards: one ``(images, labels)`` pair per shard: images ``(n, 112, 96, 3)`` uint8 (a
            read-only memmap when loaded with ``mmap=True``), labels ``(n,)`` int64.
        last_run: what the call that returned this object did (``photos_processed``,
            ``shards_written``, ``shards_reused``, ``seconds``); None from :func:`load_prepared`.
    """

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        shards: list[tuple[np.ndarray, np.ndarray]],
        last_run: dict[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.identities: list[str] = list(manifest["identities"])
        self.num_classes = int(manifest["num_classes"])
        self.num_images = int(manifest["num_images"])
        self.shards = shards
        self.last_run = last_run

    def __len__(self) -> int:
        return self.num_images

    def __repr__(self) -> str:
        return (
            f"PreparedDataset({str(self.path)!r}, num_images={self.num_images}, "
            f"num_classes={self.num_classes}, shards={len(self.shards)})"
        )

    def concatenate(self) -> tuple[np.ndarray, np.ndarray]:
        """All crops in one array: images ``(N, 112, 96, 3)`` uint8 (contiguous, in memory) and
        labels ``(N,)`` int64, in shard order."""
        images = np.empty((self.num_images, *IMAGE_SHAPE), dtype=np.uint8)
        labels = np.empty(self.num_images, dtype=np.int64)
        at = 0
        for shard_images, shard_labels in self.shards:
            n = len(shard_labels)
            images[at : at + n] = shard_images
            labels[at : at + n] = shard_labels
            at += n
        return images, labels

    def summary(self) -> str:
        """One paragraph for people: images kept, classes, skipped photos by reason, time."""
        return summary(self.manifest)


def summary(manifest: dict[str, Any]) -> str:
    """A one-paragraph human description of a prepared folder's manifest, or of the synthesized
    manifest of a training set from :func:`load_training_set`."""
    if manifest.get("kind") == TRAINING_SET_KIND:
        return _training_set_summary(manifest)
    skipped = manifest.get("skipped_by_reason", {})
    n_skipped = sum(skipped.values())
    if skipped:
        reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(skipped.items()))
        skipped_text = f"skipped {n_skipped:,} ({reasons})"
    else:
        skipped_text = "skipped none"
    dropped = manifest.get("dropped_identities", [])
    excluded = manifest.get("excluded_identities", [])
    extras = []
    if excluded:
        extras.append(f"{len(excluded):,} identities excluded by request")
    if dropped:
        extras.append(f"{len(dropped):,} identities dropped for lack of any face")
    extra_text = ("; " + "; ".join(extras)) if extras else ""
    seconds = float(manifest.get("elapsed_seconds", 0.0))
    processed = int(manifest.get("photos_processed", 0))
    rate = f", {processed / seconds:.1f} photos/s" if seconds > 0 and processed else ""
    height, width = manifest["image_shape"][:2]
    return (
        f"Prepared {manifest['num_images']:,} aligned {height}x{width} faces of "
        f"{manifest['num_classes']:,} classes from {manifest['num_photos']:,} photos of "
        f"{manifest['source']} ({manifest['template']}, face policy {manifest['detector']['face_policy']}); "
        f"{skipped_text}{extra_text}; {len(manifest['shards'])} shard(s); the last run processed "
        f"{processed:,} photos in {seconds:.1f} s{rate} with {manifest['detector']['workers']} worker(s)."
    )


def load_prepared(path: str | Path, mmap: bool = True) -> PreparedDataset:
    """Open a folder made by :func:`prepare_dataset`.

    Args:
        path: the output folder.
        mmap: memory-map the image shards read-only (default) instead of reading them.

    Raises:
        DatasetError: no ``manifest.json`` (the preparation never finished), or a shard file is
            missing or disagrees with the manifest.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise DatasetError(
            f"{path} has no {MANIFEST_FILE}: it is not a prepared dataset or its preparation did not "
            "finish; run `sphereface prepare` first"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {manifest_path}: {exc}") from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{manifest_path} is format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r}; expected {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    shards = []
    for entry in manifest["shards"]:
        images = _load_npy(path / entry["images"], mmap)
        labels = _load_npy(path / entry["labels"], False)
        count = int(entry["count"])
        if images.shape != (count, *IMAGE_SHAPE) or images.dtype != np.uint8 or labels.shape != (count,):
            raise DatasetError(
                f"shard {entry['images']} of {path} holds images {images.shape} {images.dtype} and labels "
                f"{labels.shape}; the manifest says {count} crops of {IMAGE_SHAPE} uint8"
            )
        shards.append((images, labels.astype(np.int64)))
    total = sum(len(labels) for _, labels in shards)
    if total != int(manifest["num_images"]):
        raise DatasetError(
            f"{path}: the shards hold {total} crops, the manifest says {manifest['num_images']}"
        )
    return PreparedDataset(path, manifest, shards)


def _load_npy(path: Path, mmap: bool) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; prepare the dataset again") from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Training on several prepared folders
# --------------------------------------------------------------------------------------------


def load_training_set(paths: str | Path | Sequence[str | Path], min_photos: int = 1) -> PreparedDataset:
    """One training set from one or more prepared folders, keeping identities with enough faces.

    Identities are merged by folder name across the sources: the same name in two folders is one
    person and one class (the CelebA folders share identity numbers). Identities with fewer than
    ``min_photos`` aligned faces, counted over all sources, are dropped. Labels are re-numbered
    ``0..C-1`` over the kept identities in sorted name order (the order :func:`prepare_dataset`
    uses), so ``identities[i]`` names label ``i``.

    Shards are taken in source order, then shard order. A shard whose rows are all kept keeps its
    memory-mapped images (only its labels, a small in-memory int64 array, are re-mapped); a shard
    that lost rows is read into memory with only the kept rows; a shard left with no rows is
    omitted.

    With a single path and ``min_photos=1`` this is exactly :func:`load_prepared` (the folder's own
    manifest, shards and labels). Otherwise the result's ``manifest`` is synthesized (``"kind":
    "training_set"``): ``sources`` (per folder: path, photo source, num_images, num_classes and
    how many of each were kept), ``min_photos``, ``num_images``, ``num_classes``, ``identities``,
    ``identity_counts``, ``dropped_identities_min_photos`` (a count), ``dropped_images_min_photos``,
    ``merged_identities`` (kept names found in more than one source) and ``shards`` (per kept
    shard: source index, shard index, count, whether it was read into memory). ``path`` is the
    first source folder; ``last_run`` is None.

    Args:
        paths: a prepared folder, or a sequence of them (each given once).
        min_photos: the fewest faces an identity needs to be kept (at least 1).

    Raises:
        DatasetError: no paths, a path given twice, a path that is not a complete prepared folder
            (the errors of :func:`load_prepared`), sources prepared with different templates,
            ``min_photos`` below 1 or not an integer, or no identity with ``min_photos`` faces.
    """
    paths = _as_paths(paths)
    if isinstance(min_photos, bool) or not isinstance(min_photos, numbers.Integral):
        raise DatasetError(f"min_photos must be a whole number of photos, got {min_photos!r}")
    min_photos = int(min_photos)
    if min_photos < 1:
        raise DatasetError(f"min_photos must be at least 1, got {min_photos}")
    _check_given_once(paths)
    if len(paths) == 1 and min_photos == 1:
        return load_prepared(paths[0])

    sources = [load_prepared(path) for path in paths]
    templates = [f"{source.path}: {source.manifest.get('template')}" for source in sources]
    if len({source.manifest.get("template") for source in sources}) > 1:
        raise DatasetError(
            f"the prepared folders were aligned to different templates ({', '.join(templates)}); "
            "prepare them alike"
        )
    totals, in_sources = _face_counts(sources)
    kept = sorted(name for name, count in totals.items() if count >= min_photos)
    if not kept:
        raise DatasetError(_nothing_left_message(paths, totals, min_photos))
    shards, shard_entries, source_entries = _kept_shards(sources, {name: i for i, name in enumerate(kept)})
    first = sources[0].manifest
    num_images = sum(len(labels) for _, labels in shards)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kind": TRAINING_SET_KIND,
        "sources": source_entries,
        "min_photos": min_photos,
        "template": first.get("template"),
        "image_shape": list(IMAGE_SHAPE),
        "image_dtype": "uint8",
        "label_dtype": "int64",
        "color": first.get("color", "RGB"),
        "num_images": num_images,
        "num_classes": len(kept),
        "identities": kept,
        "identity_counts": {name: totals[name] for name in kept},
        "dropped_identities_min_photos": len(totals) - len(kept),
        "dropped_images_min_photos": sum(totals.values()) - num_images,
        "merged_identities": [name for name in kept if in_sources[name] > 1],
        "shards": shard_entries,
    }
    return PreparedDataset(paths[0], manifest, shards)


def _as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [Path(p) for p in paths]
    if not out:
        raise DatasetError("no prepared folders given: pass at least one folder made by `sphereface prepare`")
    return out


def _check_given_once(paths: list[Path]) -> None:
    seen: dict[Path, Path] = {}
    for path in paths:
        resolved = path.resolve()
        if resolved in seen:
            raise DatasetError(
                f"the prepared folder {path} is given twice (also as {seen[resolved]}); its photos "
                "would count twice"
            )
        seen[resolved] = path


def _face_counts(sources: list[PreparedDataset]) -> tuple[Counter[str], Counter[str]]:
    """Faces per identity name over all sources, and in how many sources each name has faces
    (counted from the labels themselves)."""
    totals: Counter[str] = Counter()
    in_sources: Counter[str] = Counter()
    for source in sources:
        counts = np.zeros(source.num_classes, dtype=np.int64)
        for _, labels in source.shards:
            if len(labels) and (labels.min() < 0 or labels.max() >= source.num_classes):
                raise DatasetError(
                    f"{source.path} has labels outside 0..{source.num_classes - 1}; prepare it again"
                )
            counts += np.bincount(labels, minlength=source.num_classes)
        for name, count in zip(source.identities, counts.tolist(), strict=True):
            if count > 0:
                totals[name] += count
                in_sources[name] += 1
    return totals, in_sources


def _kept_shards(
    sources: list[PreparedDataset], label_of: dict[str, int]
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Every source's shards with the rows of the kept identities, re-labelled by ``label_of``, and
    the manifest entries of the kept shards and of the sources."""
    shards: list[tuple[np.ndarray, np.ndarray]] = []
    shard_entries: list[dict[str, Any]] = []
    source_entries: list[dict[str, Any]] = []
    for s, source in enumerate(sources):
        mapping = np.asarray([label_of.get(name, -1) for name in source.identities], dtype=np.int64)
        images_kept = 0
        for k, (images, labels) in enumerate(source.shards):
            new_labels = mapping[labels]
            keep = new_labels >= 0
            n = int(keep.sum())
            if n == 0:
                continue
            in_memory = n < len(labels)
            if in_memory:
                images = np.ascontiguousarray(images[keep])
                new_labels = new_labels[keep]
            shards.append((images, np.ascontiguousarray(new_labels, dtype=np.int64)))
            entry = source.manifest["shards"][k]
            shard_entries.append(
                {"source": s, "shard": k, "images": entry["images"], "count": n, "in_memory": in_memory}
            )
            images_kept += n
        source_entries.append(
            {
                "path": str(source.path.resolve()),
                "source": source.manifest.get("source"),
                "num_images": source.num_images,
                "num_classes": source.num_classes,
                "num_images_kept": images_kept,
                "num_classes_kept": sum(1 for name in source.identities if name in label_of),
            }
        )
    return shards, shard_entries, source_entries


def _nothing_left_message(paths: Sequence[Path], totals: Counter[str], min_photos: int) -> str:
    where = f"{paths[0]}" if len(paths) == 1 else f"the {len(paths)} prepared folders"
    if not totals:
        return f"{where} hold no aligned faces at all; nothing to train on"
    by_count = sorted(Counter(totals.values()).items(), reverse=True)
    shown = ", ".join(f"{n:,} with {count}" for count, n in by_count[:6])
    more = f", {sum(n for _, n in by_count[6:]):,} with fewer" if len(by_count) > 6 else ""
    return (
        f"no identity has {min_photos} or more faces in {where}: its {len(totals):,} identities have "
        f"at most {by_count[0][0]} faces each ({shown}{more}); lower min_photos"
    )


def _training_set_summary(manifest: dict[str, Any]) -> str:
    sources = manifest["sources"]
    parts = "; ".join(
        f"{entry['path']}: {entry['num_images_kept']:,} of {entry['num_images']:,} faces, "
        f"{entry['num_classes_kept']:,} of {entry['num_classes']:,} identities"
        for entry in sources
    )
    merged = len(manifest["merged_identities"])
    in_memory = sum(1 for entry in manifest["shards"] if entry["in_memory"])
    height, width = manifest["image_shape"][:2]
    return (
        f"Training set of {manifest['num_images']:,} aligned {height}x{width} faces of "
        f"{manifest['num_classes']:,} classes from {len(sources)} prepared folder(s) ({parts}); "
        f"identities merged across folders by name: {merged:,}; kept identities with at least "
        f"{manifest['min_photos']} face(s), dropping {manifest['dropped_identities_min_photos']:,} "
        f"identities ({manifest['dropped_images_min_photos']:,} faces); {len(manifest['shards'])} shard(s), "
        f"{in_memory} of them read into memory for the dropped rows."
    )


# --------------------------------------------------------------------------------------------
# Listing the source
# --------------------------------------------------------------------------------------------


def read_identity_list(path: str | Path) -> list[str]:
    """Identity names from a text file: one per line; blank lines and ``#`` comments ignored."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read the identity list {path}: {exc.strerror or exc}") from exc
    names = []
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return names


def _exclusion_set(exclude: Iterable[str] | str | Path | None) -> set[str]:
    if exclude is None:
        return set()
    if isinstance(exclude, (str, Path)):
        return set(read_identity_list(exclude))
    return {str(name).strip() for name in exclude if str(name).strip()}


def list_photos(
    src: str | Path,
    exclude_identities: Iterable[str] | str | Path | None = None,
    limit_identities: int | None = None,
) -> tuple[list[str], list[tuple[str, int]], list[str], list[str]]:
    """The photo list of an identity-folder dataset, in the order it is prepared.

    Returns:
        ``(identities, photos, excluded, exclusions_not_found)``: the listed identity folders
        (sorted, after exclusion and ``limit_identities``); ``(relative posix path, index into
        identities)`` per photo, by identity then file name; the identities dropped because they
        were excluded; excluded names with no folder in ``src``.

    Raises:
        DatasetError: ``src`` is not a folder, has no identity folders or no photos.
    """
    src = Path(src)
    if not src.is_dir():
        raise DatasetError(f"the source folder {src} does not exist or is not a folder")
    excluded_names = _exclusion_set(exclude_identities)
    if limit_identities is not None and limit_identities < 1:
        raise ValueError(f"limit_identities must be at least 1, got {limit_identities}")
    folders = identity_folders(src)
    all_names = sorted(folders)
    if not all_names:
        raise DatasetError(
            f"the source folder {src} has no identity sub-folders (expected src/<identity>/*.jpg)"
        )
    excluded = [n for n in all_names if n in excluded_names]
    not_found = sorted(excluded_names.difference(all_names))
    names = [n for n in all_names if n not in excluded_names]
    if limit_identities is not None:
        names = names[:limit_identities]
    photos: list[tuple[str, int]] = []
    for index, name in enumerate(names):
        folder = folders[name]
        files = sorted(
            p.name
            for p in (src / folder).iterdir()
            if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file()
        )
        photos.extend((f"{folder}/{f}", index) for f in files)
    if not photos:
        raise DatasetError(
            f"the source folder {src} has no photos ({', '.join(IMAGE_EXTENSIONS)}) in its "
            f"{len(names)} identity folder(s) left after exclusions"
        )
    return names, photos, excluded, not_found


def identity_folders(src: Path) -> dict[str, str]:
    """Identity name -> its folder, relative to ``src`` (posix).

    One level, as CASIA-WebFace: ``src/<identity>/<photo>``. Two levels, as WebFace42M (ten folders
    ``0`` .. ``9`` of identity folders): when every sub-folder of ``src`` holds sub-folders and no
    photo, those are the identity folders, ``src/<group>/<identity>/<photo>``, all read as one set.

    Raises:
        DatasetError: in two levels, one identity name in two groups.
    """
    tops = sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not tops or not all(_holds_only_folders(top) for top in tops):
        return {top.name: top.name for top in tops}
    found: dict[str, str] = {}
    for top in tops:
        for folder in sorted(p for p in top.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if folder.name in found:
                raise DatasetError(
                    f"{src} holds folders of identity folders (as WebFace42M), and the identity "
                    f"{folder.name!r} is in two of them ({found[folder.name]} and {top.name}/{folder.name}); "
                    "an identity's photos must be in one folder"
                )
            found[folder.name] = f"{top.name}/{folder.name}"
    return found


def _holds_only_folders(folder: Path) -> bool:
    """Whether ``folder`` holds at least one sub-folder and no photo (a group of identity folders)."""
    has_folder = False
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                has_folder = True
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                return False
    return has_folder


def _identity_of(path: str) -> str:
    """The identity of a photo's relative path: the name of the folder holding it."""
    return path.rsplit("/", 2)[-2]


# --------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------


def _shard_names(k: int) -> tuple[str, str, str]:
    return tuple(pattern.format(k) for pattern in _SHARD_FILES)  # type: ignore[return-value]


def _write_atomic(path: Path, write) -> None:
    """Write through ``write(file)`` to a temporary name, flush to disk, then ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_atomic(path, lambda f: f.write((json.dumps(data, indent=1) + "\n").encode("utf-8")))


def _write_npy(path: Path, array: np.ndarray) -> None:
    _write_atomic(path, lambda f: np.save(f, array, allow_pickle=False))


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _npy_shape(path: Path) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype from a ``.npy`` header, or None when the file is missing or broken."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    except (OSError, ValueError):
        return None
    return tuple(shape), dtype


def _shard_complete(out: Path, k: int, fingerprint: str, photo_range: tuple[int, int]) -> dict | None:
    """The meta of shard ``k`` when its three files are all there and agree; None otherwise.

    Raises:
        DatasetMismatchError: the shard's meta was written for another photo list or settings.
    """
    images_name, labels_name, meta_name = _shard_names(k)
    meta = _read_meta(out / meta_name)
    if meta is None:
        return None
    if meta.get("job_fingerprint") != fingerprint or tuple(meta.get("photo_range", ())) != photo_range:
        raise DatasetMismatchError(
            f"{out / meta_name} was prepared from another photo list or other settings (source, "
            "exclusions, limit_identities, shard_size or detector); use a new output folder or delete "
            "this one"
        )
    count = int(meta.get("count", -1))
    images = _npy_shape(out / images_name)
    labels = _npy_shape(out / labels_name)
    if images != ((count, *IMAGE_SHAPE), np.dtype(np.uint8)) or labels is None or labels[0] != (count,):
        return None
    return meta


def _write_shard(
    out: Path,
    k: int,
    fingerprint: str,
    photo_range: tuple[int, int],
    crops: np.ndarray,
    labels: np.ndarray,
    paths: list[str],
    skipped: list[dict[str, str]],
    seconds: float,
) -> dict[str, Any]:
    images_name, labels_name, meta_name = _shard_names(k)
    # A stale meta must never vouch for new arrays: remove it before touching them.
    (out / meta_name).unlink(missing_ok=True)
    _write_npy(out / images_name, np.ascontiguousarray(crops, dtype=np.uint8))
    _write_npy(out / labels_name, labels.astype(np.int32))
    meta = {
        "shard": k,
        "job_fingerprint": fingerprint,
        "photo_range": list(photo_range),
        "photos": photo_range[1] - photo_range[0],
        "count": len(paths),
        "images": images_name,
        "labels": labels_name,
        "paths": paths,
        "skipped": skipped,
        "seconds": round(seconds, 3),
    }
    _write_json(out / meta_name, meta)  # last: its presence marks the shard complete
    return meta


def _fingerprint(src: Path, photos: Sequence[tuple[str, int]], settings: dict[str, Any]) -> str:
    """SHA-256 over the photo list (relative paths and byte sizes) and the settings."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True).encode("utf-8"))
    for rel, _ in photos:
        try:
            size = (src / rel).stat().st_size
        except OSError:
            size = -1
        digest.update(f"\n{rel}\t{size}".encode())
    return digest.hexdigest()


def _detector_settings(min_face_size: float) -> dict[str, Any]:
    """The MTCNN settings the workers use (the detector's defaults but the minimum face size), for
    the manifest."""
    import inspect

    from models.mtcnn import MTCNNDetector

    defaults = inspect.signature(MTCNNDetector.__init__).parameters
    return {
        "name": "mtcnn",
        "min_face_size": float(min_face_size),
        "thresholds": [float(t) for t in defaults["thresholds"].default],
        "scale_factor": float(defaults["scale_factor"].default),
        "face_policy": FACE_POLICY,
    }


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="prepare", unit="img", dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def prepare_dataset(
    src: str | Path,
    out: str | Path,
    *,
    exclude_identities: Iterable[str] | str | Path | None = None,
    workers: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    providers: str = "cpu",
    progress: bool = True,
    limit_identities: int | None = None,
    min_face_size: float = DEFAULT_MIN_FACE_SIZE,
) -> PreparedDataset:
    """Detect and align every photo of ``src/<identity>/*`` into packed uint8 shards in ``out``.

    Args:
        src: the dataset: one sub-folder per identity, photos (.jpg .jpeg .png .bmp .webp, any
            case) inside; identities and photos are taken in sorted order.
        out: the output folder (created); see the module docstring for its files.
        exclude_identities: identity names to leave out (e.g. people who are also in LFW), or a
            text file with one name per line (blank lines and ``#`` comments ignored).
        workers: processes, each with its own MTCNN on one ONNX Runtime thread (default: all
            cores); 1 runs in this process.
        shard_size: photos per shard (the last shard may hold fewer).
        providers: ONNX Runtime providers for MTCNN, e.g. ``"cpu"`` or ``"cuda,cpu"``.
        progress: show a tqdm bar over photos.
        limit_identities: keep only the first N identities (after exclusions; for smoke tests).
        min_face_size: the smallest face MTCNN looks for, in pixels (at least 12, P-Net's window).
            The default 20 is MTCNN's; low-resolution sets (celeba_small's faces are about 45 px
            wide) keep a few more faces at 12, at some cost in time.

    Returns:
        the prepared folder, loaded with memory-mapped images; ``last_run`` says how many photos
        this call processed (0 when ``out`` was already complete).

    Raises:
        DatasetError: ``src`` is missing, has no identity folders or no photos.
        DatasetMismatchError: ``out`` holds a preparation of another photo list or other settings.
    """
    started = time.perf_counter()
    src, out = Path(src), Path(out)
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    if min_face_size < 12:
        raise ValueError(f"min_face_size must be at least 12 pixels (P-Net's window), got {min_face_size}")
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    identities, photos, excluded, not_found = list_photos(src, exclude_identities, limit_identities)
    settings = {
        "format_version": FORMAT_VERSION,
        "template": TEMPLATE.name,
        "image_shape": list(IMAGE_SHAPE),
        "detector": _detector_settings(min_face_size),
        "shard_size": shard_size,
    }
    job = _Job(src, out, photos, _fingerprint(src, photos, settings), workers, providers, min_face_size)
    out.mkdir(parents=True, exist_ok=True)
    ranges = [(a, min(a + shard_size, len(photos))) for a in range(0, len(photos), shard_size)]
    old = _check_output_folder(job, len(ranges))
    metas = _complete_shards(job, ranges)
    pending = [k for k in range(len(ranges)) if k not in metas]
    if old is not None and not pending:
        return _loaded(out, started, processed=0, written=0, reused=len(ranges))
    _mark_incomplete(out)
    processed = _align_pending(job, ranges, pending, metas, progress)
    manifest = _finish(
        src, out, identities=identities, photos=photos, ranges=ranges, metas=metas, excluded=excluded,
        not_found=not_found, limit_identities=limit_identities, fingerprint=job.fingerprint,
        settings=settings, providers=providers, workers=workers,
    )  # fmt: skip
    return _mark_complete(out, manifest, started, processed, written=len(pending), shards=len(ranges))


def _mark_incomplete(out: Path) -> None:
    """Remove the manifest (the folder is incomplete until it is rewritten) and a killed run's
    temporary files."""
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    for stale in out.glob(".*.tmp-*"):
        stale.unlink(missing_ok=True)


def _mark_complete(
    out: Path, manifest: dict[str, Any], started: float, processed: int, *, written: int, shards: int
) -> PreparedDataset:
    """Write the manifest last (the folder is complete from here on) and load the prepared set."""
    manifest["elapsed_seconds"] = round(time.perf_counter() - started, 3)
    manifest["photos_processed"] = processed
    _write_json(out / MANIFEST_FILE, manifest)
    dataset = _loaded(out, started, processed=processed, written=written, reused=shards - written)
    log.info("%s", dataset.summary())
    return dataset


@dataclass(frozen=True)
class _Job:
    """What the shards of one preparation are made from."""

    src: Path
    out: Path
    #: (path relative to ``src``, label) of every photo, in order.
    photos: list[tuple[str, int]]
    fingerprint: str
    workers: int
    providers: str
    min_face_size: float


def _check_output_folder(job: _Job, num_shards: int) -> dict[str, Any] | None:
    """The manifest already in ``job.out`` (None: none); DatasetMismatchError when the folder holds
    another preparation."""
    manifest_path = job.out / MANIFEST_FILE
    old = _read_meta(manifest_path) if manifest_path.exists() else None
    if manifest_path.exists() and (old is None or old.get("fingerprint") != job.fingerprint):
        raise DatasetMismatchError(
            f"{job.out} already holds a dataset prepared from another photo list or other settings "
            f"(source {old.get('source') if old else '?'}); use a new output folder or delete this one"
        )
    for meta_path in job.out.iterdir():  # shards of another job (e.g. another shard_size) must not mix
        match = _META_RE.match(meta_path.name)
        if match and int(match.group(1)) >= num_shards:
            raise DatasetMismatchError(
                f"{meta_path} belongs to another preparation (this one has {num_shards} shards); "
                "use a new output folder or delete this one"
            )
    return old


def _complete_shards(job: _Job, ranges: list[tuple[int, int]]) -> dict[int, dict[str, Any]]:
    """The meta of every shard already complete in ``job.out``, by shard index."""
    metas: dict[int, dict[str, Any]] = {}
    for k, photo_range in enumerate(ranges):
        meta = _shard_complete(job.out, k, job.fingerprint, photo_range)
        if meta is not None:
            metas[k] = meta
    return metas


def _loaded(out: Path, started: float, *, processed: int, written: int, reused: int) -> PreparedDataset:
    """The finished folder, loaded, with what this call did as ``last_run``."""
    dataset = load_prepared(out)
    dataset.last_run = {
        "photos_processed": processed,
        "shards_written": written,
        "shards_reused": reused,
        "seconds": time.perf_counter() - started,
    }
    return dataset


def _align_pending(
    job: _Job,
    ranges: list[tuple[int, int]],
    pending: list[int],
    metas: dict[int, dict[str, Any]],
    progress: bool,
) -> int:
    """Align the photos of the ``pending`` shards and write each shard (its meta into ``metas``);
    returns the number of photos processed (WorkerDied, naming the photo, when a worker died)."""
    photos = job.photos
    tasks = [(i, str(job.src / photos[i][0])) for k in pending for i in range(*ranges[k])]
    bar = _progress(len(photos), len(photos) - len(tasks), progress)
    stream = aligned_results(tasks, job.workers, job.providers, job.min_face_size)
    processed = 0
    try:
        for k in pending:
            first, last = ranges[k]
            shard_started = time.perf_counter()
            crops, labels, paths, skipped = _collect_shard(stream, photos, first, last, bar)
            processed += last - first
            metas[k] = _write_shard(
                job.out, k, job.fingerprint, (first, last), crops, labels, paths, skipped,
                time.perf_counter() - shard_started,
            )  # fmt: skip
    except WorkerDied as died:
        on = [(i, f"photo {i} ({photos[i][0]})") for i, _ in died.tasks]
        raise died_in_shards(died, on, ranges, len(metas)) from None
    finally:
        stream.close()  # stops the worker pool, also when this loop fails or is interrupted
        if bar is not None:
            bar.close()
    return processed


def _collect_shard(
    stream: Iterator[tuple[int, np.ndarray | None, str | None, str | None]],
    photos: list[tuple[str, int]],
    first: int,
    last: int,
    bar: Any,
) -> tuple[np.ndarray, np.ndarray, list[str], list[dict[str, str]]]:
    """The results of photos ``first .. last - 1`` from ``stream``: the kept crops, their labels
    and paths, and the skipped photos with their reasons."""
    crops = np.empty((last - first, *IMAGE_SHAPE), dtype=np.uint8)
    kept_rows: list[int] = []
    paths: list[str] = []
    labels: list[int] = []
    skipped: list[dict[str, str]] = []
    for row in range(last - first):
        index, crop, reason, message = next(stream)
        if index != first + row:  # results come in task order; anything else is a bug
            raise RuntimeError(f"photo {index} arrived where photo {first + row} was expected")
        rel, label = photos[index]
        if crop is None:
            skipped.append({"path": rel, "reason": str(reason), "message": str(message)})
        else:
            crops[row] = crop
            kept_rows.append(row)
            paths.append(rel)
            labels.append(label)
        if bar is not None:
            bar.update(1)
    return crops[kept_rows], np.asarray(labels, dtype=np.int64), paths, skipped


def _finish(
    src: Path,
    out: Path,
    *,
    identities: list[str],
    photos: list[tuple[str, int]],
    ranges: list[tuple[int, int]],
    metas: dict[int, dict[str, Any]],
    excluded: list[str],
    not_found: list[str],
    limit_identities: int | None,
    fingerprint: str,
    settings: dict[str, Any],
    providers: str,
    workers: int,
) -> dict[str, Any]:
    """Give labels their final contiguous values and build the manifest (not yet written)."""
    kept_counts: Counter[str] = Counter()
    for k in range(len(ranges)):
        kept_counts.update(_identity_of(path) for path in metas[k]["paths"])
    kept = [name for name in identities if kept_counts[name] > 0]
    label_of = {name: i for i, name in enumerate(kept)}
    shards, skipped = [], []
    for k in range(len(ranges)):
        meta = metas[k]
        labels = np.asarray([label_of[_identity_of(p)] for p in meta["paths"]], dtype=np.int32)
        labels_path = out / meta["labels"]
        # Shards are written with labels = index into the listed identities; re-map them when an
        # identity kept no face (and on resume, when earlier shards were re-mapped differently).
        if not np.array_equal(np.load(labels_path, allow_pickle=False), labels):
            _write_npy(labels_path, labels)
        shards.append(
            {
                "images": meta["images"],
                "labels": meta["labels"],
                "meta": _shard_names(k)[2],
                "count": int(meta["count"]),
                "photos": int(meta["photos"]),
            }
        )
        skipped.extend(meta["skipped"])
    by_reason = Counter(entry["reason"] for entry in skipped)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "source": str(src.resolve()),
        "template": TEMPLATE.name,
        "image_shape": list(IMAGE_SHAPE),
        "image_dtype": "uint8",
        "label_dtype": "int32",
        "color": "RGB",
        "identities": kept,
        "num_classes": len(kept),
        "num_images": sum(kept_counts.values()),
        "num_photos": len(photos),
        "identity_counts": {name: kept_counts[name] for name in kept},
        "dropped_identities": [name for name in identities if kept_counts[name] == 0],
        "excluded_identities": excluded,
        "exclusions_not_found": not_found,
        "limit_identities": limit_identities,
        "shard_size": settings["shard_size"],
        "shards": shards,
        "num_skipped": len(skipped),
        "skipped_by_reason": dict(sorted(by_reason.items())),
        "skipped": skipped,
        "detector": {
            **settings["detector"],
            "providers": providers,
            "intra_op_threads": 1,
            "workers": workers,
        },
        "fingerprint": fingerprint,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
