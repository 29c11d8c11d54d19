"""MegaFace Challenge 1 identification and verification, on any probe and distractor set.

The protocol (MegaFace Challenge 1, as the official devkit and ANCHORS.md d9 describe it):

* **Identification.** For every probe identity with ``M`` images and every one of them ``g``: put
  ``g`` into a gallery with ``N`` distractors and search with each of the other ``M - 1`` images
  ``p``. The rank of the search is ``1 + #{distractors d : cos(p, d) > cos(p, g)}`` (a distractor
  that ties the genuine score does not beat it). Rank-1 (and rank-k, the CMC) identification rate
  is the share of all ``(p, g)`` searches with rank <= k, for ``N`` = 10, 100, ..., 1,000,000.
  The distractor sets of the sizes are nested: the first ``N`` of one fixed random order.
* **Verification.** Genuine pairs: every unordered pair of probe images of one identity.
  Impostor pairs: every probe image with every one of the ``N`` distractors. TAR at FAR ``f``:
  the threshold is the ``(k+1)``-th highest impostor score with ``k = floor(f * n_impostor)``
  and a genuine pair is accepted when it scores strictly above it (the rule of
  :func:`training.evaluation.lfw.tar_at_far`).
* **Noise lists** (FaceScrub / MegaFace label noise): removed probe images leave the probe set;
  removed distractors stay in the count but can never outscore anything (their scores are
  ``-inf``), as InsightFace's ``remove_noises.py`` does by pushing them far away. With lists, both
  the ``raw`` and the ``cleaned`` numbers are reported.

Faces go through the project's one face path: MTCNN (the face nearest the image centre, the LFW
detect-mode rule with its no-face fallback), the SphereFace 5-point alignment and the model's
flip-fused embedding, L2-normalised (cosine = dot product, no mean subtraction).

Scale: landmarks and embeddings are cached on disk per image set (and per model), filled in order
and committed every few seconds, so an interrupted run resumes where it stopped. The search
streams the distractors in chunks of bounded size (``chunk_mb``) through a matrix product; for each
probe it keeps only its ``top_k`` best distractor scores per size, and for verification only the
impostor scores above the FAR ``1e-3`` threshold, so memory is bounded by
``probes x chunk + probes x top_k + 1e-3 x probes x N`` floats whatever the number of distractors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import FacePathError, SphereFaceError
from training import locks
from training.evaluation.lfw import _ordered_map, detect_central_landmarks, false_accepts_allowed, far_label

log = logging.getLogger(__name__)

#: Distractor counts of MegaFace Challenge 1 (each one used when the set is large enough).
DISTRACTOR_SIZES = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
#: False-accept rates of the verification report (1e-6 is the papers' "MV" column).
VERIFICATION_FARS = (1e-3, 1e-4, 1e-5, 1e-6)
#: Ranks kept per probe (CMC up to this rank; rank-1 and rank-10 are reported).
TOP_K = 100
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")

#: The local protocol: versioned, so numbers from different versions are never put side by side.
LOCAL_PROTOCOL = "local-v1"
LOCAL_MAX_PER_IDENTITY = 20
LOCAL_PROTOCOL_DESCRIPTION = (
    "probes = the LFW people with 2 or more photos, the first 20 photos of each (file "
    "name order; George_W_Bush alone would otherwise make 58% of the searches); distractors = the "
    "LFW people with exactly one photo plus every photo of ../shared/data/celeba_faces (CelebA "
    "identity numbers are anonymised, so a few CelebA people may also be LFW probe identities); "
    "distractor order: a fixed random permutation (seed 0), sizes nested; every face through "
    "MTCNN (central face) and the SphereFace 112x96 alignment"
)
PROTOCOLS = ("custom", "megaface", "local")

#: Augmented distractors: what each one is (recorded in the JSON).
AUGMENTATION_VERSION = "aug-v1"
AUGMENTATION_DESCRIPTION = (
    "aug-v1: a real distractor face (cycled in a fixed random order), re-aligned from its detected "
    "landmarks after a random similarity jitter (rotation +-10 deg, scale 0.9-1.1, shift +-4 px), "
    "mirrored with p=0.5, then brightness +-32, contrast 0.7-1.3, gamma 0.7-1.4, greyscale p=0.2, "
    "3x3 box blur p=0.3, Gaussian noise sigma 0-6; every one embedded by the model"
)


class MegaFaceDataError(SphereFaceError):
    """A probe or distractor set, a list file or a cache that cannot be used."""

    code = "megaface_data"


# --------------------------------------------------------------------------------------------
# Image sets
# --------------------------------------------------------------------------------------------


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


def _images_under(root: Path) -> list[Path]:
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
        root, paths = source, _images_under(source)
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


def local_protocol(data_dir: str | Path) -> tuple[FaceSet, FaceSet]:
    """Probes and distractors of :data:`LOCAL_PROTOCOL` from ``../shared/data`` (see its description)."""
    data_dir = Path(data_dir)
    lfw = data_dir / "lfw" / "images"
    celeba = data_dir / "celeba_faces"
    for folder in (lfw, celeba):
        if not folder.is_dir():
            raise MegaFaceDataError(f"the local protocol needs {folder} (see ../shared/data/README.md)")
    people: dict[str, list[Path]] = {}
    for path in _images_under(lfw):
        people.setdefault(path.parent.name, []).append(path)
    probe_paths, single = [], []
    for person in sorted(people):
        photos = people[person]
        if len(photos) >= 2:
            probe_paths.extend(photos[:LOCAL_MAX_PER_IDENTITY])
        else:
            single.extend(photos)
    probes = FaceSet(
        "local-probes",
        probe_paths,
        ["lfw/" + p.relative_to(lfw).as_posix() for p in probe_paths],
        [p.parent.name for p in probe_paths],
    )
    celeba_paths = _images_under(celeba)
    distractors = FaceSet(
        "local-distractors",
        single + celeba_paths,
        ["lfw/" + p.relative_to(lfw).as_posix() for p in single]
        + ["celeba_faces/" + p.relative_to(celeba).as_posix() for p in celeba_paths],
    )
    return probes, distractors


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


# --------------------------------------------------------------------------------------------
# Resumable on-disk cache of per-image rows
# --------------------------------------------------------------------------------------------


class RowCache:
    """Arrays of ``n`` rows in a folder, filled in order and committed as a whole-row count.

    A run that stops (Ctrl-C, a crash, a full disk) resumes from the last commit. The folder's
    ``meta.json`` says what the rows are; a different ``meta`` starts over, the same ``meta`` with a
    larger ``n`` keeps the rows already filled.

    One process at a time fills a folder: the cache holds an exclusive lock on ``folder/.lock``
    from opening until :meth:`close` (use it as a context manager). A second run on the same
    folder, e.g. two ``sphereface evaluate megaface`` started side by side, waits, then finds the
    rows the first one filled instead of racing it on the same files.
    """

    def __init__(self, folder: Path, meta: dict[str, Any], n: int, columns: dict[str, tuple]) -> None:
        self.folder, self.n = folder, n
        folder.mkdir(parents=True, exist_ok=True)
        self._lock: int | None = locks.acquire(folder / ".lock", f"filling {folder}")
        try:
            self._open(meta, columns)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let another process fill the folder (the arrays read so far stay valid)."""
        if self._lock is not None:
            locks.release(self._lock)
            self._lock = None

    def __enter__(self) -> RowCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, meta: dict[str, Any], columns: dict[str, tuple]) -> None:
        folder, n = self.folder, self.n
        meta_path, progress_path = folder / "meta.json", folder / "progress.json"
        meta = json.loads(json.dumps(meta))
        old_meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
        old_done, old_n = 0, 0
        if old_meta == meta and progress_path.is_file():
            progress = json.loads(progress_path.read_text())
            old_done, old_n = int(progress["done"]), int(progress["n"])
        elif old_meta is not None:
            log.info("cache %s holds something else: starting over", folder)
        if not all((folder / f"{name}.npy").is_file() for name in columns):
            old_done = 0
        self.arrays: dict[str, np.ndarray] = {}
        for name, (tail, dtype) in columns.items():
            file = folder / f"{name}.npy"
            reusable = old_done > 0
            if reusable and old_n == n:
                array = np.lib.format.open_memmap(file, mode="r+")
                if array.shape != (n, *tail) or array.dtype != np.dtype(dtype):
                    raise MegaFaceDataError(f"cache file {file} has an unexpected shape; delete {folder}")
            else:
                keep = min(old_done, n) if reusable else 0
                fresh = folder / f"{name}.new.npy"
                array = np.lib.format.open_memmap(fresh, mode="w+", dtype=dtype, shape=(n, *tail))
                if keep:
                    array[:keep] = np.lib.format.open_memmap(file, mode="r")[:keep]
                array.flush()
                os.replace(fresh, file)
                array = np.lib.format.open_memmap(file, mode="r+")
            self.arrays[name] = array
        self.done = min(old_done, n)
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        self.commit(self.done)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def commit(self, done: int) -> None:
        for array in self.arrays.values():
            array.flush()
        tmp = self.folder / "progress.json.tmp"
        tmp.write_text(json.dumps({"done": done, "n": self.n}))
        os.replace(tmp, self.folder / "progress.json")
        self.done = done

    def fill(
        self,
        produce: Callable[[int], Any],
        store: Callable[[int, list[Any]], None],
        *,
        batch_size: int,
        workers: int,
        desc: str,
        progress: bool,
        commit_seconds: float = 5.0,
    ) -> None:
        """Run ``produce(i)`` for every row not yet done (on ``workers`` threads, in order) and hand
        them to ``store(first_row, items)`` in batches; commit at least every ``commit_seconds``."""
        if self.done >= self.n:
            return
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=self.n, initial=self.done, desc=desc, unit="img", dynamic_ncols=True)
        start, pending, last = self.done, [], time.monotonic()
        try:
            for item in _ordered_map(produce, range(self.done, self.n), workers, window=2 * batch_size):
                pending.append(item)
                if len(pending) == batch_size:
                    store(start, pending)
                    start += len(pending)
                    if bar is not None:
                        bar.update(len(pending))
                    pending = []
                    if time.monotonic() - last > commit_seconds:
                        self.commit(start)
                        last = time.monotonic()
            if pending:
                store(start, pending)
                start += len(pending)
                if bar is not None:
                    bar.update(len(pending))
        finally:
            self.commit(start)
            if bar is not None:
                bar.close()


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPHEREFACE_CACHE", ".cache")) / "megaface"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Faces: landmarks (model-independent) and embeddings (per model), both cached
# --------------------------------------------------------------------------------------------

