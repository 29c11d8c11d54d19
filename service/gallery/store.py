"""The gallery in Redis: subjects and faces, changed atomically, every change on a stream.

Keys (``P`` is the prefix, ``sf:`` by default):

* ``P subject:{id}`` hash: ``id``, ``name``, ``metadata`` (JSON), ``created_at``, ``updated_at``;
  ``P subjects`` sorted set of subject ids by creation time (for paging);
  ``P subject-faces:{id}`` set of the subject's face ids. (Before version 0.3 this set was
  ``P subject:{id}:faces``, which the subject ``{id}:faces`` could collide with;
  :func:`migrate_subject_faces_keys` renames such sets once.)
* ``P face:{face_id}`` hash: ``subject``, ``embedding`` (float32 little-endian bytes),
  ``model_id``, ``photo_sha256``, ``created_at``, ``box``, ``landmarks`` (JSON),
  ``detection_score``, ``source`` (``photo`` or ``embedding``).
* ``P model:{model_id}:faces`` set of the face ids made by one model (a worker loads only its
  own model's vectors: vectors of different models are never compared).
* ``P photo:{model_id}:{sha256}``: the face id enrolled from that photo (duplicates rejected).
* ``P epoch``: a random id of this gallery dataset (a flushed or restored Redis gets a new one).
* ``P rev``: the gallery revision, incremented by every change; ``P changes``: a stream with one
  entry per change (``rev``, ``op`` add/remove, ``face``, ``subject``, ``model``), so every
  worker can bring its in-process index up to date without reloading everything.

Every change runs as one Lua script, so a face, its sets, the revision and the stream entry are
written together or not at all. The scripts go through :mod:`service.gallery.writes`: a change is
acknowledged once enough replicas have it (``WAIT``), and a cluster's passing refusals are retried.

On a Redis Cluster the same keys exist once per partition, under the partition's hash tag
(``P{g07.41}:subject:{id}``, ``P{g07.41}:rev``, ...; see :mod:`service.gallery.partitions`): a
subject, its faces and everything a script touches for them share one slot. Whatever spans the
gallery (listing and counting subjects, statistics, the revision) reads every partition.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from service.errors import (
    REDIS_DOWN_ERRORS,
    DuplicatePhotoError,
    FaceNotFoundError,
    InvalidEmbeddingError,
    InvalidRequestError,
    ServiceError,
    SubjectExistsError,
    SubjectNotFoundError,
    redis_unavailable,
)
from service.gallery import partitions as parts
from service.gallery.face_images import FaceRegion
from service.gallery.writes import Outcome, ScriptWriter, Write, WritePolicy, retried_read

#: The change stream keeps about this many entries; a worker further behind reloads fully.
STREAM_MAXLEN = 1_000_000
#: The layout of the gallery's keys; 2: a subject's face set is ``P subject-faces:{id}``.
GALLERY_SCHEMA = 2
#: Subjects whose names one pipelined round trip reads while searching the subject list.
SEARCH_BATCH = 1000

_ADD_FACE = """
-- KEYS: subject, subject faces, face, model faces, photo, rev, changes, subjects
-- ARGV: face_id, subject_id, model_id, sha256, created_at, embedding, box, landmarks,
--       detection_score, source, max_faces, stream_maxlen, region jpeg, region landmarks,
--       create ('1': a missing subject is created with this face), subject score, quality
local create = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[15] ~= '1' then return {'subject_not_found', ''} end
  create = 1
end
local existing = redis.call('GET', KEYS[5])
if existing then return {'duplicate_photo', existing} end
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[11]) then return {'too_many_faces', ''} end
if create == 1 then
  redis.call('HSET', KEYS[1], 'id', ARGV[2], 'name', '', 'metadata', '{}', 'created_at', ARGV[5],
    'updated_at', ARGV[5])
  redis.call('ZADD', KEYS[8], ARGV[16], ARGV[2])
end
redis.call('SET', KEYS[5], ARGV[1])
redis.call('HSET', KEYS[3], 'subject', ARGV[2], 'model_id', ARGV[3], 'photo_sha256', ARGV[4],
  'created_at', ARGV[5], 'embedding', ARGV[6], 'box', ARGV[7], 'landmarks', ARGV[8],
  'detection_score', ARGV[9], 'source', ARGV[10])
if ARGV[13] ~= '' then
  redis.call('HSET', KEYS[3], 'region', ARGV[13], 'region_landmarks', ARGV[14])
end
if ARGV[17] ~= '' then redis.call('HSET', KEYS[3], 'quality', ARGV[17]) end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
local rev = redis.call('INCR', KEYS[6])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[12], '*', 'rev', rev, 'op', 'add', 'face', ARGV[1],
  'subject', ARGV[2], 'model', ARGV[3])
