"""The pool of unknown faces in Redis: kept faces of one model, each in a cluster.

Keys (``P`` is the prefix; ``T`` the hash tag ``{unknowns:<model_id>}``, so that every key of one
model's pool is in one slot of a Redis Cluster and each change is one Lua script there):

* ``P T:face:<face_id>`` hash: ``cluster``, ``ts`` (seconds since the epoch), ``created_at``,
  ``embedding`` (float32 little-endian), ``source``, ``photo_sha256``, ``box``, ``landmarks``,
  ``detection_score``, and, from a photo, ``region`` (JPEG) and ``region_landmarks``.
* ``P T:faces`` sorted set of face ids by ``ts`` (retention drops the oldest first).
* ``P T:rev`` the pool's revision; ``P T:changes`` a capped stream with one entry per change
  (``rev``, ``op`` add/remove, ``face``, ``cluster``), from which each worker keeps its
  :class:`~service.unknowns.clustering.PoolView` current without reloading everything.

A face is added only against the revision its cluster was chosen at: when another worker changed
the pool in between, the script answers ``stale`` and the face is assigned again on the newer
pool. So the workers of a service, and several services on one Redis, cluster as one would.
Writes go through :class:`~service.gallery.writes.ScriptWriter`: acknowledged after ``WAIT`` as the
gallery's are, and retried through a cluster's passing refusals (a repeated add finds its face and
reports it done).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
from redis.cluster import RedisCluster

from service.errors import REDIS_DOWN_ERRORS, ServiceError, redis_unavailable
from service.gallery.face_images import FaceRegion
from service.gallery.store import now_iso
from service.gallery.writes import ScriptWriter, Write, WritePolicy
from service.unknowns.clustering import PoolView

log = logging.getLogger(__name__)

#: The change stream keeps about this many entries; a worker further behind reloads the pool.
STREAM_MAXLEN = 100_000
#: Faces past the retention limits that one change removes (the rest go with the next changes).
EVICT_BATCH = 100
#: Tries of an add that keeps meeting a pool changed by another worker, before 503.
ADD_TRIES = 20

_DROP = """
local function drop(base, fid, maxlen)
  local fkey = base .. 'face:' .. fid
  local c = redis.call('HGET', fkey, 'cluster')
  redis.call('ZREM', base .. 'faces', fid)
  if not c then return 0 end
  redis.call('DEL', fkey)
  local rev = redis.call('INCR', base .. 'rev')
  redis.call('XADD', base .. 'changes', 'MAXLEN', '~', maxlen, '*', 'rev', rev, 'op', 'remove',
    'face', fid, 'cluster', c)
  return 1
end
local function evict(base, max_faces, min_ts, maxlen, batch)
  local old = redis.call('ZRANGEBYSCORE', base .. 'faces', '-inf', '(' .. min_ts, 'LIMIT', 0, batch)
  local n = 0
  for _, fid in ipairs(old) do n = n + drop(base, fid, maxlen) end
  local over = redis.call('ZCARD', base .. 'faces') - max_faces
  if over > 0 then
    for _, fid in ipairs(redis.call('ZRANGE', base .. 'faces', 0, math.min(over, batch) - 1)) do
      n = n + drop(base, fid, maxlen)
    end
  end
  return n
end
"""

_ADD = (
    _DROP
    + """
-- KEYS: rev (the slot); ARGV: base, expected rev, face id, cluster id, ts, created_at, embedding,
-- source, photo_sha256, box, landmarks, detection_score, region, region landmarks, max faces,
-- min ts, stream maxlen, evict batch
local base = ARGV[1]
local fkey = base .. 'face:' .. ARGV[3]
if redis.call('EXISTS', fkey) == 1 then return {'ok', redis.call('GET', KEYS[1])} end
local rev = tonumber(redis.call('GET', KEYS[1]) or '0')
if rev ~= tonumber(ARGV[2]) then return {'stale', tostring(rev)} end
redis.call('HSET', fkey, 'cluster', ARGV[4], 'ts', ARGV[5], 'created_at', ARGV[6], 'embedding', ARGV[7],
  'source', ARGV[8], 'photo_sha256', ARGV[9], 'box', ARGV[10], 'landmarks', ARGV[11],
  'detection_score', ARGV[12])
if ARGV[13] ~= '' then redis.call('HSET', fkey, 'region', ARGV[13], 'region_landmarks', ARGV[14]) end
redis.call('ZADD', base .. 'faces', ARGV[5], ARGV[3])
rev = redis.call('INCR', KEYS[1])
redis.call('XADD', base .. 'changes', 'MAXLEN', '~', ARGV[17], '*', 'rev', rev, 'op', 'add',
  'face', ARGV[3], 'cluster', ARGV[4])