DETECTOR_TAG = "mtcnn-central-v1"


def detect_landmarks(
    faces: FaceSet,
    cache_dir: Path,
    *,
    detector: Any = None,
    providers: str | Sequence[str] = "cpu",
    workers: int = 2,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 5, 2)`` landmarks of the face nearest each image's centre and ``found`` flags."""
    digest = faces.digest()
    with RowCache(
        cache_dir / "landmarks" / f"{faces.name}-{digest[:16]}",
        {"set": faces.name, "digest": digest, "detector": DETECTOR_TAG, "n": len(faces)},
        len(faces),
        {"landmarks": ((5, 2), np.float32), "found": ((), np.bool_)},
    ) as cache:
        _fill_landmarks(cache, faces, detector, providers, workers, progress)
    return np.asarray(cache["landmarks"]), np.asarray(cache["found"])


def _fill_landmarks(
    cache: RowCache, faces: FaceSet, detector: Any, providers: Any, workers: int, progress: bool
) -> None:
    from models.image import read_image

    if cache.done < cache.n:
        if detector is None:
            from models.mtcnn import MTCNNDetector

            detector = MTCNNDetector(providers=providers, intra_op_threads=1)

        def produce(i: int) -> tuple[np.ndarray, bool]:
            try:
                return detect_central_landmarks(detector, read_image(faces.paths[i]))
            except FacePathError as exc:
                raise MegaFaceDataError(f"{faces.paths[i]}: {exc.message}") from exc

        def store(first: int, items: list[tuple[np.ndarray, bool]]) -> None:
            cache["landmarks"][first : first + len(items)] = np.stack([p for p, _ in items])
            cache["found"][first : first + len(items)] = [f for _, f in items]

        cache.fill(
            produce, store, batch_size=64, workers=workers, desc=f"detect {faces.name}", progress=progress
        )


