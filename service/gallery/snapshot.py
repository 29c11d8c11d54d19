"""One copy of a model's gallery vectors per machine: snapshots that every worker maps read-only.

Without snapshots each worker of ``sphereface serve --workers N`` loads the whole gallery from
Redis into its own float32 matrix: N copies (2 GB each at 1M faces of 512 numbers). With a
snapshot folder (``SPHEREFACE_GALLERY_SNAPSHOTS``; ``sphereface serve`` picks one under
``/dev/shm`` when it starts several workers), the first worker to load a model's gallery writes
it to a snapshot file there, and every worker (itself included) maps that file read-only: the
operating system keeps one copy in memory, shared by all of them.

A snapshot is immutable and belongs to one gallery epoch and one revision. A worker applies the
changes after it from the change stream to a small private *delta* (added faces as rows of its
own; removed or replaced snapshot faces masked): :class:`service.gallery.index.LayeredIndex`.
When a delta grows past :data:`COMPACT_FACES` (or a tenth of the snapshot), the worker that gets
the folder's lock first writes a new snapshot of its current state; every worker switches to the
newest snapshot at its next search (at most once per :data:`CHECK_SECONDS`), re-applying the
stream from the snapshot's position. Older snapshot files are unlinked; a worker still mapping
one keeps it alive until it switches.

Files of a snapshot ``rev-<revision>`` (written under temporary names, renamed, and the ``.json``
last: a snapshot without its ``.json`` does not exist):

* ``.vectors.npy``: float32 ``(faces, dim)``;
* ``.codes.npy``: uint8 ``(faces, dim)``, the int8 scan's codes (service/gallery/int8_scan.py),
  for vectors of at most ``INT8_SCAN_MAX_DIM`` numbers;
* ``.ids.npy``, ``.sorted_ids.npy``, ``.order.npy``: the face ids (fixed-width bytes) by row,
  sorted, and the row of each sorted one (a face's row is a binary search);
* ``.subjects.npy``: int32 subject code per row, into ``.subject_names.txt`` (one per line);
* ``.json``: revision, stream position, counts, the int8 bound's residual and norm.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from service.gallery import int8_scan

#: Faces in a worker's delta (added, or masked in the snapshot) that make it write a new snapshot
#: (or a tenth of the snapshot's faces, whichever is more).
COMPACT_FACES = 50_000
#: How often a worker looks for a newer snapshot than the one it maps (seconds).
CHECK_SECONDS = 1.0
#: Snapshots kept per model and epoch (the newest; older ones are unlinked).
KEEP = 2
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class SnapshotMeta:
    model_id: str
    epoch: str
    revision: int
    last_entry: str
    faces: int
    dim: int
    has_codes: bool
    max_residual: float
    max_norm: float

    @property
    def stem(self) -> str:
        return snapshot_stem(self.revision)


@dataclass
class Snapshot:
    """A mapped snapshot: read-only arrays (the ids too, so a worker keeps almost nothing of its own)."""

    meta: SnapshotMeta
    vectors: np.ndarray
    codes: np.ndarray | None
    face_ids: MappedIds
    subject_codes: np.ndarray  # int32 per row, into subject_names
    subject_names: list[str]


class MappedIds:
    """The face ids of a snapshot's rows: ``ids[row]`` -> str, ``get(face_id)`` -> row or None.

    Fixed-width byte strings, mapped; a lookup is a binary search in the sorted copy."""

    def __init__(self, by_row: np.ndarray, sorted_ids: np.ndarray, order: np.ndarray) -> None:
        self._by_row, self._sorted, self._order = by_row, sorted_ids, order

    def __len__(self) -> int:
        return len(self._by_row)

    def __getitem__(self, row: int | slice) -> str | list[str]:
        if isinstance(row, slice):
            return [face.decode() for face in self._by_row[row]]
        return self._by_row[row].decode()

    def __iter__(self) -> Iterator[str]:
        for face in self._by_row:
            yield face.decode()

    def get(self, face_id: str) -> int | None:
        if not len(self._sorted):
            return None
        key = face_id.encode()
        pos = int(np.searchsorted(self._sorted, key))
        if pos < len(self._sorted) and self._sorted[pos] == key:
            return int(self._order[pos])
        return None

    def __contains__(self, face_id: str) -> bool:
        return self.get(face_id) is not None


def snapshot_stem(revision: int) -> str:
    """The file name stem of the snapshot of ``revision``: ``rev-<12 digits>`` (sorts by revision)."""
    return f"rev-{revision:012d}"


def _fill(
    vectors: np.ndarray,
    codes: np.ndarray | None,
    chunks: Iterable[tuple[Sequence[str], Sequence[str], np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, list[str], float, float]:
    """Copy ``chunks`` into ``vectors`` (and their int8 codes into ``codes``); returns the face ids
    (fixed-width bytes), the subject code of every row, the subject names, and the int8 bound's
    largest residual and row norm."""
    faces = len(vectors)
    step = int8_scan.code_step(vectors.shape[1])
    max_residual = max_norm = 0.0
    row = 0
    ids: list[str] = []
    subjects = np.empty(faces, dtype=np.int32)
    code_of: dict[str, int] = {}
    for face_ids, subject_ids, part in chunks:
        part = np.asarray(part, dtype=np.float32)
        if row + len(part) > faces:
            raise ValueError(f"snapshot of {faces} faces got more")
        vectors[row : row + len(part)] = part
        if codes is not None and len(part):
            codes[row : row + len(part)], residual = int8_scan.quantize_rows(part, step)
            max_residual = max(max_residual, float(residual.max()))
            max_norm = max(max_norm, float(np.linalg.norm(part, axis=1).max()))
        ids.extend(face_ids)
        subjects[row : row + len(part)] = [code_of.setdefault(s, len(code_of)) for s in subject_ids]
        row += len(part)
    if row != faces:
        raise ValueError(f"snapshot of {faces} faces got {row}")
    by_row = np.array([face.encode() for face in ids], dtype=bytes) if ids else np.zeros(0, "S1")
    return by_row, subjects, list(code_of), max_residual, max_norm


def allocate_npy(path: Path, dtype: type, shape: tuple[int, int]) -> np.ndarray:
    """A new .npy file of ``shape``, its space reserved first, mapped for writing.

    The reservation (``posix_fallocate``) makes a full /dev/shm an OSError here: writing
    through a mapping into a file that cannot grow would kill the process with SIGBUS instead."""
    dtype = np.dtype(dtype)
    with open(path, "wb") as f:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(f, header)
        offset = f.tell()
        size = int(np.prod(shape)) * dtype.itemsize
        if size == 0:
            return np.empty(shape, dtype)  # nothing to write (an empty array cannot be mapped)
        os.posix_fallocate(f.fileno(), 0, offset + size)
    return np.memmap(path, dtype, "r+", offset=offset, shape=shape)


def default_root(workers: int) -> Path | None:
    """Where ``sphereface serve`` puts snapshots: a fresh folder in /dev/shm with several workers."""
    if workers < 2 or not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        return None
    return SHM / f"sphereface-gallery-{os.getpid()}"


class SnapshotFolder:
    """The snapshots of one model of one gallery epoch under ``root``."""

    def __init__(self, root: Path, model_id: str, epoch: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", model_id)
        self.path = Path(root) / f"{safe}-{epoch}"
        self.model_id, self.epoch = model_id, epoch

    @contextlib.contextmanager
    def lock(self, blocking: bool = True) -> Iterator[bool]:
        """The folder's exclusive lock (across processes); yields False when not blocking and taken."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / "lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def latest(self) -> SnapshotMeta | None:
        """The newest complete snapshot, or None."""
        try:
            names = sorted(p for p in os.listdir(self.path) if p.startswith("rev-") and p.endswith(".json"))
        except FileNotFoundError:
            return None
        for name in reversed(names):
            try:
                return SnapshotMeta(**json.loads((self.path / name).read_text()))
            except (OSError, ValueError, TypeError):
                continue  # unlinked meanwhile, or not ours: try the next
        return None

    def open(self, meta: SnapshotMeta) -> Snapshot | None:
        """Map a snapshot read-only (None when it was unlinked meanwhile)."""
        base = self.path / meta.stem
        mode = "r" if meta.faces else None  # an empty array cannot be mapped

        def load(name: str) -> np.ndarray:
            return np.load(f"{base}.{name}.npy", mmap_mode=mode, allow_pickle=False)

        try:
            vectors = load("vectors")
            codes = load("codes") if meta.has_codes else None
            ids = MappedIds(load("ids"), load("sorted_ids"), load("order"))
            subject_codes = load("subjects")
            subject_names = Path(f"{base}.subject_names.txt").read_text(encoding="utf-8").split("\n")[:-1]
        except FileNotFoundError:
            return None
        if (
            vectors.shape != (meta.faces, meta.dim)
            or len(ids) != meta.faces
            or len(subject_codes) != meta.faces
        ):
            raise ValueError(f"snapshot {base} does not match its description")
        return Snapshot(meta, vectors, codes, ids, subject_codes, subject_names)

    def write(
        self,
        revision: int,
        last_entry: str,
        faces: int,
        dim: int,
        chunks: Iterable[tuple[Sequence[str], Sequence[str], np.ndarray]],
        with_codes: bool,
    ) -> SnapshotMeta:
        """Write a snapshot of ``faces`` rows given in ``chunks`` of (face ids, subject ids,
        float32 vectors); the caller holds :meth:`lock`. Then unlink all but the newest KEEP."""
        stem = snapshot_stem(revision)
        base, tmp = self.path / stem, f".tmp-{os.getpid()}"
        self.path.mkdir(parents=True, exist_ok=True)
        with self._removed_on_error(stem, tmp):
            vectors = allocate_npy(Path(f"{base}.vectors{tmp}"), np.float32, (faces, dim))
            codes = allocate_npy(Path(f"{base}.codes{tmp}"), np.uint8, (faces, dim)) if with_codes else None
            ids, subjects, names, max_residual, max_norm = _fill(vectors, codes, chunks)
            order = np.argsort(ids, kind="stable")
            small = {"ids": ids, "sorted_ids": ids[order], "order": order, "subjects": subjects}
            for name, array in small.items():
                with open(f"{base}.{name}{tmp}", "wb") as f:
                    np.save(f, array, allow_pickle=False)
            Path(f"{base}.subject_names{tmp}").write_text("".join(f"{n}\n" for n in names), encoding="utf-8")
            for array in (vectors, codes):
                if isinstance(array, np.memmap):
                    array.flush()
            for name in ("vectors", "codes", *small):
                if name != "codes" or codes is not None:
                    os.replace(f"{base}.{name}{tmp}", f"{base}.{name}.npy")
            os.replace(f"{base}.subject_names{tmp}", f"{base}.subject_names.txt")
            meta = SnapshotMeta(
                self.model_id,
                self.epoch,
                revision,
                last_entry,
                faces,
                dim,
                with_codes,
                max_residual,
                max_norm,
            )
            Path(f"{base}.json{tmp}").write_text(json.dumps(asdict(meta)))
            os.replace(f"{base}.json{tmp}", f"{base}.json")  # the snapshot exists from here on
        self._prune()
        return meta

    @contextlib.contextmanager
    def _removed_on_error(self, stem: str, tmp: str) -> Iterator[None]:
        """Unlink the half-written files of snapshot ``stem`` when writing it fails."""
        try:
            yield
        except BaseException:
            for name in os.listdir(self.path):
                if name.startswith(stem) and name.endswith(tmp):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path / name)
            raise

    def _prune(self) -> None:
        """Unlink all but the newest KEEP snapshots, and files a crashed writer left."""
        names = os.listdir(self.path)
        stems = sorted({p.split(".", 1)[0] for p in names if p.startswith("rev-") and p.endswith(".json")})
        keep = set(stems[-KEEP:])
        for name in names:
            if name.startswith("rev-") and name.split(".", 1)[0] not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / name)


def remove_stale_roots(shm: Path = SHM) -> list[Path]:
    """Delete the snapshot roots of ``sphereface serve`` processes that are gone (killed before
    they could clean up: /dev/shm is memory until the machine restarts); returns them."""
    removed = []
    for root in shm.glob("sphereface-gallery-*") if shm.is_dir() else []:
        pid = root.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
        except PermissionError:
            pass  # alive, another user's
    return removed


def remove_root(root: Path) -> None:
    """Delete a snapshot root (``sphereface serve`` does at exit: /dev/shm is memory)."""
    shutil.rmtree(root, ignore_errors=True)