evict(base, tonumber(ARGV[15]), ARGV[16], ARGV[17], tonumber(ARGV[18]))
return {'ok', tostring(rev)}
"""
)

_REMOVE = (
    _DROP
    + """
-- KEYS: rev (the slot); ARGV: base, stream maxlen, face ids...
local n = 0
for i = 3, #ARGV do n = n + drop(ARGV[1], ARGV[i], ARGV[2]) end
return n
"""
)

_EVICT = (
    _DROP
    + """
-- KEYS: rev (the slot); ARGV: base, max faces, min ts, stream maxlen, evict batch
return evict(ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5]))
"""
)

_CHANGES = """
-- KEYS: rev, changes; ARGV: the last stream id seen ('': none wanted): the revision, the stream's
-- last id and the entries after the one seen
local entries = {}
if ARGV[1] ~= '' then
  entries = redis.call('XRANGE', KEYS[2], '(' .. ARGV[1], '+', 'COUNT', 10000)
end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id = false
if last[1] then id = last[1][1] end
return {redis.call('GET', KEYS[1]) or '0', id, entries}
"""


class UnknownClusterNotFoundError(ServiceError):
    code = "unknown_cluster_not_found"


class UnknownFaceNotFoundError(ServiceError):
    code = "unknown_face_not_found"


@dataclass
class KeptFace:
    """A face identify answered ``unknown`` for, to keep (a unit float32 embedding and its context)."""

    embedding: np.ndarray
    source: str
    photo_sha256: str = ""
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    region: FaceRegion | None = None


@dataclass
class UnknownFace:
    """A kept face as read back from Redis."""

    id: str
    cluster_id: str
    created_at: str
    source: str
    photo_sha256: str
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    has_image: bool = False
    embedding: np.ndarray | None = field(default=None, repr=False)
    region: FaceRegion | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Retention:
    """How many faces a model's pool keeps, and for how long (seconds)."""

    max_faces: int = 10_000
    max_age_s: float = 30 * 86400.0


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class MergeRule:
    """The threshold that joins a face to a cluster (a calibrated one of the model) and the
    false-merge rate measured for it on LFW (``unknown_clusters.json`` of the model folder)."""

    threshold: float
    far: float | None
    name: str
    false_merge_rate: float | None = None
    mixed_cluster_rate: float | None = None


#: The file of a model folder with the LFW clustering measurements (``bench/unknown_clusters.py``).
MEASURED_FILE = "unknown_clusters.json"


def merge_rule(manifest, name: str, model_dir: Path) -> MergeRule | None:
    """The rule of the model's threshold ``name`` (else identification, else verification; None
    without any), with its measured false-merge rate when the model folder has one."""
    for key in (name, "identification", "verification"):
        known = manifest.thresholds.get(key)
        if known is not None:
            break
    else:
        return None
    measured = Path(model_dir) / MEASURED_FILE
    numbers = json.loads(measured.read_text()) if measured.is_file() else {}
    rate = numbers.get("false_merge_rate", {}).get(key)
    mixed = numbers.get("mixed_cluster_rate", {}).get(key)
    return MergeRule(known.value, known.far, key, rate, mixed)


def pool_for(settings, manifest, client: redis.Redis | RedisCluster) -> UnknownPool | None:
    """The pool of the served model when ``SPHEREFACE_KEEP_UNKNOWN`` is on (None when off, or for
    a model without calibrated thresholds: its faces could not be clustered with a stated error)."""
    if not settings.keep_unknown:
        return None
    rule = merge_rule(manifest, settings.unknown_cluster_threshold, settings.model_dir)
    if rule is None:
        log.warning("model %s has no calibrated threshold: unknown faces are not kept", manifest.model_id)
        return None
    known = manifest.thresholds.get("identification") or manifest.thresholds["verification"]
    return UnknownPool(
        client,
        manifest.model_id,
        manifest.output_size,
        rule,
        known_threshold=known.value,
        prefix=settings.redis_prefix,
        retention=Retention(settings.unknown_max_faces, settings.unknown_max_age_days * 86400.0),
        policy=WritePolicy.from_settings(settings),
    )