@dataclass
class ModelKey:
    """Which model made an embedding: the manifest's id, and a hash of the ONNX file together with
    the manifest's embedding config (template, normalisation, flip fusion), so a cache never
    serves vectors made with another crop or fusion of the same weights."""

    model_dir: Path
    model_id: str
    digest: str

    @classmethod
    def of(cls, model_dir: str | Path) -> ModelKey:
        from models.manifest import load_manifest

        model_dir = Path(model_dir)
        manifest = load_manifest(model_dir)
        config = json.dumps(manifest.embedding_config(), sort_keys=True)
        digest = hashlib.sha256(f"{_file_sha256(model_dir / 'model.onnx')}\0{config}".encode()).hexdigest()
        return cls(model_dir, manifest.model_id, digest)

    @property
    def folder(self) -> str:
        return f"{self.model_id.replace('/', '_').replace('@', '-')}-{self.digest[:12]}"


def _embed_rows(
    cache: RowCache,
    crop: Callable[[int], np.ndarray],
    embedder: Any,
    *,
    batch_size: int,
    workers: int,
    desc: str,
    progress: bool,
) -> np.ndarray:
    def store(first: int, crops: list[np.ndarray]) -> None:
        cache["features"][first : first + len(crops)] = embedder.embed(np.stack(crops), normalize=True)

    cache.fill(crop, store, batch_size=batch_size, workers=workers, desc=desc, progress=progress)
    return cache["features"]


def embed_faces(
    faces: FaceSet,
    landmarks: np.ndarray,
    model: ModelKey,
    embedder: Any,
    cache_dir: Path,
    *,
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> np.ndarray:
    """L2-normalised fused embeddings ``(n, D)`` (a read-only memmap of the cache)."""
    from models.align import align_face, get_template
    from models.image import read_image

    template = get_template(embedder.manifest.template)
    digest = faces.digest()

    def crop(i: int) -> np.ndarray:
        return align_face(read_image(faces.paths[i]), landmarks[i], template)

    with RowCache(
        cache_dir / "features" / model.folder / f"{faces.name}-{digest[:16]}",
        {"set": faces.name, "digest": digest, "detector": DETECTOR_TAG, "model": model.digest},
        len(faces),
        {"features": ((embedder.output_size,), np.float32)},
    ) as cache:
        return _embed_rows(
            cache,
            crop,
            embedder,
            batch_size=batch_size,
            workers=workers,
            desc=f"embed {faces.name}",
            progress=progress,
        )


def augment_face(
    image: np.ndarray, landmarks: np.ndarray, template: Any, rng: np.random.Generator
) -> np.ndarray:
    """One :data:`AUGMENTATION_DESCRIPTION` variant of a face: jittered alignment, then pixels."""
    from models.align import align_face

    angle = np.deg2rad(rng.uniform(-10, 10))
    scale = rng.uniform(0.9, 1.1)
    shift = rng.uniform(-4, 4, size=2)
    centre = landmarks.mean(axis=0)
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]) * scale
    jittered = (landmarks - centre) @ rot.T + centre + shift
    face = align_face(image, jittered, template).astype(np.float32)
    if rng.random() < 0.5:
        face = face[:, ::-1]
    face = (face - 127.5) * rng.uniform(0.7, 1.3) + 127.5 + rng.uniform(-32, 32)
    face = 255.0 * (np.clip(face, 0, 255) / 255.0) ** rng.uniform(0.7, 1.4)
    if rng.random() < 0.2:
        face[:] = face @ np.array([0.299, 0.587, 0.114], dtype=np.float32)[:, None]
    if rng.random() < 0.3:
        padded = np.pad(face, ((1, 1), (1, 1), (0, 0)), mode="edge")
        h, w = face.shape[:2]
        face = sum(padded[dy : dy + h, dx : dx + w] for dy in range(3) for dx in range(3)) / 9.0
    face = face + rng.normal(0.0, rng.uniform(0, 6), size=face.shape)
    return np.clip(np.rint(face), 0, 255).astype(np.uint8)


