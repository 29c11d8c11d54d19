"""The evaluation jobs' one on-disk cache of per-image landmarks and embeddings.

Everything lives under ``$SPHEREFACE_CACHE`` (default ``.cache``), keyed by what decides the
content, so a changed input is computed again rather than served stale, and guarded by a file lock
(:mod:`training.locks`), so two jobs started together take turns instead of racing:

* :class:`RowCache`: arrays of ``n`` rows filled in order and committed every few seconds, so an
  interrupted run resumes where it stopped. :func:`detect_landmarks` keeps the landmarks of a
  :class:`~training.evaluation.faces.FaceSet` there (model-independent), and
  :func:`embed_faces` (and the augmented distractors of MegaFace) its embeddings per model
  (:class:`ModelKey`). MegaFace, calibration and the flip-fusion study read them.
* One ``.npz`` file per LFW image list (:func:`detected_lfw_landmarks`): the float64 landmarks of
  LFW's detect mode, keyed by the images and the detector's full fingerprint (settings, provider,
  weights, code), read whole by the trainer's periodic LFW check.

The two keep their own layouts on purpose: the LFW file serves float64 landmarks under a key that
names every detector detail, while the row caches serve float32 landmarks under a detector tag;
serving one from the other would change the crops, so both stay, behind one module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import FacePathError
from training import locks
from training.evaluation.errors import MegaFaceDataError
from training.evaluation.faces import FaceSet
from training.evaluation.landmarks import central_box, detect_central_landmarks, make_detector
from training.evaluation.lfw_files import IMAGES_DIR
from training.evaluation.parallel import ordered_map, progress_bar

log = logging.getLogger(__name__)

#: Names the landmark rule of the row caches (part of their keys).
DETECTOR_TAG = "mtcnn-central-v1"

#: Bump when the meaning of a cached landmark file changes in a way no other key part captures.
LANDMARK_CACHE_VERSION = 1


def cache_root() -> Path:
    """``$SPHEREFACE_CACHE`` (default ``.cache``): the folder every evaluation cache lives under."""
    return Path(os.environ.get("SPHEREFACE_CACHE", ".cache"))


def default_cache_dir() -> Path:
    """``<cache root>/megaface``: the row caches of landmarks and embeddings."""
    return cache_root() / "megaface"


def default_landmark_cache_dir() -> Path:
    """``<cache root>/lfw_landmarks``: the landmark files of LFW's detect mode."""
    return cache_root() / "lfw_landmarks"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Resumable row caches: landmarks and embeddings of a face set
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
            for item in ordered_map(produce, range(self.done, self.n), workers, window=2 * batch_size):
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
        digest = hashlib.sha256(f"{file_sha256(model_dir / 'model.onnx')}\0{config}".encode()).hexdigest()
        return cls(model_dir, manifest.model_id, digest)

    @property
    def folder(self) -> str:
        return f"{self.model_id.replace('/', '_').replace('@', '-')}-{self.digest[:12]}"


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
            detector = make_detector(providers)

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


def cached_embeddings(
    folder: Path,
    meta: dict[str, Any],
    n: int,
    crop: Callable[[int], np.ndarray],
    embedder: Any,
    *,
    batch_size: int,
    workers: int,
    desc: str,
    progress: bool,
) -> np.ndarray:
    """``(n, D)`` L2-normalised fused embeddings of the crops ``crop(i)``, from the row cache in
    ``folder`` described by ``meta``; rows not there yet are embedded (in batches) and committed.
    Returns a memmap of the cache."""
    columns = {"features": ((embedder.output_size,), np.float32)}
    with RowCache(folder, meta, n, columns) as cache:

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

    return cached_embeddings(
        cache_dir / "features" / model.folder / f"{faces.name}-{digest[:16]}",
        {"set": faces.name, "digest": digest, "detector": DETECTOR_TAG, "model": model.digest},
        len(faces),
        crop,
        embedder,
        batch_size=batch_size,
        workers=workers,
        desc=f"embed {faces.name}",
        progress=progress,
    )


# --------------------------------------------------------------------------------------------
# LFW detect mode: one landmark file per image list
# --------------------------------------------------------------------------------------------