return {'ok', tostring(rev), create}
"""

_REMOVE_FACES = """
-- KEYS: rev, changes; ARGV: prefix, stream_maxlen, face ids...
-- Removes each face with its set memberships and photo key; one stream entry per face.
local p = ARGV[1]
local removed = 0
for i = 3, #ARGV do
  local fid = ARGV[i]
  local fkey = p .. 'face:' .. fid
  local f = redis.call('HMGET', fkey, 'subject', 'model_id', 'photo_sha256')
  if f[1] then
    redis.call('DEL', fkey)
    redis.call('SREM', p .. 'subject-faces:' .. f[1], fid)
    redis.call('SREM', p .. 'model:' .. f[2] .. ':faces', fid)
    local pkey = p .. 'photo:' .. f[2] .. ':' .. f[3]
    if redis.call('GET', pkey) == fid then redis.call('DEL', pkey) end
    local rev = redis.call('INCR', KEYS[1])
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'rev', rev, 'op', 'remove', 'face', fid,
      'subject', f[1], 'model', f[2])
    removed = removed + 1
  end
end
return removed
"""

_CREATE_SUBJECT = """
-- KEYS: subject, subjects; ARGV: id, name, metadata, created_at, score
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'name', ARGV[2], 'metadata', ARGV[3], 'created_at', ARGV[4],
  'updated_at', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
return 1
"""

_UPDATE_SUBJECT = """
-- KEYS: subject; ARGV: field, value, ...
if redis.call('HEXISTS', KEYS[1], 'created_at') == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

_DELETE_SUBJECT = """
-- KEYS: subject, subject faces, subjects; ARGV: subject_id
-- Deletes the subject record once its faces are gone (the caller removes them first).
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('SCARD', KEYS[2]) > 0 then return -2 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

_POSITION = """
-- KEYS: rev, changes: the revision and the id of the stream's last entry, read together
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id = false
if last[1] then id = last[1][1] end
return {redis.call('GET', KEYS[1]), id}
"""

SUBJECT_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@:")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def check_subject_id(subject_id: str) -> str:
    """Subject ids: 1-128 characters of letters, digits and ``_ . - @ :``, not only dots (``.``
    and ``..`` are path segments that URLs drop, RFC 3986 §5.2.4: such a subject could never be
    read, changed or deleted by its URL; ``...`` goes with them to keep the rule plain)."""
    if (
        not 1 <= len(subject_id) <= 128
        or not set(subject_id) <= SUBJECT_ID_CHARS
        or not subject_id.strip(".")
    ):
        raise InvalidRequestError(
            f"subject id {subject_id[:140]!r} is not valid: use 1-128 letters, digits or _ . - @ :, "
            "not only dots"
        )
    return subject_id


def embedding_sha256(vector: np.ndarray) -> str:
    """The duplicate key of a face enrolled as an embedding: hash of its float32 bytes."""
    return hashlib.sha256(np.asarray(vector, dtype="<f4").tobytes()).hexdigest()


def check_embedding(values: Sequence[float] | np.ndarray, dim: int) -> np.ndarray:
    """A client-supplied embedding as a unit float32 vector of the model's size (typed errors)."""
    vector = np.asarray(values, dtype=np.float32).reshape(-1)
    if vector.shape[0] != dim:
        raise InvalidEmbeddingError(
            f"an embedding must have {dim} values for this model, got {vector.shape[0]}"
        )
    if not np.all(np.isfinite(vector)):
        raise InvalidEmbeddingError("an embedding must contain only finite numbers")
    # The norm in float64: in float32 the squares of values over ~1.8e19 overflow to inf, and the
    # vector divided by an infinite norm would come back as all zeros.
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    if norm < 1e-6:
        raise InvalidEmbeddingError("an embedding must not be all zeros")
    return (vector.astype(np.float64) / norm).astype(np.float32)


@dataclass
class Subject:
    id: str
    name: str | None
    metadata: dict[str, Any]
    created_at: str
    updated_at: str
    #: faces of the model the counts were asked for (``model_id``); all faces when none was
    face_count: int = 0
    #: faces of every model (a gallery enrolled with several models)
    face_count_all_models: int = 0


@dataclass
class NewFace:
    """A face to enroll: its embedding (unit float32) and where it came from."""

    embedding: np.ndarray
    photo_sha256: str
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    source: str = "photo"
    #: the region around the face (JPEG) and its landmarks there, to re-embed for another model
    region: FaceRegion | None = None
    #: the face's quality in [0, 1] (:mod:`models.quality`); None for an embedding
    quality: float | None = None


