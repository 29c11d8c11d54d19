"""Sets of face photos for the evaluation jobs: probes (one folder per identity) and distractors
(any tree of images), from a folder or a list file, with noise lists and shards."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.evaluation.errors import MegaFaceDataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass
class FaceSet:
    """Images of one side of the protocol: ``keys`` name them (stable, relative), ``identities``
    is the probe identity of each image (None for distractors)."""

    name: str
    paths: list[Path]
    keys: list[str]
    identities: list[str] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def digest(self) -> str:
        """Hash of the keys, file sizes and modification times: a changed file invalidates caches."""
        h = hashlib.sha256(self.name.encode())
        for key, path in zip(self.keys, self.paths, strict=True):
            st = path.stat()
            h.update(f"\0{key}\0{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()

    def subset(self, keep: np.ndarray) -> FaceSet:
        idx = np.flatnonzero(keep)
        return FaceSet(
            self.name,
            [self.paths[i] for i in idx],
            [self.keys[i] for i in idx],
            None if self.identities is None else [self.identities[i] for i in idx],
        )


def images_under(root: Path) -> list[Path]:
    """Every image file (:data:`IMAGE_SUFFIXES`) in the tree under ``root``, in path order."""
    files = [p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _from_paths(name: str, root: Path, paths: list[Path], with_identities: bool) -> FaceSet:
    keys = [p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix() for p in paths]
    identities = None
    if with_identities:
        flat = [k for k in keys if "/" not in k]
        if flat:
            raise MegaFaceDataError(
                f"probe images must sit in one folder per identity under {root}; {len(flat)} do not, "
                f"e.g. {flat[0]}"
            )
        identities = [k.split("/", 1)[0] for k in keys]
    return FaceSet(name, paths, keys, identities)


def load_face_set(source: str | Path, name: str, *, probes: bool) -> FaceSet:
    """A folder (probes: one sub-folder per identity; distractors: any tree of images) or a text
    file listing image paths relative to the file's folder (probes: ``identity/…/image``)."""
    source = Path(source)
    if source.is_dir():
        root, paths = source, images_under(source)
    elif source.is_file():
        root = source.parent
        lines = [ln.strip() for ln in source.read_text().splitlines()]
        paths = [root / ln for ln in lines if ln and not ln.startswith("#")]
        missing = [p for p in paths if not p.is_file()]
        if missing:
            raise MegaFaceDataError(
                f"{source} lists {len(missing)} images that do not exist, e.g. {missing[0]}"
            )
    else:
        raise MegaFaceDataError(f"{source} is neither a folder of images nor a list file")
    if not paths:
        raise MegaFaceDataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {source}")
    return _from_paths(name, root, paths, probes)


def cap_per_identity(probes: FaceSet, max_per_identity: int | None) -> FaceSet:
    """Keep identities with 2+ images and at most ``max_per_identity`` images each (key order)."""
    assert probes.identities is not None
    counts: dict[str, int] = {}
    for ident in probes.identities:
        counts[ident] = counts.get(ident, 0) + 1
    seen: dict[str, int] = {}
    keep = np.zeros(len(probes), dtype=bool)
    for i, ident in enumerate(probes.identities):
        seen[ident] = seen.get(ident, 0) + 1
        keep[i] = counts[ident] >= 2 and (max_per_identity is None or seen[ident] <= max_per_identity)
    return probes.subset(keep)


def shard_of(faces: FaceSet, shard: int, shards: int) -> FaceSet:
    """Every ``shards``-th image from ``shard`` on (interleaved: shards of equal size and mix)."""
    if not 0 <= shard < shards:
        raise MegaFaceDataError(f"shard must be in 0..{shards - 1}, got {shard}")
    keep = np.zeros(len(faces), dtype=bool)
    keep[shard::shards] = True
    shard_set = faces.subset(keep)
    shard_set.name = f"{faces.name}-shard{shard}of{shards}"
    return shard_set


def read_removal_list(path: str | Path) -> set[str]:
    """One image per line (a key, a path ending or a file name); blank lines and ``#`` ignored."""
    path = Path(path)
    if not path.is_file():
        raise MegaFaceDataError(f"removal list {path} does not exist")
    entries = set()
    for line in path.read_text().splitlines():
        line = line.strip().strip("/")
        if line and not line.startswith("#"):
            entries.add(line)
    return entries


def removed_mask(keys: Sequence[str], entries: set[str]) -> np.ndarray:
    """True for every key that equals a list entry or ends with ``/entry`` (so file names match)."""
    out = np.zeros(len(keys), dtype=bool)
    if not entries:
        return out
    for i, key in enumerate(keys):
        parts = key.split("/")
        out[i] = any("/".join(parts[j:]) in entries for j in range(len(parts)))
    return out