def _detector_key(providers: str | Sequence[str]) -> dict[str, Any]:
    """Everything that decides the landmarks :func:`make_detector` + :func:`detect_central_landmarks`
    place: the detector's settings (its constructor's defaults, which ``make_detector`` keeps),
    the execution provider, the MTCNN weights' and code's content, the face policy's code and the
    ONNX Runtime version."""
    import inspect

    import onnxruntime

    from models import mtcnn
    from models.mtcnn_convert import DEFAULT_MTCNN_DIR
    from models.runtime import resolve_providers

    settings = {
        name: list(p.default) if isinstance(p.default, tuple) else p.default
        for name, p in inspect.signature(mtcnn.MTCNNDetector.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in ("providers", "intra_op_threads")
    }
    policy = inspect.getsource(detect_central_landmarks) + inspect.getsource(central_box)
    return {
        "settings": settings,
        "provider": resolve_providers(providers)[0],
        "weights_sha256": {
            n: sha256_hex((DEFAULT_MTCNN_DIR / f"{n}.onnx").read_bytes()) for n in ("pnet", "rnet", "onet")
        },
        "mtcnn_code_sha256": sha256_hex(Path(mtcnn.__file__).read_bytes()),
        "policy_code_sha256": sha256_hex(policy.encode()),
        "onnxruntime": onnxruntime.__version__,
    }


def detected_landmarks_key(
    data_dir: str | Path, names: Sequence[str], providers: str | Sequence[str] = "cpu"
) -> dict[str, Any]:
    """The cache key of :func:`detected_lfw_landmarks`: the LFW folder's resolved path, the image
    names with each file's size and modification time, and :func:`_detector_key`."""
    images = Path(data_dir).resolve() / IMAGES_DIR
    listing = hashlib.sha256()
    for name in names:
        stat = (images / name).stat()
        listing.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {
        "version": LANDMARK_CACHE_VERSION,
        "lfw_dir": str(Path(data_dir).resolve()),
        "n_images": len(names),
        "images_sha256": listing.hexdigest(),
        "detector": _detector_key(providers),
    }


def _load_landmark_cache(
    path: Path, key_json: str, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != key_json or data["names"].tolist() != list(names):
                log.warning("LFW landmark cache %s has another key; detecting again", path)
                return None
            points, found = data["landmarks"], data["found"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("LFW landmark cache %s is unreadable (%s); detecting again", path, exc)
        return None
    if points.shape != (len(names), 5, 2) or found.shape != (len(names),):
        return None
    return points.astype(np.float64), found.astype(bool)


def _save_landmark_cache(
    path: Path, key_json: str, names: Sequence[str], points: np.ndarray, found: np.ndarray
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        np.savez(f, key=np.array(key_json), names=np.array(list(names)), landmarks=points, found=found)
    os.replace(temporary, path)


def detected_lfw_landmarks(
    data_dir: str | Path,
    names: Sequence[str],
    *,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    workers: int = 2,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, Path]:
    """Our MTCNN's landmarks of LFW images, as :func:`run_lfw_evaluation`'s detect mode places them.

    :func:`detect_central_landmarks` (face nearest the centre; O-Net in :func:`central_box` when
    no face is found) with the detector of :func:`make_detector`, on the images ``names``
    (relative to ``images/``). The result is cached in ``cache_dir`` (default
    :func:`default_landmark_cache_dir`) as ``<key digest>.npz``; the key
    (:func:`detected_landmarks_key`) covers the folder, the images and the detector, and is
    checked in full on load, so a changed input is detected again rather than served stale.

    Returns:
        ``(n, 5, 2)`` float64 landmarks, ``(n,)`` found flags (False: the central-box fallback)
        and the cache file's path.
    """
    data_dir = Path(data_dir)
    key_json = json.dumps(detected_landmarks_key(data_dir, names, providers), sort_keys=True)
    folder = Path(cache_dir) if cache_dir is not None else default_landmark_cache_dir()
    path = folder / f"{sha256_hex(key_json.encode())[:24]}.npz"
    folder.mkdir(parents=True, exist_ok=True)
    # Two jobs started together (make loss-table trains two at a time) take turns: the second
    # finds the first one's file instead of detecting the same landmarks again.
    with locks.exclusive(path.with_suffix(".lock"), f"detecting the LFW landmarks of {path.name}"):
        return _cached_or_detected(path, key_json, data_dir, names, providers, workers, progress)


def _cached_or_detected(
    path: Path,
    key_json: str,
    data_dir: Path,
    names: Sequence[str],
    providers: str | Sequence[str],
    workers: int,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray, Path]:
    """The landmarks from ``path`` when it holds them, else detected and written there."""
    from models.image import read_image

    started = time.perf_counter()
    cached = _load_landmark_cache(path, key_json, names)
    if cached is not None:
        log.info(
            "LFW landmarks of %d images loaded from %s in %.2f s",
            len(names),
            path,
            time.perf_counter() - started,
        )
        return cached[0], cached[1], path

    detector = make_detector(providers)

    def work(name: str) -> tuple[np.ndarray, bool]:
        return detect_central_landmarks(detector, read_image(data_dir / IMAGES_DIR / name))

    points = np.empty((len(names), 5, 2), dtype=np.float64)
    found = np.empty(len(names), dtype=bool)
    stream = ordered_map(work, names, workers, window=4 * max(workers, 1))
    for i, (p, ok) in enumerate(progress_bar(stream, len(names), "detect LFW", progress)):
        points[i], found[i] = p, ok
    _save_landmark_cache(path, key_json, names, points, found)
    log.info(
        "LFW landmarks of %d images detected in %.1f s (%d without a face), cached in %s",
        len(names), time.perf_counter() - started, int((~found).sum()), path,
    )  # fmt: skip
    return points, found, path