@dataclass
class FaceRecord:
    id: str
    subject_id: str
    model_id: str
    photo_sha256: str
    created_at: str
    source: str
    box: list[float] | None = None
    landmarks: list[list[float]] | None = None
    detection_score: float | None = None
    quality: float | None = None
    #: whether the region around the face is stored (``face_region``)
    has_region: bool = False
    embedding: np.ndarray | None = field(default=None, repr=False)
    #: the subject was created with this face (``add_faces_bulk(create_subjects=True)``)
    subject_created: bool = field(default=False, repr=False)


@dataclass
class GalleryStats:
    subjects: int
    faces: int
    revision: int


def _s(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class GalleryStore:
    """Subjects and faces in one Redis or a Redis Cluster (see the module docstring for the layout).

    ``partitions``: how many partitions the gallery has; by default one on a Redis (the keys
    without hash tags) and :data:`service.gallery.partitions.CLUSTER_PARTITIONS` on a
    :class:`~redis.cluster.RedisCluster` client. ``policy``: how many replicas confirm a write
    before it is acknowledged, and how long a cluster's passing refusals are retried."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        prefix: str = "sf:",
        *,
        max_faces_per_subject: int = 1000,
        partitions: int | None = None,
        policy: WritePolicy | None = None,
    ) -> None:
        self.redis = client
        #: how writes are acknowledged (WAIT) and, on a cluster, retried (:mod:`service.gallery.writes`)
        self.policy = policy or WritePolicy()
        self.writer = ScriptWriter(client, self.policy)
        self.prefix = prefix
        self.max_faces_per_subject = max_faces_per_subject
        self.cluster = isinstance(client, RedisCluster)
        self.partitions = partitions or (parts.CLUSTER_PARTITIONS if self.cluster else 1)
        if self.partitions < 1:
            raise ValueError(f"a gallery has at least one partition, not {self.partitions}")
        self.prefixes = parts.partition_prefixes(prefix, self.partitions)
        # A gallery of several partitions is written in this layout from the start: nothing older.
        self._schema_checked = self.partitions > 1
        self._create_subject = client.register_script(_CREATE_SUBJECT)
        self._update_subject = client.register_script(_UPDATE_SUBJECT)
        self._add_face = client.register_script(_ADD_FACE)
        self._remove_faces = client.register_script(_REMOVE_FACES)
        self._delete_subject = client.register_script(_DELETE_SUBJECT)
        self._position = client.register_script(_POSITION)

    def ensure_schema(self) -> int:
        """Bring an older gallery's keys to :data:`GALLERY_SCHEMA` (once per process and dataset)."""
        if self._schema_checked:
            return 0
        moved = migrate_subject_faces_keys(self.redis, self.prefix)
        self._schema_checked = True
        return moved

    # -- keys -------------------------------------------------------------------------------
    def partition_of(self, subject_or_face_id: str) -> int:
        """The partition of a subject, or of a face (a face id hashes to its subject's)."""
        return parts.partition_of(subject_or_face_id, self.partitions)

    def key(self, partition: int, name: str) -> str:
        """Key ``name`` of a partition (``P name`` on one Redis)."""
        return f"{self.prefixes[partition]}{name}"

    def subject_key(self, subject_id: str) -> str:
        return self.key(self.partition_of(subject_id), f"subject:{subject_id}")

    def subject_faces_key(self, subject_id: str) -> str:
        # Not "subject:{id}:faces": the subject "{id}:faces" would have that key for its hash.
        return self.key(self.partition_of(subject_id), f"subject-faces:{subject_id}")

    def face_key(self, face_id: str) -> str:
        return self.key(self.partition_of(face_id), f"face:{face_id}")

    def model_faces_key(self, model_id: str, partition: int = 0) -> str:
        return self.key(partition, f"model:{model_id}:faces")

    def photo_key(self, model_id: str, sha256: str, partition: int = 0) -> str:
        return self.key(partition, f"photo:{model_id}:{sha256}")

    def subjects_key_of(self, partition: int) -> str:
        return self.key(partition, "subjects")

    def rev_key_of(self, partition: int) -> str:
        return self.key(partition, "rev")

    def epoch_key_of(self, partition: int) -> str:
        return self.key(partition, "epoch")

    def changes_key_of(self, partition: int) -> str:
        return self.key(partition, "changes")

    @property
    def subjects_key(self) -> str:
        """The subject list of the first (on one Redis: the only) partition."""
        return self.subjects_key_of(0)

    @property
    def rev_key(self) -> str:
        return self.rev_key_of(0)

    @property
    def epoch_key(self) -> str:
        return self.epoch_key_of(0)

    @property
    def changes_key(self) -> str:
        return self.changes_key_of(0)

    def new_face_id(self, subject_id: str) -> str:
        """A random face id in the subject's partition."""
        return parts.new_face_id(self.partition_of(subject_id), self.partitions)

    def _script(self, script: Script, keys: list, args: list, pipe: Any = None) -> Any:
        """Run ``script`` (queued on ``pipe`` when given). A cluster pipeline sends the script's
        text (EVAL): a primary that took over from a replica may not have it cached for EVALSHA."""
        if pipe is not None and self.cluster:
            return pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=pipe)

    def _write(self, writes: list[Write]) -> list[Outcome]:
        """Run change scripts through :attr:`writer` (a Redis that fails answers a typed 503)."""
        with _redis_errors():
            return self.writer.run(writes)

    # -- subjects ---------------------------------------------------------------------------
    def create_subject(
        self, subject_id: str | None = None, name: str | None = None, metadata: dict[str, Any] | None = None
    ) -> Subject:
        subject_id = check_subject_id(subject_id) if subject_id is not None else secrets.token_hex(8)
        created = now_iso()
        partition = self.partition_of(subject_id)
        keys = [self.subject_key(subject_id), self.subjects_key_of(partition)]
        args = [subject_id, name or "", json.dumps(metadata or {}), created, repr(time.time())]
        (outcome,) = self._write([Write(self._create_subject, keys, args)])
        done = outcome.reply
        if not done and outcome.maybe_repeated:
            # a lost reply: the subject is ours when it has our creation time
            with _redis_errors():
                done = _s(self.redis.hget(keys[0], "created_at")) == created
        if not done:
            raise SubjectExistsError(f"subject {subject_id!r} already exists")
        return Subject(subject_id, name, metadata or {}, created, created, 0, 0)

    def ensure_subjects(self, subject_ids: Sequence[str]) -> list[str]:
        """Create the subjects that do not exist yet, faces or not; returns those created."""
        created = []
        for sid in dict.fromkeys(subject_ids):
            try:
                self.create_subject(sid)
                created.append(sid)
            except SubjectExistsError:
                pass
        return created

    def _queue_counts(self, pipe: redis.client.Pipeline, subject_id: str, model_id: str | None) -> int:
        """Queue a subject's face counts (all models, then ``model_id``'s); returns how many."""
        pipe.scard(self.subject_faces_key(subject_id))
        if model_id is None:
            return 1
        partition = self.partition_of(subject_id)
        pipe.sintercard(2, [self.subject_faces_key(subject_id), self.model_faces_key(model_id, partition)])
        return 2

    @retried_read
    def get_subject(self, subject_id: str, model_id: str | None = None) -> Subject:
        """A subject with its face counts: all models', and ``model_id``'s when given."""
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.subject_key(subject_id))
            self._queue_counts(pipe, subject_id, model_id)
            record, *counts = pipe.execute()
        if not record or b"created_at" not in record:
            raise SubjectNotFoundError(f"subject {subject_id!r} does not exist")
        return self._subject(record, counts)

    @staticmethod
    def _subject(record: dict[bytes, bytes], counts: Sequence[int]) -> Subject:
        total = int(counts[0])
        return Subject(
            id=record[b"id"].decode(),
            name=record.get(b"name", b"").decode() or None,
            metadata=json.loads(record.get(b"metadata", b"{}")),
            created_at=record[b"created_at"].decode(),
            updated_at=record.get(b"updated_at", record[b"created_at"]).decode(),
            face_count=int(counts[1]) if len(counts) > 1 else total,
            face_count_all_models=total,
        )

    @retried_read
    def subject_names(self, subject_ids: Sequence[str]) -> dict[str, str | None]:
        if not subject_ids:
            return {}
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for sid in subject_ids:
                pipe.hget(self.subject_key(sid), "name")
            names = pipe.execute()
        return {sid: (_s(n) or None) for sid, n in zip(subject_ids, names, strict=True)}

    @retried_read
    def list_subjects(
        self, offset: int = 0, limit: int = 50, model_id: str | None = None, query: str | None = None
    ) -> tuple[list[Subject], int]:
        """A page of subjects in creation order (face counts as :meth:`get_subject`), and the total.

        ``query`` keeps the subjects whose id or name contains it (case-insensitive); the total is
        then the number of matches. Searching reads every subject's name (in pipelined batches of
        :data:`SEARCH_BATCH`): fine for thousands of subjects, linear in their number.
        """
        if offset < 0 or limit < 1:
            # ZRANGE 0 -1 would be the whole set, and negative offsets count from the end.
            raise InvalidRequestError(f"offset must be >= 0 and limit >= 1, not {offset} and {limit}")
        if query and query.strip():
            matches = self.search_subject_ids(query)
            total, ids = len(matches), matches[offset : offset + limit]
        elif self.partitions == 1:
            with _redis_errors():
                total = self.redis.zcard(self.subjects_key)
                ids = [i.decode() for i in self.redis.zrange(self.subjects_key, offset, offset + limit - 1)]
        else:
            total, ids = self._subject_page(offset, limit)
        return self._subjects(ids, model_id), total

    def _subject_page(self, offset: int, limit: int) -> tuple[int, list[str]]:
        """The total and a page of subject ids in creation order, merged from every partition
        (each gives its first ``offset + limit``: the page is among them)."""
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for p in range(self.partitions):
                pipe.zcard(self.subjects_key_of(p))
                pipe.zrange(self.subjects_key_of(p), 0, offset + limit - 1, withscores=True)
            replies = pipe.execute()
        total = sum(int(n) for n in replies[::2])
        merged = sorted((score, sid.decode()) for part in replies[1::2] for sid, score in part)
        return total, [sid for _, sid in merged[offset : offset + limit]]

    def subject_ids(self, batch: int = SEARCH_BATCH) -> Iterator[str]:
        """Every subject id: each partition's in creation order, one partition after another
        (read ``batch`` at a time; a walk over the gallery that needs no global order)."""
        for partition in range(self.partitions):
            key = self.subjects_key_of(partition)
            start = 0
            while True:
                with _redis_errors():
                    ids = self.redis.zrange(key, start, start + batch - 1)
                yield from (sid.decode() for sid in ids)
                if len(ids) < batch:
                    break
                start += batch

    @retried_read
    def search_subject_ids(self, query: str) -> list[str]:
        """Ids of the subjects whose id or name contains ``query`` (case-insensitive), in creation order."""
        needle = query.strip().casefold()
        found: list[tuple[float, str]] = []
        with _redis_errors():
            for partition in range(self.partitions):
                found += self._search_partition(partition, needle)
        return [sid for _, sid in sorted(found)]

    def _search_partition(self, partition: int, needle: str) -> list[tuple[float, str]]:
        """(creation score, id) of a partition's subjects whose id or name contains ``needle``."""
        found = []
        start = 0
        key = self.subjects_key_of(partition)
        while True:
            batch = self.redis.zrange(key, start, start + SEARCH_BATCH - 1, withscores=True)
            if not batch:
                return found
            pipe = self.redis.pipeline(transaction=False)
            for sid, _ in batch:
                pipe.hget(self.subject_key(sid.decode()), "name")
            names = pipe.execute()
            for (sid, score), name in zip(batch, names, strict=True):
                sid = sid.decode()
                if needle in sid.casefold() or needle in (_s(name) or "").casefold():
                    found.append((score, sid))
            start += SEARCH_BATCH

    def _subjects(self, ids: Sequence[str], model_id: str | None) -> list[Subject]:
        """The subjects ``ids`` (those deleted meanwhile left out), with their face counts."""
        per_subject = 1
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for sid in ids:
                pipe.hgetall(self.subject_key(sid))
                per_subject = 1 + self._queue_counts(pipe, sid, model_id)
            replies = pipe.execute() if ids else []
        subjects = []
        for i in range(len(ids)):
            record, *counts = replies[per_subject * i : per_subject * (i + 1)]
            if record and b"created_at" in record:
                subjects.append(self._subject(record, counts))
        return subjects

    def update_subject(
        self,
        subject_id: str,
        name: str | None = None,
        metadata: dict[str, Any] | None = None,
        model_id: str | None = None,
    ) -> Subject:
        key = self.subject_key(subject_id)
        fields: dict[str, str] = {"updated_at": now_iso()}
        if name is not None:
            fields["name"] = name
        if metadata is not None:
            fields["metadata"] = json.dumps(metadata)
        flat = [item for pair in fields.items() for item in pair]
        # One script: the update cannot resurrect a subject deleted meanwhile (and setting the
        # same fields twice is harmless, should a lost reply make it run again).
        (outcome,) = self._write([Write(self._update_subject, [key], flat)])
        if not outcome.reply:
            raise SubjectNotFoundError(f"subject {subject_id!r} does not exist")
        return self.get_subject(subject_id, model_id)

    def delete_subject(self, subject_id: str) -> int:
        """Delete a subject and all its faces; returns how many faces went with it."""
        self.get_subject(subject_id)
        removed = 0
        with _redis_errors():
            while True:
                face_ids = [f.decode() for f in self.redis.smembers(self.subject_faces_key(subject_id))]
                if face_ids:
                    removed += self.remove_faces(face_ids)
                keys = [
                    self.subject_key(subject_id),
                    self.subject_faces_key(subject_id),
                    self.subjects_key_of(self.partition_of(subject_id)),
                ]
                (outcome,) = self._write([Write(self._delete_subject, keys, [subject_id])])
                if outcome.reply != -2:  # -2: a face was enrolled meanwhile; remove it too
                    break
        return removed

    # -- faces ------------------------------------------------------------------------------
    def add_faces(
        self, subject_id: str, model_id: str, faces: Sequence[NewFace]
    ) -> list[FaceRecord | ServiceError]:
        """Enroll faces for one subject; one result per face (a record or a typed error)."""
        return self.add_faces_bulk([(subject_id, face) for face in faces], model_id)

    def _add_face_keys(self, subject_id: str, face_id: str, model_id: str, sha256: str) -> list[str]:
        """The keys of the add-face script, all in the subject's partition."""
        partition = self.partition_of(subject_id)
        return [
            self.subject_key(subject_id),
            self.subject_faces_key(subject_id),
            self.face_key(face_id),
            self.model_faces_key(model_id, partition),
            self.photo_key(model_id, sha256, partition),
            self.rev_key_of(partition),
            self.changes_key_of(partition),
            self.subjects_key_of(partition),
        ]

    def add_faces_bulk(
        self, items: Sequence[tuple[str, NewFace]], model_id: str, *, create_subjects: bool = False
    ) -> list[FaceRecord | ServiceError]:
        """Enroll (subject id, face) pairs in one round trip; each is atomic on its own.

        ``create_subjects``: a subject that does not exist is created together with its first face
        that is stored (that record has ``subject_created``), never without one; otherwise its
        faces get ``subject_not_found``. The caller checks the ids (:func:`check_subject_id`)."""
        created = now_iso()
        score = repr(time.time())
        face_ids = [self.new_face_id(subject_id) for subject_id, _ in items]
        writes = [
            Write(
                self._add_face,
                self._add_face_keys(subject_id, face_id, model_id, face.photo_sha256),
                [
                    face_id,
                    subject_id,
                    model_id,
                    face.photo_sha256,
                    created,
                    np.asarray(face.embedding, dtype="<f4").tobytes(),
                    json.dumps(face.box),
                    json.dumps(face.landmarks),
                    "" if face.detection_score is None else repr(float(face.detection_score)),
                    face.source,
                    self.max_faces_per_subject,
                    STREAM_MAXLEN,
                    face.region.jpeg if face.region is not None else b"",
                    json.dumps(face.region.landmarks.tolist()) if face.region is not None else "",
                    "1" if create_subjects else "0",
                    score,
                    "" if face.quality is None else repr(float(face.quality)),
                ],
            )
            for face_id, (subject_id, face) in zip(face_ids, items, strict=True)
        ]
        replies = [outcome.reply for outcome in self._write(writes)]
        results: list[FaceRecord | ServiceError] = []
        for face_id, (subject_id, face), (status, detail, *made) in zip(
            face_ids, items, replies, strict=True
        ):
            status = _s(status)
            if status == "duplicate_photo" and _s(detail) == face_id:
                status = "ok"  # this very add ran before and its reply was lost: done once
            if status == "ok":
                results.append(
                    FaceRecord(
                        id=face_id,
                        subject_id=subject_id,
                        model_id=model_id,
                        photo_sha256=face.photo_sha256,
                        created_at=created,
                        source=face.source,
                        box=face.box,
                        landmarks=face.landmarks,
                        detection_score=face.detection_score,
                        quality=face.quality,
                        has_region=face.region is not None,
                        subject_created=bool(made and int(made[0])),
                    )
                )
            elif status == "subject_not_found":
                results.append(SubjectNotFoundError(f"subject {subject_id!r} does not exist"))
            elif status == "duplicate_photo":
                results.append(
                    DuplicatePhotoError(f"this photo is already enrolled for this model as face {_s(detail)}")
                )
            else:
                results.append(
                    InvalidRequestError(
                        f"subject {subject_id!r} already has {self.max_faces_per_subject} faces (the limit)"
                    )
                )
        return results

    #: Face hash fields read for a record (the region's JPEG only on request: it is the bulk).
    _FACE_FIELDS = (
        "subject",
        "model_id",
        "photo_sha256",
        "created_at",
        "source",
        "box",
        "landmarks",
        "detection_score",
        "quality",
        "region_landmarks",
        "embedding",
    )

    def _face_fields(self, with_embedding: bool) -> tuple[str, ...]:
        return self._FACE_FIELDS if with_embedding else self._FACE_FIELDS[:-1]

    @retried_read
    def get_face(self, face_id: str, *, with_embedding: bool = False) -> FaceRecord:
        with _redis_errors():
            values = self.redis.hmget(self.face_key(face_id), self._face_fields(with_embedding))
        record = self._face(face_id, values)
        if record is None:
            raise FaceNotFoundError(f"face {face_id!r} does not exist")
        return record

    def _face(self, face_id: str, values: Sequence[bytes | None]) -> FaceRecord | None:
        record = dict(zip(self._FACE_FIELDS, values, strict=False))
        if record["subject"] is None:
            return None
        score = record["detection_score"] or b""
        quality = record["quality"] or b""
        embedding = record.get("embedding")
        return FaceRecord(
            id=face_id,
            subject_id=record["subject"].decode(),
            model_id=record["model_id"].decode(),
            photo_sha256=record["photo_sha256"].decode(),
            created_at=record["created_at"].decode(),
            source=(record["source"] or b"photo").decode(),
            box=json.loads(record["box"] or b"null"),
            landmarks=json.loads(record["landmarks"] or b"null"),
            detection_score=float(score) if score else None,
            quality=float(quality) if quality else None,
            has_region=bool(record["region_landmarks"]),
            embedding=np.frombuffer(embedding, dtype="<f4").copy() if embedding is not None else None,
        )

    @retried_read
    def face_region(self, face_id: str) -> FaceRegion | None:
        """The stored region around a face (None when the face has none: enrolled from an
        embedding, or with SPHEREFACE_STORE_FACE_IMAGES off)."""
        with _redis_errors():
            jpeg, points, subject = self.redis.hmget(
                self.face_key(face_id), "region", "region_landmarks", "subject"
            )
        if subject is None:
            raise FaceNotFoundError(f"face {face_id!r} does not exist")
        if not jpeg or not points:
            return None
        return FaceRegion(jpeg, np.asarray(json.loads(points), dtype=np.float64))

    @retried_read
    def subject_faces(self, subject_id: str, *, with_embedding: bool = False) -> list[FaceRecord]:
        self.get_subject(subject_id)
        with _redis_errors():
            ids = sorted(f.decode() for f in self.redis.smembers(self.subject_faces_key(subject_id)))
            pipe = self.redis.pipeline(transaction=False)
            for face_id in ids:
                pipe.hmget(self.face_key(face_id), self._face_fields(with_embedding))
            replies = pipe.execute()
        faces = [f for f in (self._face(i, v) for i, v in zip(ids, replies, strict=True)) if f is not None]
        return sorted(faces, key=lambda f: (f.created_at, f.id))

    @retried_read
    def faces_of_subjects(
        self, subject_ids: Sequence[str], *, with_embedding: bool = False
    ) -> dict[str, list[FaceRecord]]:
        """The faces of several subjects in two pipelined round trips (a subject that does not
        exist has none), each subject's oldest first."""
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for subject_id in subject_ids:
                pipe.smembers(self.subject_faces_key(subject_id))
            ids = [sorted(f.decode() for f in members) for members in pipe.execute()]
            pipe = self.redis.pipeline(transaction=False)
            for face_id in (face_id for group in ids for face_id in group):
                pipe.hmget(self.face_key(face_id), self._face_fields(with_embedding))
            replies = iter(pipe.execute())
        found = {}
        for subject_id, group in zip(subject_ids, ids, strict=True):
            faces = [f for f in (self._face(i, next(replies)) for i in group) if f is not None]
            found[subject_id] = sorted(faces, key=lambda f: (f.created_at, f.id))
        return found

    def remove_faces(self, face_ids: Sequence[str]) -> int:
        """Remove faces (unknown ids are ignored); returns how many were removed. One script per
        partition: the faces of a partition go together."""
        return sum(int(outcome.reply) for outcome in self._remove(face_ids))

    def _remove(self, face_ids: Sequence[str]) -> list[Outcome]:
        """The outcomes of :meth:`remove_faces`'s scripts, one per partition."""
        by_partition: dict[int, list[str]] = {}
        for face_id in face_ids:
            by_partition.setdefault(self.partition_of(face_id), []).append(face_id)
        if not by_partition:
            by_partition[0] = []
        writes = [
            Write(
                self._remove_faces,
                [self.rev_key_of(p), self.changes_key_of(p)],
                [self.prefixes[p], STREAM_MAXLEN, *ids],
            )
            for p, ids in by_partition.items()
        ]
        return self._write(writes)

    def delete_face(self, face_id: str) -> None:
        (outcome,) = self._remove([face_id])
        # Nothing removed by a script that may have run before (its reply lost): removed then.
        if int(outcome.reply) == 0 and not outcome.maybe_repeated:
            raise FaceNotFoundError(f"face {face_id!r} does not exist")

    # -- whole gallery ----------------------------------------------------------------------
    @retried_read
    def revision_and_epoch(self) -> tuple[int, bytes]:
        """The revision and the gallery's epoch: a random id set once per Redis dataset, so a
        flushed or restored gallery (revision counted again from 0) is told from the one seen."""
        with _redis_errors():
            rev, epoch = self.redis.mget(self.rev_key, self.epoch_key)
            if epoch is None:
                self.redis.set(self.epoch_key, secrets.token_hex(8), nx=True)
                rev, epoch = self.redis.mget(self.rev_key, self.epoch_key)
        return int(rev or 0), epoch

    @retried_read
    def positions(self) -> list[tuple[int, bytes]]:
        """(revision, epoch) of every partition (:meth:`revision_and_epoch` for each)."""
        if self.partitions == 1:
            return [self.revision_and_epoch()]
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for p in range(self.partitions):
                pipe.get(self.rev_key_of(p))
                pipe.get(self.epoch_key_of(p))
            flat = pipe.execute()
            replies = list(zip(flat[::2], flat[1::2], strict=True))
            missing = [p for p, (_, epoch) in enumerate(replies) if epoch is None]
            for p in missing:
                self.redis.set(self.epoch_key_of(p), secrets.token_hex(8), nx=True)
                replies[p] = self.redis.mget(self.rev_key_of(p), self.epoch_key_of(p))
        return [(int(rev or 0), epoch) for rev, epoch in replies]

    def read_position(self, partition: int, pipe: Any) -> None:
        """Queue on ``pipe`` the read of a partition's revision and last stream entry id (one
        script: the two agree); its reply is ``[revision or None, entry id or None]``."""
        keys = [self.rev_key_of(partition), self.changes_key_of(partition)]
        self._script(self._position, keys=keys, args=[], pipe=pipe)

    @retried_read
    def revision(self) -> int:
        """The gallery's revision: the sum of its partitions' (each counts its own changes)."""
        with _redis_errors():
            if self.partitions == 1:
                return int(self.redis.get(self.rev_key) or 0)
            pipe = self.redis.pipeline(transaction=False)
            for p in range(self.partitions):
                pipe.get(self.rev_key_of(p))
            return sum(int(rev or 0) for rev in pipe.execute())

    @retried_read
    def faces_per_model(self) -> dict[str, int]:
        """How many faces each model has in the gallery (``model_id -> count``)."""
        tagged = self.partitions > 1  # P{tag}:model:{id}:faces, one per partition
        pattern = f"{_glob(self.prefix)}{'{*}:' if tagged else ''}model:*:faces"
        counts: dict[str, int] = {}
        with _redis_errors():
            for key in self.redis.scan_iter(match=pattern, count=1000):
                name = key.decode()
                rest = name[len(self.prefix) :]
                model_id = (rest.split("}:", 1)[1] if tagged else rest)[len("model:") : -len(":faces")]
                counts[model_id] = counts.get(model_id, 0) + int(self.redis.scard(name))
        return {k: v for k, v in counts.items() if v}

    @retried_read
    def stats(self, model_id: str) -> GalleryStats:
        with _redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for p in range(self.partitions):
                pipe.zcard(self.subjects_key_of(p))
                pipe.scard(self.model_faces_key(model_id, p))
                pipe.get(self.rev_key_of(p))
            replies = pipe.execute()
        return GalleryStats(
            subjects=sum(replies[0::3]),
            faces=sum(replies[1::3]),
            revision=sum(int(rev or 0) for rev in replies[2::3]),
        )