class UnknownPool:
    """One model's pool of unknown faces in Redis, with this process's :class:`PoolView` of it."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        model_id: str,
        dim: int,
        rule: MergeRule,
        *,
        known_threshold: float,
        prefix: str = "sf:",
        retention: Retention | None = None,
        policy: WritePolicy | None = None,
    ) -> None:
        self.redis = client
        self.model_id = model_id
        #: the threshold that joins a face to a cluster
        self.rule = rule
        #: the identification threshold: a kept face that reaches it against an enrolled face leaves
        self.known_threshold = known_threshold
        self.retention = retention or Retention()
        self.base = f"{prefix}{{unknowns:{model_id}}}:"
        self.writer = ScriptWriter(client, policy or WritePolicy())
        self.view = PoolView(dim)
        self.revision = 0
        self._last_id: str | None = None
        self._lock = threading.Lock()
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)
        self._evict = client.register_script(_EVICT)
        self._changes = client.register_script(_CHANGES)

    @property
    def rev_key(self) -> str:
        return self.base + "rev"

    def face_key(self, face_id: str) -> str:
        return f"{self.base}face:{face_id}"

    # -- this process's view ---------------------------------------------------------------
    def refresh(self) -> int:
        """Bring :attr:`view` up to the pool in Redis; returns the revision."""
        with self._lock, _redis_errors("read the unknown faces"):
            return self._refresh()

    def _refresh(self) -> int:
        rev, last_id, entries = self._changes(
            keys=[self.rev_key, self.base + "changes"], args=[self._last_id or ""]
        )
        rev = int(rev)
        if rev == self.revision and self._last_id is not None:
            return rev
        changes = [{_s(k): _s(v) for k, v in zip(e[1][::2], e[1][1::2], strict=True)} for e in entries]
        follows = (
            bool(changes) and int(changes[0]["rev"]) == self.revision + 1 and int(changes[-1]["rev"]) == rev
        )
        if self._last_id is None or not follows:
            self._reload()
        else:
            self._apply(changes)
            self.revision, self._last_id = rev, _s(last_id)
        return self.revision

    def _reload(self) -> None:
        """Read the whole pool (its revision and stream position first: later entries replay)."""
        rev, last_id, _ = self._changes(keys=[self.rev_key, self.base + "changes"], args=[""])
        ids = [_s(f) for f in self.redis.zrange(self.base + "faces", 0, -1)]
        self.view.clear()
        self._load(ids)
        self.revision, self._last_id = int(rev), _s(last_id) or "0-0"

    def _load(self, ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for face_id in ids:
            pipe.hmget(self.face_key(face_id), "cluster", "ts", "embedding")
        for face_id, (cluster, ts, blob) in zip(ids, pipe.execute() if ids else [], strict=True):
            if cluster is not None:
                self.view.add(face_id, np.frombuffer(blob, "<f4"), _s(cluster), float(ts))

    def _apply(self, changes: list[dict[str, str]]) -> None:
        added = [c["face"] for c in changes if c["op"] == "add"]
        vectors = {}
        if added:
            pipe = self.redis.pipeline(transaction=False)
            for face_id in added:
                pipe.hmget(self.face_key(face_id), "ts", "embedding")
            vectors = dict(zip(added, pipe.execute(), strict=True))
        for change in changes:
            face_id = change["face"]
            if change["op"] == "remove":
                self.view.remove(face_id)
            elif vectors[face_id][1] is not None:  # None: removed again later in these changes
                ts, blob = vectors[face_id]
                self.view.add(face_id, np.frombuffer(blob, "<f4"), change["cluster"], float(ts))

    # -- changes ---------------------------------------------------------------------------
    def add(self, face: KeptFace) -> tuple[str, str]:
        """Keep a face: assign it a cluster on the current pool and store it; (face id, cluster id)."""
        face_id = "u" + secrets.token_hex(8)
        for _ in range(ADD_TRIES):
            with self._lock, _redis_errors("keep an unknown face"):
                rev = self._refresh()
                joined = self.view.assign(face.embedding, self.rule.threshold)
            cluster_id = joined or "c" + secrets.token_hex(6)
            (outcome,) = self._write(
                [Write(self._add, [self.rev_key], self._add_args(face, face_id, cluster_id, rev))]
            )
            if _s(outcome.reply[0]) == "ok":
                return face_id, cluster_id
        raise redis_unavailable(redis.ConnectionError("the pool kept changing"), "keep an unknown face")

    def _add_args(self, face: KeptFace, face_id: str, cluster_id: str, rev: int) -> list:
        now = time.time()
        region = face.region
        return [
            self.base, rev, face_id, cluster_id, repr(now), now_iso(),
            np.asarray(face.embedding, "<f4").tobytes(), face.source, face.photo_sha256,
            json.dumps(face.box), json.dumps(face.landmarks),
            "" if face.detection_score is None else repr(float(face.detection_score)),
            region.jpeg if region is not None else b"",
            json.dumps(region.landmarks.tolist()) if region is not None else "",
            self.retention.max_faces, repr(now - self.retention.max_age_s), STREAM_MAXLEN, EVICT_BATCH,
        ]  # fmt: skip

    def remove(self, face_ids: list[str]) -> int:
        """Remove faces from the pool; returns how many were there."""
        if not face_ids:
            return 0
        (outcome,) = self._write([Write(self._remove, [self.rev_key], [self.base, STREAM_MAXLEN, *face_ids])])
        return int(outcome.reply)

    def evict(self) -> int:
        """Apply the retention limits now (adds apply them too); returns the faces removed."""
        args = [self.base, self.retention.max_faces, repr(time.time() - self.retention.max_age_s)]
        (outcome,) = self._write([Write(self._evict, [self.rev_key], [*args, STREAM_MAXLEN, EVICT_BATCH])])
        return int(outcome.reply)

    def remove_matching(self, vectors: np.ndarray) -> list[str]:
        """Remove the pooled faces that now match one of ``vectors`` (faces just enrolled) at the
        identification threshold: identify would call them ``known`` now."""
        self.refresh()
        with self._lock:
            matched = self.view.matching(vectors, self.known_threshold)
        self.remove(matched)
        return matched

    def _write(self, writes: list[Write]):
        with _redis_errors("change the unknown faces"):
            return self.writer.run(writes)

    # -- reads -----------------------------------------------------------------------------
    def clusters(self) -> list[tuple[str, int]]:
        """(cluster id, faces) of the current pool, largest first."""
        self.refresh()
        with self._lock:
            return self.view.cluster_sizes()

    def cluster_face_ids(self, cluster_id: str) -> list[str]:
        """A cluster's face ids, oldest first (404 ``unknown_cluster_not_found`` when it has none)."""
        self.refresh()
        with self._lock:
            faces = self.view.members.get(cluster_id)
            if not faces:
                raise UnknownClusterNotFoundError(f"no unknown-face cluster {cluster_id!r}")
            return sorted(faces, key=lambda f: self.view.times[self.view.rows[f]])

    def representatives(self, cluster_id: str, count: int) -> list[str]:
        with self._lock:
            return self.view.representatives(cluster_id, count)

    def cluster_times(self, cluster_id: str) -> list[float]:
        """When the cluster's faces were seen (seconds since the epoch; empty when it has none)."""
        with self._lock:
            view = self.view
            return [view.times[view.rows[f]] for f in view.members.get(cluster_id, ())]

    def not_found(self, face_id: str) -> UnknownFaceNotFoundError:
        return UnknownFaceNotFoundError(f"no unknown face {face_id!r}")

    _FIELDS = (
        "cluster", "created_at", "source", "photo_sha256", "box", "landmarks", "detection_score",
        "region_landmarks",
    )  # fmt: skip

    def faces(
        self, face_ids: list[str], *, with_embedding: bool = False, with_region: bool = False
    ) -> list[UnknownFace]:
        """The stored faces of ``face_ids`` that still exist, in that order."""
        fields = self._FIELDS + ("embedding", "region")
        with _redis_errors("read the unknown faces"):
            pipe = self.redis.pipeline(transaction=False)
            for face_id in face_ids:
                pipe.hmget(self.face_key(face_id), *fields)
            rows = pipe.execute() if face_ids else []
        found = []
        for face_id, row in zip(face_ids, rows, strict=True):
            values = dict(zip(fields, row, strict=True))
            if values["cluster"] is None:
                continue
            region = None
            if with_region and values["region"]:
                region = FaceRegion(values["region"], np.asarray(json.loads(values["region_landmarks"])))
            found.append(
                UnknownFace(
                    id=face_id,
                    cluster_id=_s(values["cluster"]),
                    created_at=_s(values["created_at"]),
                    source=_s(values["source"]) or "",
                    photo_sha256=_s(values["photo_sha256"]) or "",
                    box=json.loads(values["box"]) if values["box"] else None,
                    landmarks=json.loads(values["landmarks"]) if values["landmarks"] else None,
                    detection_score=float(values["detection_score"]) if values["detection_score"] else None,
                    has_image=values["region_landmarks"] is not None,
                    embedding=np.frombuffer(values["embedding"], "<f4") if with_embedding else None,
                    region=region,
                )
            )
        return found

    def face(self, face_id: str, *, with_region: bool = False) -> UnknownFace:
        found = self.faces([face_id], with_region=with_region)
        if not found:
            raise self.not_found(face_id)
        return found[0]


class _redis_errors:
    """Redis failures inside as the typed 503 ``redis_unavailable``."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, REDIS_DOWN_ERRORS):
            raise redis_unavailable(exc, self.doing) from exc
        return False
