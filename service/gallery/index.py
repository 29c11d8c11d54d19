"""Exact identification search in process: a numpy matrix of one model's gallery vectors.

:class:`VectorIndex` holds the vectors and answers top-k *subjects* (a subject's score is the
cosine of its best-matching face). :class:`LiveIndex` keeps a VectorIndex equal to the gallery
in Redis: it reads the revision counter before a search and, when it moved, applies the entries
of the change stream after the last one it saw; a gap (the stream was trimmed past it) or a
revision it cannot explain makes it reload everything. On a Redis Cluster it does so for every
partition of the gallery (each has its own revision counter and change stream).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.errors import RedisUnavailableError
from service.gallery.int8_scan import Int8Scan
from service.gallery.snapshot import CHECK_SECONDS, COMPACT_FACES, Snapshot, SnapshotFolder, SnapshotMeta
from service.gallery.store import GalleryStore, _redis_errors, _s
from service.gallery.writes import retry_passing

log = logging.getLogger(__name__)


@dataclass
class SubjectHit:
    subject_id: str
    score: float  # cosine of the subject's best-matching face
    face_id: str  # that face


#: From this many faces on, :meth:`VectorIndex.search` scans an int8 copy of the vectors and
#: re-ranks exactly (service/gallery/int8_scan.py), for vectors of at most INT8_SCAN_MAX_DIM
#: numbers. Measured by bench/gallery_scan.py (docs/results/service.md, "Search at 10M faces"): at 128
#: numbers int8 is 2.0x faster than float32 at 1M faces and 2.9x at 10M; at 512 numbers ONNX
#: Runtime's one-column integer product is compute-bound and float32 is faster (0.86x).
INT8_SCAN_MIN_FACES = 1_000_000
INT8_SCAN_MAX_DIM = 256


class VectorIndex:
    """Unit vectors with face and subject ids; exact top-k subjects by max cosine.

    From ``int8_scan_min_faces`` faces on (and for at most :data:`INT8_SCAN_MAX_DIM` numbers per
    vector, unless ``int8_allowed`` is set), search scans an int8 copy of the vectors (built on
    the first such search, then kept current; a quarter of the float matrix's memory) and
    re-scores in float32 only the faces its error bound cannot rule out: the same top-k as brute
    force.
    """

    def __init__(
        self, dim: int, *, initial_capacity: int = 1024, int8_scan_min_faces: int | None = INT8_SCAN_MIN_FACES
    ) -> None:
        self.dim = dim
        self.int8_scan_min_faces = int8_scan_min_faces
        self.int8_allowed = dim <= INT8_SCAN_MAX_DIM
        self.read_only = False  # True over a snapshot (over_snapshot): search only
        self._int8: Int8Scan | None = None
        self._matrix = np.zeros((initial_capacity, dim), dtype=np.float32)
        self._face_ids: list[str] = []
        self._subject_codes = np.zeros(initial_capacity, dtype=np.int32)
        self._row: dict[str, int] = {}
        self._subject_code: dict[str, int] = {}
        self._subject_names: list[str] = []

    def __len__(self) -> int:
        return len(self._face_ids)

    def __contains__(self, face_id: str) -> bool:
        return face_id in self._row

    @property
    def nbytes(self) -> int:
        extra = self._int8.nbytes if self._int8 is not None else 0
        return self._matrix.nbytes + self._subject_codes.nbytes + extra

    def _reserve(self, size: int) -> None:
        capacity = self._matrix.shape[0]
        if size <= capacity:
            return
        capacity = max(size, int(capacity * 1.5))
        matrix = np.zeros((capacity, self.dim), dtype=np.float32)
        matrix[: len(self)] = self._matrix[: len(self)]
        codes = np.zeros(capacity, dtype=np.int32)
        codes[: len(self)] = self._subject_codes[: len(self)]
        self._matrix, self._subject_codes = matrix, codes
        if self._int8 is not None:
            self._int8.reserve(capacity, len(self))

    def _code(self, subject_id: str) -> int:
        code = self._subject_code.get(subject_id)
        if code is None:
            code = self._subject_code[subject_id] = len(self._subject_names)
            self._subject_names.append(subject_id)
        return code

    def add(self, face_ids: Sequence[str], subject_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Add faces; a face id already present gets its vector and subject replaced."""
        vectors = np.asarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if not len(face_ids) == len(subject_ids) == len(vectors):
            raise ValueError("face_ids, subject_ids and vectors must have the same length")
        self._reserve(len(self) + len(face_ids))
        rows = np.empty(len(face_ids), dtype=np.int64)
        for i, (face_id, subject_id, vector) in enumerate(zip(face_ids, subject_ids, vectors, strict=True)):
            row = self._row.get(face_id)
            if row is None:
                row = self._row[face_id] = len(self._face_ids)
                self._face_ids.append(face_id)
            self._matrix[row] = vector
            self._subject_codes[row] = self._code(subject_id)
            rows[i] = row
        if self._int8 is not None and len(rows):
            self._int8.set_rows(rows, self._matrix[rows])

    def remove(self, face_ids: Iterable[str]) -> None:
        """Remove faces (unknown ids are ignored): the last row moves into the gap."""
        for face_id in face_ids:
            row = self._row.pop(face_id, None)
            if row is None:
                continue
            last = len(self._face_ids) - 1
            if row != last:
                moved = self._face_ids[last]
                self._matrix[row] = self._matrix[last]
                self._subject_codes[row] = self._subject_codes[last]
                if self._int8 is not None:
                    self._int8.move_row(last, row)
                self._face_ids[row] = moved
                self._row[moved] = row
            self._face_ids.pop()

    def clear(self) -> None:
        self.__init__(self.dim, int8_scan_min_faces=self.int8_scan_min_faces)

    @classmethod
    def over_snapshot(cls, snapshot: Snapshot) -> VectorIndex:
        """A read-only index over a mapped snapshot: search it (with rows excluded), never change it.

        Vectors, int8 codes, face ids and subject codes all stay in the mapped files; the index
        holds only the subject names."""
        meta = snapshot.meta
        index = cls(meta.dim, initial_capacity=0)
        index._matrix = snapshot.vectors
        index._face_ids = snapshot.face_ids  # type: ignore[assignment]  (MappedIds: str by row)
        index._row = snapshot.face_ids  # type: ignore[assignment]  (.get / in, by binary search)
        index._subject_codes = snapshot.subject_codes
        index._subject_names = snapshot.subject_names
        if snapshot.codes is not None:
            index._int8 = Int8Scan.over(snapshot.codes, meta.max_residual, meta.max_norm)
        index.read_only = True
        return index

    def entries(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """(face id, subject id, vector) of every face."""
        for row, face_id in enumerate(self._face_ids):
            yield face_id, self._subject_names[int(self._subject_codes[row])], self._matrix[row]

    def chunks(self, size: int = 65_536) -> Iterator[tuple[list[str], list[str], np.ndarray]]:
        """The faces in chunks of (face ids, subject ids, vectors), for a snapshot."""
        names = self._subject_names
        for a in range(0, len(self), size):
            b = min(len(self), a + size)
            yield self._face_ids[a:b], [names[c] for c in self._subject_codes[a:b]], self._matrix[a:b]

    def search(
        self, queries: np.ndarray, k: int, excluded: np.ndarray | None = None
    ) -> list[list[SubjectHit]]:
        """Top-k subjects per query, best first (exact: the brute-force top-k, see the class);
        ``excluded``: rows to leave out (the masked faces of a snapshot)."""
        queries = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        n = len(self._face_ids)
        if n == 0 or k < 1:
            return [[] for _ in queries]
        if excluded is not None and not len(excluded):
            excluded = None
        limit = self.int8_scan_min_faces
        if limit is not None and n >= limit and self.int8_allowed:
            return [self._search_int8(query, k, excluded) for query in queries]
        scores = queries @ self._matrix[:n].T  # one pass over the matrix for all queries
        if excluded is not None:
            scores[:, excluded] = -np.inf
        return [self._top_subjects(row, k) for row in scores]

    def _search_int8(self, query: np.ndarray, k: int, excluded: np.ndarray | None) -> list[SubjectHit]:
        n = len(self._face_ids)
        if self._int8 is None:
            self._int8 = Int8Scan(self.dim, capacity=self._matrix.shape[0])
            self._int8.set_rows(np.arange(n), self._matrix[:n])
        rows = self._int8.candidates(query, n, self._subject_codes[:n], k, excluded=excluded)
        rows.sort()  # read the float rows in memory order
        return self._top_subjects(self._matrix[rows] @ query, k, rows)

    def _top_subjects(self, scores: np.ndarray, k: int, rows: np.ndarray | None = None) -> list[SubjectHit]:
        """The k best subjects given ``scores`` of all rows, or of the rows ``rows`` only (rows
        scored ``-inf`` are excluded ones)."""
        # With max aggregation the k best subjects are the first k distinct subjects in the
        # faces' score order, so it is enough to sort a candidate set that holds k of them.
        n = scores.shape[0]
        take = min(n, max(4 * k, 64))
        while True:
            top = np.argpartition(-scores, take - 1)[:take] if take < n else np.arange(n)
            top = top[np.argsort(-scores[top], kind="stable")]
            hits: list[SubjectHit] = []
            seen: set[int] = set()
            for i in top:
                if scores[i] == -np.inf:
                    return hits
                row = int(rows[i]) if rows is not None else int(i)
                code = int(self._subject_codes[row])
                if code in seen:
                    continue
                seen.add(code)
                hits.append(SubjectHit(self._subject_names[code], float(scores[i]), self._face_ids[row]))
                if len(hits) == k:
                    return hits
            if take >= n:
                return hits
            take = min(n, take * 4)


def merge_hits(parts: list[list[SubjectHit]], k: int) -> list[SubjectHit]:
    """The k best subjects of several top-k lists (a subject keeps its best face). Exact: a
    subject's best face is in one part, and there it is among that part's k best subjects."""
    best: dict[str, SubjectHit] = {}
    for hits in parts:
        for hit in hits:
            if hit.subject_id not in best or hit.score > best[hit.subject_id].score:
                best[hit.subject_id] = hit
    return sorted(best.values(), key=lambda h: -h.score)[:k]


class LayeredIndex:
    """A snapshot shared by the workers (read-only, mapped) and this worker's changes since.

    Faces added since the snapshot are rows of a small private :class:`VectorIndex` (the delta);
    faces removed or replaced since are masked in the snapshot. Search answers from both and
    merges (:func:`merge_hits`): the same top-k as one index of the live faces.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self.meta = snapshot.meta
        self.dim = snapshot.meta.dim
        self.base = VectorIndex.over_snapshot(snapshot)
        self.delta = VectorIndex(self.dim, int8_scan_min_faces=None)
        self._masked = np.zeros(snapshot.meta.faces, dtype=bool)
        self._masked_rows: np.ndarray | None = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.base._face_ids) - int(self.masked) + len(self.delta)

    def __contains__(self, face_id: str) -> bool:
        row = self.base._row.get(face_id)
        return (row is not None and not self._masked[row]) or face_id in self.delta

    @property
    def masked(self) -> int:
        return int(len(self._excluded()))

    @property
    def changes(self) -> int:
        """Faces that differ from the snapshot (masked there, or in the delta)."""
        return self.masked + len(self.delta)

    @property
    def nbytes(self) -> int:
        """This worker's own bytes (the snapshot's are shared)."""
        return self.delta.nbytes + self._masked.nbytes

    def _mask(self, face_ids: Sequence[str]) -> None:
        for face_id in face_ids:
            row = self.base._row.get(face_id)
            if row is not None and not self._masked[row]:
                self._masked[row] = True
                self._masked_rows = None

    def _excluded(self) -> np.ndarray:
        if self._masked_rows is None:
            self._masked_rows = np.flatnonzero(self._masked)
        return self._masked_rows

    def add(self, face_ids: Sequence[str], subject_ids: Sequence[str], vectors: np.ndarray) -> None:
        self._mask(face_ids)  # a replaced face's snapshot row
        self.delta.add(face_ids, subject_ids, vectors)

    def remove(self, face_ids: Iterable[str]) -> None:
        face_ids = list(face_ids)
        self._mask(face_ids)
        self.delta.remove(face_ids)

    def search(self, queries: np.ndarray, k: int) -> list[list[SubjectHit]]:
        base = self.base.search(queries, k, excluded=self._excluded())
        if not len(self.delta):
            return base
        delta = self.delta.search(queries, k)
        return [merge_hits([a, b], k) for a, b in zip(base, delta, strict=True)]

    def entries(self) -> Iterator[tuple[str, str, np.ndarray]]:
        for row, entry in enumerate(self.base.entries()):
            if not self._masked[row]:
                yield entry
        yield from self.delta.entries()

    def chunks(self, size: int = 65_536) -> Iterator[tuple[list[str], list[str], np.ndarray]]:
        """The live faces in chunks of (face ids, subject ids, vectors), for a new snapshot."""
        for a, (face_ids, subject_ids, vectors) in zip(
            range(0, len(self.base._face_ids), size), self.base.chunks(size), strict=True
        ):
            keep = ~self._masked[a : a + len(face_ids)]
            rows = np.flatnonzero(keep)
            yield [face_ids[r] for r in rows], [subject_ids[r] for r in rows], vectors[keep]
        yield from self.delta.chunks(size)


class LiveIndex:
    """A :class:`VectorIndex` of one model's faces, kept equal to the gallery in Redis.

    With ``snapshots`` (a folder, see service/gallery/snapshot.py), the faces live in a snapshot
    file that every worker of the machine maps read-only, plus this worker's changes since
    (:class:`LayeredIndex`): one copy of the vectors per machine instead of one per worker.
    Snapshots record one revision and stream position: a gallery of several partitions (on a
    Redis Cluster) is indexed without them, each worker holding its own copy.

    Per partition ``p`` of the gallery it keeps the revision reflected (``revisions[p]``), the
    last stream entry applied (``last_entries[p]``) and the epoch (``epochs[p]``).
    """

    def __init__(
        self,
        store: GalleryStore,
        model_id: str,
        dim: int,
        *,
        batch: int = 2000,
        snapshots: Path | None = None,
    ) -> None:
        self.store = store
        self.model_id = model_id
        self.dim = dim
        self.index: VectorIndex | LayeredIndex = VectorIndex(dim)
        partitions = store.partitions
        self.revisions = [-1] * partitions  # -1: nothing loaded yet
        self.epochs: list[bytes | None] = [None] * partitions
        self.last_entries = ["0-0"] * partitions
        self.full_reloads = 0  # loads of every face from Redis
        if snapshots and partitions > 1:
            log.warning("gallery snapshots are not used with %d partitions (Redis Cluster)", partitions)
            snapshots = None
        self.snapshot_root = Path(snapshots) if snapshots else None
        self.snapshot_loads = 0  # snapshots mapped (written by this worker or another)
        self.snapshots_written = 0
        self.batch = batch
        self._next_snapshot_check = 0.0
        self._lock = threading.RLock()
        # One refresh runs at a time; see refresh() for what the callers that arrive meanwhile do.
        self._attempts = threading.Condition()
        self._attempt = 0  # attempts begun
        self._running: int | None = None  # the attempt in flight
        self._failed: tuple[int, RedisUnavailableError] | None = None  # the last failed attempt

    def __len__(self) -> int:
        return len(self.index)

    @property
    def revision(self) -> int:
        """The gallery revision reflected: the sum of the partitions' (-1 before the first load)."""
        return -1 if min(self.revisions) < 0 else sum(self.revisions)

    @property
    def epoch(self) -> bytes | None:
        """The epoch of the gallery reflected (on a cluster: of its partitions, joined)."""
        if None in self.epochs:
            return None
        return self.epochs[0] if len(self.epochs) == 1 else b",".join(self.epochs)  # type: ignore[arg-type]

    @property
    def last_entry(self) -> str:
        """The last stream entry applied (of the first partition: the only one on one Redis)."""
        return self.last_entries[0]

    def refresh(self) -> int:
        """Bring the index up to date with Redis; returns the revision it now reflects.

        A caller that arrives while another refresh is in flight waits for it. When that one
        fails (Redis stalled or gone), the caller fails at once with the same answer instead of
        queueing for a timeout of its own, so k identifications on a stalled Redis take one
        timeout, not k. When it succeeds, the caller still asks Redis itself: the refresh began
        before the caller arrived and may predate a write the caller must see.

        Raises:
            RedisUnavailableError: Redis did not answer (here or in the refresh waited for).
        """
        with self._attempts:
            arrived_during = self._running
            while self._running is not None:
                self._attempts.wait()
            if arrived_during is not None and self._failed and self._failed[0] == arrived_during:
                raise RedisUnavailableError(self._failed[1].message)
            self._attempt += 1
            self._running = attempt = self._attempt
        try:
            revision = retry_passing(self._refresh, self.store)  # through a failover, on a cluster
        except RedisUnavailableError as exc:
            self._failed = (attempt, exc)
            raise
        finally:
            with self._attempts:
                self._running = None
                self._attempts.notify_all()
        return revision

    def _refresh(self) -> int:
        with self._lock, _redis_errors():
            positions = self.store.positions()
            stale = [
                p
                for p, (current, epoch) in enumerate(positions)
                if epoch != self.epochs[p] or current != self.revisions[p]
            ]
            # Reload when nothing is loaded yet; when a partition in Redis is another one (a new
            # epoch: flushed, or restored from a backup); when its revision went back; on a gap in
            # its stream; and when its stream holds no entries up to its revision (trimmed past
            # this worker: every change writes its entry with its rev).
            if stale and not all(self._catch_up(p, *positions[p]) for p in stale):
                self._reload(positions)
            self._follow_snapshots()
            return self.revision

    def _catch_up(self, partition: int, current: int, epoch: bytes) -> bool:
        """Apply a partition's new stream entries; False when only a reload can catch up."""
        return (
            epoch == self.epochs[partition]
            and current >= self.revisions[partition]
            and self._apply_changes(partition)
            and self.revisions[partition] >= current
        )

    # -- snapshots shared by the workers ---------------------------------------------------------

    def _folder(self, epoch: bytes | None) -> SnapshotFolder | None:
        """The snapshot folder of the gallery's epoch (snapshots only with one partition)."""
        if self.snapshot_root is None or epoch is None:
            return None
        return SnapshotFolder(self.snapshot_root, self.model_id, epoch.decode())

    def _map_snapshot(self, folder: SnapshotFolder, meta: SnapshotMeta, current: int) -> bool:
        """Switch to a snapshot and the stream after it; False (nothing changed) when it is gone
        or the stream no longer reaches back to it."""
        snapshot = folder.open(meta)
        if snapshot is None or snapshot.meta.dim != self.dim:
            return False
        state = self.index, self.revisions[0], self.last_entries[0], self.epochs[0]
        self.index, self.revisions[0], self.last_entries[0] = (
            LayeredIndex(snapshot),
            meta.revision,
            meta.last_entry,
        )
        self.epochs[0] = meta.epoch.encode()
        if not self._apply_changes(0) or self.revision < current:
            self.index, self.revisions[0], self.last_entries[0], self.epochs[0] = state
            return False
        self.snapshot_loads += 1
        log.info("gallery snapshot %s/%s mapped (%d faces)", folder.path, meta.stem, meta.faces)
        return True

    def _write_snapshot(self, folder: SnapshotFolder) -> None:
        """Write this worker's faces as the folder's newest snapshot and map it (lock held)."""
        started = time.perf_counter()
        try:
            meta = folder.write(
                self.revision,
                self.last_entry,
                len(self.index),
                self.dim,
                self.index.chunks(),
                with_codes=self.dim <= INT8_SCAN_MAX_DIM,
            )
        except OSError as exc:  # e.g. /dev/shm full (a container's default is 64 MB)
            log.warning(
                "gallery snapshot not written to %s (%s): this worker keeps its own copy of the vectors; "
                "give the folder more room (Docker: shm_size) or set SPHEREFACE_GALLERY_SNAPSHOTS",
                folder.path,
                exc,
            )
            self.snapshot_root = None
            return
        self.snapshots_written += 1
        log.info("gallery snapshot %s written in %.1f s", meta.stem, time.perf_counter() - started)
        self._map_snapshot(folder, meta, self.revision)

    def _follow_snapshots(self) -> None:
        """Map a newer snapshot of another worker; write one when this worker's delta is large."""
        folder = self._folder(self.epoch)
        if folder is None or time.monotonic() < self._next_snapshot_check:
            return
        self._next_snapshot_check = time.monotonic() + CHECK_SECONDS
        mapped = self.index.meta.revision if isinstance(self.index, LayeredIndex) else -1
        latest = folder.latest()
        if (
            latest is not None
            and latest.revision > mapped
            and self._map_snapshot(folder, latest, self.revision)
        ):
            return
        if not isinstance(self.index, LayeredIndex) or self.index.changes <= max(
            COMPACT_FACES, self.index.meta.faces // 10
        ):
            return
        with folder.lock(blocking=False) as locked:
            if locked:
                self._write_snapshot(folder)

    def _reload(self, positions: list[tuple[int, bytes]]) -> None:
        """Load every face: from the newest snapshot when the stream still reaches back to it,
        else from Redis (then written as a snapshot for the other workers)."""
        epochs = [epoch for _, epoch in positions]
        folder = self._folder(epochs[0]) if len(positions) == 1 else None
        if folder is None:
            self._load_from_redis(epochs)
            self._apply_all_changes()
            return
        with folder.lock():  # the other workers wait, then map what this one writes
            latest = folder.latest()
            if latest is not None and self._map_snapshot(folder, latest, positions[0][0]):
                return
            self._load_from_redis(epochs)
            self._apply_all_changes()
            self._write_snapshot(folder)

    def _apply_all_changes(self) -> None:
        for partition in range(len(self.revisions)):
            self._apply_changes(partition)

    def search(self, queries: np.ndarray, k: int) -> list[list[SubjectHit]]:
        self.refresh()
        with self._lock:
            return self.index.search(queries, k)

    def _apply_changes(self, partition: int) -> bool:
        """Apply a partition's stream entries after the last one applied; False on a gap (a
        reload is needed)."""
        r = self.store.redis
        key = self.store.changes_key_of(partition)
        while True:
            entries = r.xrange(key, min=f"({self.last_entries[partition]}", count=self.batch)
            if not entries:
                return True
            adds: dict[str, str] = {}
            for entry_id, fields in entries:
                rev = int(fields[b"rev"])
                if rev <= self.revisions[partition]:  # already reflected (seen during a reload)
                    self.last_entries[partition] = entry_id.decode()
                    continue
                if rev != self.revisions[partition] + 1:
                    log.warning(
                        "gallery change stream has a gap (%d -> %d): reloading",
                        self.revisions[partition],
                        rev,
                    )
                    self._flush_adds(adds)
                    return False
                if fields[b"model"].decode() == self.model_id:
                    face_id = fields[b"face"].decode()
                    if fields[b"op"] == b"add":
                        adds[face_id] = fields[b"subject"].decode()
                    else:
                        self._flush_adds(adds)
                        adds = {}
                        self.index.remove([face_id])
                self.revisions[partition] = rev
                self.last_entries[partition] = entry_id.decode()
            self._flush_adds(adds)
            if len(entries) < self.batch:
                return True

    def _flush_adds(self, adds: dict[str, str]) -> None:
        """Fetch and add faces named by stream entries (a face deleted since is skipped)."""
        if not adds:
            return
        pipe = self.store.redis.pipeline(transaction=False)
        for face_id in adds:
            pipe.hget(self.store.face_key(face_id), "embedding")
        vectors = pipe.execute()
        kept = [(f, s, v) for (f, s), v in zip(adds.items(), vectors, strict=True) if v is not None]
        if kept:
            self.index.add(
                [f for f, _, _ in kept],
                [s for _, s, _ in kept],
                np.stack([np.frombuffer(v, dtype="<f4") for _, _, v in kept]),
            )

    def _load_from_redis(self, epochs: list[bytes]) -> None:
        """Load every face of the model; remember the revision and stream position each partition
        reflects (read before its faces: the stream applies whatever changed meanwhile)."""
        started = time.perf_counter()
        r = self.store.redis
        pipe = r.pipeline(transaction=False)
        for p in range(len(epochs)):  # each partition's revision and last entry read together
            self.store.read_position(p, pipe)
        positions = pipe.execute()
        self.index = VectorIndex(self.dim)
        batch_ids: list[str] = []
        for p in range(len(epochs)):
            for face_id in r.sscan_iter(self.store.model_faces_key(self.model_id, p), count=self.batch):
                batch_ids.append(face_id.decode())
                if len(batch_ids) >= self.batch:
                    self._load_faces(batch_ids)
                    batch_ids = []
        self._load_faces(batch_ids)
        for p, (rev, last) in enumerate(positions):
            self.revisions[p] = int(rev or 0)
            self.last_entries[p] = _s(last) or "0-0"
        self.epochs = list(epochs)
        self.full_reloads += 1
        log.info(
            "gallery index loaded: %d faces of %s at revision %d in %.1f s",
            len(self.index),
            self.model_id,
            self.revision,
            time.perf_counter() - started,
        )

    def _load_faces(self, face_ids: list[str]) -> None:
        if not face_ids:
            return
        pipe = self.store.redis.pipeline(transaction=False)
        for face_id in face_ids:
            pipe.hmget(self.store.face_key(face_id), "subject", "embedding")
        rows = [(f, s, v) for f, (s, v) in zip(face_ids, pipe.execute(), strict=True) if v is not None]
        if rows:
            self.index.add(
                [f for f, _, _ in rows],
                [s.decode() for _, s, _ in rows],
                np.stack([np.frombuffer(v, dtype="<f4") for _, _, v in rows]),
            )