_MIGRATE_FACES_SET = """
-- KEYS: old faces set (P subject:{id}:faces), new (P subject-faces:{id}), marker
-- Moves one subject's face set to its new key, unless the old key is not a set (a subject hash).
if redis.call('TYPE', KEYS[1]).ok ~= 'set' then return 0 end
redis.call('SUNIONSTORE', KEYS[2], KEYS[1], KEYS[2])
redis.call('DEL', KEYS[1])
return 1
"""


def migrate_subject_faces_keys(client: redis.Redis, prefix: str = "sf:") -> int:
    """Rename the face sets of a gallery written before version 0.3 (``P subject:{id}:faces``) to
    ``P subject-faces:{id}``; returns how many were moved. Idempotent, and done once per Redis
    dataset (the key ``P schema`` records it); safe while other workers serve."""
    marker = f"{prefix}schema"
    with _redis_errors():
        if int(client.get(marker) or 0) >= GALLERY_SCHEMA:
            return 0
        move = client.register_script(_MIGRATE_FACES_SET)
        moved = 0
        start = len(f"{prefix}subject:")
        for key in client.scan_iter(match=f"{prefix}subject:*:faces", count=1000, _type="SET"):
            name = key.decode()
            subject_id = name[start : -len(":faces")]
            moved += int(move(keys=[name, f"{prefix}subject-faces:{subject_id}", marker]))
        client.set(marker, GALLERY_SCHEMA)
    return moved


def _glob(text: str) -> str:
    """``text`` with the characters special to Redis's glob patterns escaped."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class _redis_errors:
    """Turn Redis failures that pass (:data:`~service.errors.REDIS_DOWN_ERRORS`) into a typed 503 answer."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, REDIS_DOWN_ERRORS):
            raise redis_unavailable(exc) from exc
        return False