def embed_augmented(
    source: FaceSet,
    landmarks: np.ndarray,
    count: int,
    model: ModelKey,
    embedder: Any,
    cache_dir: Path,
    *,
    seed: int = 0,
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> tuple[np.ndarray, list[str]]:
    """``count`` embedded augmentations of the ``source`` faces (resumable; a larger ``count`` later
    keeps the rows already made: augmentation ``i`` depends only on ``seed`` and ``i``)."""
    from models.align import get_template
    from models.image import read_image

    if len(source) == 0:
        raise MegaFaceDataError("augmented distractors need at least one real distractor face")
    template = get_template(embedder.manifest.template)
    order = np.random.default_rng(seed).permutation(len(source))
    digest = source.digest()

    def crop(i: int) -> np.ndarray:
        j = int(order[i % len(order)])
        rng = np.random.default_rng([seed, i])
        return augment_face(read_image(source.paths[j]), landmarks[j], template, rng)

    with RowCache(
        cache_dir / "features" / model.folder / f"{source.name}-{AUGMENTATION_VERSION}-s{seed}-{digest[:16]}",
        {
            "source": source.name,
            "digest": digest,
            "augmentation": AUGMENTATION_VERSION,
            "seed": seed,
            "detector": DETECTOR_TAG,
            "model": model.digest,
        },
        count,
        {"features": ((embedder.output_size,), np.float32)},
    ) as cache:
        features = _embed_rows(
            cache,
            crop,
            embedder,
            batch_size=batch_size,
            workers=workers,
            desc="embed augmented",
            progress=progress,
        )
    keys = [f"{AUGMENTATION_VERSION}/{i}/{source.keys[int(order[i % len(order)])]}" for i in range(count)]
    return features, keys


# --------------------------------------------------------------------------------------------
# The chunked search
# --------------------------------------------------------------------------------------------


def distractor_sizes(available: int, requested: Sequence[int] | None = None) -> list[int]:
    """``requested`` (default :data:`DISTRACTOR_SIZES`) up to ``available``, plus ``available``
    itself when it lies beyond the last one (so every distractor is used once)."""
    if requested is not None:
        too_many = [n for n in requested if n > available]
        if too_many:
            raise MegaFaceDataError(f"asked for {too_many[0]} distractors but only {available} are there")
        return sorted(set(int(n) for n in requested))
    sizes = [n for n in DISTRACTOR_SIZES if n <= available]
    if available and (not sizes or available > sizes[-1]):
        sizes.append(available)
    return sizes


@dataclass
class _Variant:
    """The state of one variant (raw or cleaned) of the search while distractors stream past."""

    rows: np.ndarray  # probe rows taking part
    top_k: int
    budget: int  # impostor scores to keep: floor(max FAR * rows * largest size) + 1
    top: np.ndarray = field(init=False)
    pool: list[np.ndarray] = field(default_factory=list)
    pool_size: int = 0
    pool_floor: float = -math.inf
    snapshots: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.top = np.full((len(self.rows), self.top_k), -np.inf, dtype=np.float32)

    def consume(self, scores: np.ndarray) -> None:
        self.top = merge_top_k(self.top, scores)
        if self.budget <= 0:
            return
        kept = scores[scores > self.pool_floor] if self.pool_floor > -math.inf else scores.ravel().copy()
        if kept.size:
            self.pool.append(kept)
            self.pool_size += kept.size
        if self.pool_size > 2 * self.budget:
            merged = np.concatenate(self.pool)
            best = np.partition(merged, merged.size - self.budget)[merged.size - self.budget :]
            self.pool, self.pool_size, self.pool_floor = [best], best.size, float(best.min())

    def snapshot(self, size: int) -> None:
        pool = np.concatenate(self.pool) if self.pool else np.empty(0, np.float32)
        if pool.size > self.budget:
            pool = np.partition(pool, pool.size - self.budget)[pool.size - self.budget :]
        self.pool, self.pool_size = [pool], pool.size
        self.snapshots[size] = (self.top.copy(), np.sort(pool)[::-1])


def merge_top_k(top: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Each row's ``k`` highest values of ``top`` (row-sorted, descending) and ``scores`` together."""
    rows, k = top.shape
    floor = top[:, -1]
    above = scores > floor[:, None]
    count = int(above.sum())
    if count == 0:
        return top
    if count > 4 * rows * k:
        both = np.concatenate([top, scores], axis=1)
        part = np.partition(both, both.shape[1] - k, axis=1)[:, -k:]
        return -np.sort(-part, axis=1)
    r, c = np.nonzero(above)
    row_of = np.concatenate([np.repeat(np.arange(rows), k), r])
    value = np.concatenate([top.ravel(), scores[r, c]])
    order = np.lexsort((-value, row_of))
    row_sorted = row_of[order]
    position = np.arange(len(order)) - np.searchsorted(row_sorted, row_sorted)
    keep = position < k
    out = np.empty_like(top)
    out[row_sorted[keep], position[keep]] = value[order][keep]
    return out


@dataclass
class SearchResult:
    """Per size: each probe's ``top_k`` distractor scores (descending) and the impostor scores
    kept for verification (descending), for every variant."""

    sizes: list[int]
    variants: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]
    rows: dict[str, np.ndarray]
    seconds: float
    device: str


def search_distractors(
    probes: np.ndarray,
    distractors: np.ndarray,
    order: np.ndarray,
    sizes: Sequence[int],
    *,
    removed_probes: np.ndarray | None = None,
    removed_distractors: np.ndarray | None = None,
    top_k: int = TOP_K,
    max_far: float = max(VERIFICATION_FARS),
    chunk_mb: float = 256.0,
    device: str = "cpu",
    progress: bool = True,
) -> SearchResult:
    """Stream ``distractors[order[:max(sizes)]]`` in chunks against every probe.

    ``probes`` ``(P, D)`` and ``distractors`` ``(M, D)`` are L2-normalised (``distractors`` may be a
    memmap). With removal masks a ``cleaned`` variant is computed next to ``raw``.
    """
    started = time.perf_counter()
    probes = np.ascontiguousarray(probes, dtype=np.float32)
    n_probes = len(probes)
    largest = max(sizes) if sizes else 0
    cleaned = removed_probes is not None or removed_distractors is not None
    all_rows = np.arange(n_probes)
    variants = {"raw": _Variant(all_rows, top_k, math.floor(max_far * n_probes * largest) + 1)}
    if cleaned:
        kept = all_rows if removed_probes is None else np.flatnonzero(~removed_probes)
        variants["cleaned"] = _Variant(kept, top_k, math.floor(max_far * len(kept) * largest) + 1)
    for size in sizes:
        if size == 0:
            for v in variants.values():
                v.snapshot(0)
    chunk = max(256, int(chunk_mb * 2**20 / (4 * max(n_probes, 1) * (2 if cleaned else 1))))
    stops = sorted({0, *[s for s in sizes if s > 0]})
    bounds = sorted({*range(0, largest, chunk), *stops, largest})
    scorer = _make_scorer(probes, device)
    bar = None
    if progress and largest:
        from tqdm import tqdm

        bar = tqdm(total=largest, desc="search distractors", unit="img", unit_scale=True, dynamic_ncols=True)
    try:
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            idx = np.sort(order[a:b])
            block = np.ascontiguousarray(distractors[idx], dtype=np.float32)
            scores = scorer(block)
            variants["raw"].consume(scores)
            if cleaned:
                v = variants["cleaned"]
                part = scores[v.rows] if len(v.rows) < n_probes else scores.copy()
                if removed_distractors is not None:
                    part[:, removed_distractors[idx]] = -np.inf
                v.consume(part)
            if b in stops:
                for v in variants.values():
                    v.snapshot(b)
            if bar is not None:
                bar.update(b - a)
    finally:
        if bar is not None:
            bar.close()
    return SearchResult(
        sizes=list(sizes),
        variants={name: v.snapshots for name, v in variants.items()},
        rows={name: v.rows for name, v in variants.items()},
        seconds=time.perf_counter() - started,
        device=device,
    )


def _make_scorer(probes: np.ndarray, device: str) -> Callable[[np.ndarray], np.ndarray]:
    """``block (C, D) -> probes @ block.T (P, C)`` with numpy (BLAS) or torch on ``device``."""
    if device == "cpu":
        return lambda block: probes @ block.T
    try:
        import torch
    except ImportError as exc:
        raise MegaFaceDataError(f"--device {device} needs torch (pip install -e '.[train]')") from exc
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MegaFaceDataError(f"--device {device}: torch sees no CUDA device")
    device = "cpu" if device == "torch-cpu" else device  # the torch path on the CPU (tests)
    on_device = torch.from_numpy(probes).to(device)

    def score(block: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return (on_device @ torch.from_numpy(block).to(device).T).cpu().numpy()

    return score


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def identity_groups(identities: Sequence[str]) -> list[np.ndarray]:
    """Row indices of each identity with at least two images (in first-seen order)."""
    groups: dict[str, list[int]] = {}
    for i, ident in enumerate(identities):
        groups.setdefault(ident, []).append(i)
    return [np.array(g) for g in groups.values() if len(g) >= 2]


def genuine_scores(features: np.ndarray, groups: Sequence[np.ndarray]) -> np.ndarray:
    """Cosine of every unordered pair of images of one identity."""
    out = []
    for g in groups:
        block = features[g] @ features[g].T
        out.append(block[np.triu_indices(len(g), k=1)])
    return np.concatenate(out) if out else np.empty(0, np.float32)


def search_ranks(features: np.ndarray, groups: Sequence[np.ndarray], top: np.ndarray) -> np.ndarray:
    """Distractors that beat the genuine match, for every search ``(probe p, gallery g)`` of the
    MegaFace rule (``p != g``, same identity); ``top`` holds each row's ``k`` best distractor
    scores (descending), so the count saturates at ``k`` (rank > k)."""
    out = []
    for g in groups:
        genuine = features[g] @ features[g].T  # [p, gallery]
        beaten = (top[g][:, None, :] > genuine[:, :, None]).sum(axis=2)
        out.append(beaten[~np.eye(len(g), dtype=bool)])
    return np.concatenate(out) if out else np.empty(0, np.int64)


def threshold_at_far(impostor_desc: np.ndarray, n_impostor: int, far: float) -> float | None:
    """The ``(k+1)``-th highest impostor score, ``k = floor(far * n_impostor)``, from the highest
    impostor scores in descending order; None when ``far * n_impostor < 1``."""
    allowed = false_accepts_allowed(far, n_impostor)
    if allowed is None or allowed >= len(impostor_desc):
        return None
    return float(impostor_desc[allowed])


def verification_at(
    genuine: np.ndarray, impostor_desc: np.ndarray, n_impostor: int, fars: Sequence[float] = VERIFICATION_FARS
) -> dict[str, Any]:
    tar, thresholds = {}, {}
    for far in fars:
        t = threshold_at_far(impostor_desc, n_impostor, far)
        tar[far_label(far)] = None if t is None else float(np.mean(genuine > t))
        thresholds[far_label(far)] = t
    return {
        "n_genuine": int(len(genuine)),
        "n_impostor": int(n_impostor),
        "tar_at_far": tar,
        "threshold_at_far": thresholds,
    }


def roc_points(
    genuine: np.ndarray, impostor_desc: np.ndarray, n_impostor: int, points: int = 200
) -> dict[str, list]:
    """(FAR, TAR) at thresholds taken from the kept impostor scores, log-spaced in FAR."""
    if len(impostor_desc) < 2 or len(genuine) == 0:
        return {"far": [], "tar": []}
    ks = np.unique(np.geomspace(1, len(impostor_desc) - 1, points).astype(np.int64))
    thresholds = impostor_desc[ks]
    ordered = np.sort(genuine)
    tar = 1.0 - np.searchsorted(ordered, thresholds, side="right") / len(ordered)
    return {"far": (ks / n_impostor).tolist(), "tar": tar.tolist()}


def summarise(
    features: np.ndarray,
    identities: Sequence[str],
    result: SearchResult,
    fars: Sequence[float] = VERIFICATION_FARS,
) -> dict[str, Any]:
    """Identification (rank-1, rank-10, CMC) and verification per size, for every variant."""
    out: dict[str, Any] = {}
    for name, snapshots in result.variants.items():
        rows = result.rows[name]
        sub = features[rows]
        groups = identity_groups([identities[i] for i in rows])
        genuine = genuine_scores(sub, groups)
        ident, verif, cmc, roc = {}, {}, {}, {}
        for size in result.sizes:
            top, impostor = snapshots[size]
            beaten = search_ranks(sub, groups, top)
            k = top.shape[1]
            ranks = np.bincount(np.minimum(beaten, k), minlength=k + 1)[:k]
            curve = np.cumsum(ranks) / max(len(beaten), 1)
            ident[str(size)] = {
                "rank1": float(curve[0]),
                "rank10": float(curve[min(9, k - 1)]),
                "searches": int(len(beaten)),
            }
            cmc[str(size)] = curve.tolist()
            n_imp = len(rows) * size
            verif[str(size)] = verification_at(genuine, impostor, n_imp, fars)
            roc[str(size)] = roc_points(genuine, impostor, n_imp)
        out[name] = {
            "probe_images": int(len(rows)),
            "identities": len(groups),
            "identification": ident,
            "verification": verif,
            "cmc": cmc,
            "roc": roc,
        }
    return out


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


class _Stacked:
    """Row-wise concatenation of 2-D arrays (memmaps stay on disk) that fancy-indexes like one."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty((len(idx), self.parts[0].shape[1]), dtype=np.float32)
        for w in np.unique(which):
            sel = which == w
            out[sel] = self.parts[w][idx[sel] - self.starts[w]]
        return out


def load_feature_file(path: str | Path, dim: int) -> np.ndarray:
    """A ``.npy`` of ``(n, dim)`` float32 distractor features, L2-normalised (memory-mapped)."""
    path = Path(path)
    if not path.is_file():
        raise MegaFaceDataError(f"feature file {path} does not exist")
    array = np.load(path, mmap_mode="r")
    if array.ndim != 2 or array.shape[1] != dim or array.dtype != np.float32:
        raise MegaFaceDataError(
            f"{path} holds {array.dtype} {array.shape}; expected float32 (n, {dim}) features of this model"
        )
    norms = np.linalg.norm(array[: min(len(array), 1000)], axis=1)
    if len(norms) and not np.allclose(norms, 1.0, atol=1e-3):
        raise MegaFaceDataError(
            f"{path}: features must be L2-normalised (row norms {norms.min():.3f}..{norms.max():.3f})"
        )
    return array


def shard_of(faces: FaceSet, shard: int, shards: int) -> FaceSet:
    """Every ``shards``-th image from ``shard`` on (interleaved: shards of equal size and mix)."""
    if not 0 <= shard < shards:
        raise MegaFaceDataError(f"shard must be in 0..{shards - 1}, got {shard}")
    keep = np.zeros(len(faces), dtype=bool)
    keep[shard::shards] = True
    shard_set = faces.subset(keep)
    shard_set.name = f"{faces.name}-shard{shard}of{shards}"
    return shard_set


def embed_distractor_shard(
    model_dir: str | Path,
    distractors: str | Path,
    shard: int,
    shards: int,
    out: str | Path,
    *,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    workers: int = 2,
    batch_size: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """One pod's share of a large distractor set: detect, align and embed every ``shards``-th
    image and write the L2-normalised features to ``out`` (``.npy``, float32) with a ``.json``
    beside it. The shards' files together are the whole set for ``--extra-features``."""
    from models.embedder import Embedder

    faces = shard_of(load_face_set(distractors, "distractors", probes=False), shard, shards)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    embedder = Embedder(model_dir, providers, batch_size=batch_size, intra_op_threads=0)
    marks, found = detect_landmarks(faces, cache, providers=providers, workers=workers, progress=progress)
    features = np.ascontiguousarray(
        embed_faces(
            faces, marks, ModelKey.of(model_dir), embedder, cache,
            batch_size=batch_size, workers=workers, progress=progress,
        ),
        dtype=np.float32,
    )  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial.npy")
    np.save(partial, features)
    partial.replace(out)  # a finished shard's file appears whole or not at all
    summary = {
        "model_id": embedder.manifest.model_id,
        "shard": shard,
        "shards": shards,
        "images": len(faces),
        "faces_found": int(found.sum()),
        "features": str(out),
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_megaface(
    model_dir: str | Path,
    *,
    protocol: str = "custom",
    data_dir: str | Path | None = None,
    probes: str | Path | None = None,
    distractors: str | Path | None = None,
    augment_to: int | None = None,
    extra_features: str | Path | Sequence[str | Path] | None = None,
    sizes: Sequence[int] | None = None,
    remove_probes: str | Path | None = None,
    remove_distractors: str | Path | None = None,
    max_per_identity: int | None = None,
    json_out: str | Path | None = None,
    plots_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    device: str = "cpu",
    chunk_mb: float = 256.0,
    workers: int = 2,
    batch_size: int = 64,
    seed: int = 0,
    detector: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the protocol end to end; returns (and writes to ``json_out``) every number.

    ``protocol``: ``local`` (:data:`LOCAL_PROTOCOL` from ``data_dir``), ``megaface`` (FaceScrub
    probes and MegaFace distractors given as ``probes`` / ``distractors``: the papers' numbers are
    comparable) or ``custom`` (any other sets).
    """
    from models.embedder import Embedder

    started = time.perf_counter()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    if protocol not in PROTOCOLS:
        raise MegaFaceDataError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if protocol == "local":
        if data_dir is None:
            raise MegaFaceDataError("--protocol local needs --data (the ../shared/data folder)")
        if probes is not None or distractors is not None:
            raise MegaFaceDataError(
                "--protocol local builds its own probes and distractors; drop --probes/--distractors"
            )
        probe_set, distractor_set = local_protocol(data_dir)
        max_per_identity = LOCAL_MAX_PER_IDENTITY
    else:
        if probes is None:
            raise MegaFaceDataError(f"--protocol {protocol} needs --probes (a folder per identity or a list)")
        probe_set = load_face_set(probes, "probes", probes=True)
        distractor_set = (
            load_face_set(distractors, "distractors", probes=False)
            if distractors is not None
            else FaceSet("distractors", [], [])
        )
    probe_set = cap_per_identity(probe_set, max_per_identity)
    if len(probe_set) == 0:
        raise MegaFaceDataError("no probe identity has two or more images")
    removed_p = removed_mask(probe_set.keys, read_removal_list(remove_probes)) if remove_probes else None
    removed_d = (
        removed_mask(distractor_set.keys, read_removal_list(remove_distractors))
        if remove_distractors
        else None
    )

    embedder = Embedder(model_dir, providers, batch_size=batch_size, intra_op_threads=0)
    model = ModelKey.of(model_dir)
    loaded = time.perf_counter()

    probe_marks, probe_found = detect_landmarks(
        probe_set, cache, detector=detector, providers=providers, workers=workers, progress=progress
    )
    probe_features = np.asarray(
        embed_faces(
            probe_set,
            probe_marks,
            model,
            embedder,
            cache,
            batch_size=batch_size,
            workers=workers,
            progress=progress,
        )
    )
    parts: list[np.ndarray] = []
    marks = np.zeros((0, 5, 2), np.float32)
    distractor_found = np.zeros(0, dtype=bool)
    if len(distractor_set):
        marks, distractor_found = detect_landmarks(
            distractor_set, cache, detector=detector, providers=providers, workers=workers, progress=progress
        )
        parts.append(
            embed_faces(
                distractor_set,
                marks,
                model,
                embedder,
                cache,
                batch_size=batch_size,
                workers=workers,
                progress=progress,
            )
        )
    embedded_real = time.perf_counter()
    n_augmented = 0
    if augment_to is not None and augment_to > len(distractor_set):
        n_augmented = augment_to - len(distractor_set)
        augmented, _ = embed_augmented(
            distractor_set,
            marks,
            n_augmented,
            model,
            embedder,
            cache,
            seed=seed,
            batch_size=batch_size,
            workers=workers,
            progress=progress,
        )
        parts.append(augmented)
    embedded = time.perf_counter()
    n_extra = 0
    extra_files = [extra_features] if isinstance(extra_features, str | Path) else list(extra_features or [])
    for file in extra_files:  # e.g. the shards of embed_distractor_shard, in their order
        extra = load_feature_file(file, embedder.output_size)
        parts.append(extra)
        n_extra += len(extra)
    pool = _Stacked(parts) if parts else np.zeros((0, embedder.output_size), np.float32)
    total = len(pool)
    if removed_d is not None:
        removed_d = np.concatenate([removed_d, np.zeros(total - len(removed_d), dtype=bool)])
    chosen_sizes = distractor_sizes(total, sizes)
    order = np.random.default_rng(seed).permutation(total)
    result = search_distractors(
        probe_features,
        pool,
        order,
        chosen_sizes,
        removed_probes=removed_p,
        removed_distractors=removed_d,
        chunk_mb=chunk_mb,
        device=device,
        progress=progress,
    )
    results = summarise(probe_features, probe_set.identities or [], result)
    finished = time.perf_counter()

    description = {
        "local": LOCAL_PROTOCOL_DESCRIPTION,
        "megaface": "MegaFace Challenge 1 (FaceScrub probes, MegaFace distractors) run by this job",
        "custom": "the MegaFace Challenge 1 rule on the probe and distractor sets named here",
    }[protocol]
    report: dict[str, Any] = {
        "benchmark": "MegaFace Challenge 1 protocol (identification and verification)",
        "protocol": LOCAL_PROTOCOL if protocol == "local" else protocol,
        "protocol_description": description,
        "rules": {
            "identification": "each probe image g in a gallery with N distractors, searched with every other "
            "image of its identity; rank = 1 + distractors scoring strictly higher than g",
            "verification": "genuine = unordered probe pairs of one identity; impostor = probe x "
            "distractor; threshold = (k+1)-th highest impostor score, k = floor(FAR * n_impostor); "
            "accept if score > threshold",
            "sizes": "nested: the first N distractors of one random order (seed)",
            "cleaned": "removed probe images leave the probe set; removed distractors stay counted "
            "but score -inf",
        },
        "model_id": model.model_id,
        "model_dir": str(model_dir),
        "model_digest": model.digest,
        "embedding_size": embedder.output_size,
        "provider": embedder.provider,
        "search_device": device,
        "probes": {
            "source": str(data_dir if protocol == "local" else probes),
            "images": len(probe_set),
            "identities": len(set(probe_set.identities or [])),
            "max_per_identity": max_per_identity,
            "no_face_images": int((~probe_found).sum()),
            "removed": None if removed_p is None else int(removed_p.sum()),
        },
        "distractors": {
            "source": str(data_dir if protocol == "local" else distractors),
            "images": len(distractor_set),
            "no_face_images": int((~distractor_found).sum()),
            "augmented": n_augmented,
            "augmentation": AUGMENTATION_DESCRIPTION if n_augmented else None,
            "extra_features": None
            if not extra_files
            else {"file": ", ".join(str(f) for f in extra_files), "rows": n_extra},
            "total": total,
            "removed": None if removed_d is None else int(removed_d.sum()),
            "order_seed": seed,
        },
        "sizes": chosen_sizes,
        "fars": [far_label(f) for f in VERIFICATION_FARS],
        "top_k": TOP_K,
        "results": results,
        "no_face_policy": "MTCNN face nearest the centre; no face: O-Net landmarks in the central box "
        "(as LFW detect)",
        "timing_s": {
            "total": finished - started,
            "load": loaded - started,
            "faces_real": embedded_real - loaded,
            "faces_augmented": embedded - embedded_real,
            "search": result.seconds,
            "metrics": finished - started - (loaded - started) - (embedded - loaded) - result.seconds,
        },
        "peak_rss_gib": _peak_rss_gib(),
        "chunk_mb": chunk_mb,
        "cache_dir": str(cache),
        "started_at": started_at,
        "host": {"cpus": os.cpu_count()},
    }
    if json_out is not None:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    if plots_dir is not None:
        from training.evaluation.megaface_report import write_plots

        report["plots"] = [str(p) for p in write_plots(report, plots_dir)]
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A short human summary of :func:`run_megaface`'s report."""
    d = report["distractors"]
    lines = [
        f"MegaFace protocol {report['protocol']}: model {report['model_id']}; "
        f"{report['probes']['images']} probe images of {report['probes']['identities']} identities; "
        f"{d['total']} distractors "
        f"({d['images']} images, {d['augmented']} augmented)",
    ]
    for variant, res in report["results"].items():
        for size in report["sizes"]:
            ident = res["identification"][str(size)]
            tar = res["verification"][str(size)]["tar_at_far"]
            tars = ", ".join(f"{100 * v:.2f}% @ {k}" for k, v in tar.items() if v is not None) or "-"
            lines.append(
                f"  {variant:7s} N={size:>9,}  rank-1 {100 * ident['rank1']:6.2f}%  rank-10 "
                f"{100 * ident['rank10']:6.2f}%  TAR {tars}"
            )
    t = report["timing_s"]
    lines.append(
        f"took {t['total']:.1f} s (faces {t['faces_real'] + t['faces_augmented']:.1f} s, "
        f"search {t['search']:.1f} s); "
        f"peak RSS {report['peak_rss_gib']:.2f} GiB"
    )
    return lines
