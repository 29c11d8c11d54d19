"""Copy a gallery from one Redis into a Redis Cluster (``sphereface gallery migrate``).

What is copied: every subject (its hash as it is: id, name, metadata, created and updated times,
and its place in the creation order), every face of every model (its hash as it is: vector,
region, photo hash, stored face image, ...), the subject's and the model's face sets, the photo
keys that refuse a duplicate, and the API keys with their index. Rate-limit buckets, the schema
marker and the source's revision, epoch and change stream are not copied: the cluster's
partitions count their own revisions, and the copy of each face is written to its partition's
change stream as an enrollment would be, so a service already running on the cluster takes the
faces in as they arrive and one started later loads them all.

Face ids. On a cluster a face id hashes to its subject's partition, so that a face is found from
its id alone (:mod:`service.gallery.partitions`); an id drawn on one Redis does so only by chance
(1 in 64). A face whose id already fits keeps it; any other gets a new id that is a pure function
of the old one (:func:`cluster_face_id`), so a rerun or a resumed run computes the same ids, and
the pairs are written to a CSV file (``old_id,new_id,subject_id,model_id``). Subject ids and API
keys stay as they are.

One subject is one Lua script (one slot): it is copied whole or not at all, and a subject already
in the cluster is left as it is. A run that stops part way is resumed by running it again; a run
over a finished migration writes nothing. Each subject is then read back and compared with the
source, face by face (a SHA-256 of every field), and the counts per model and of subjects are
compared at the end: any difference fails the run (:class:`~service.errors.MigrationMismatchError`).
"""

from __future__ import annotations

import csv
import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from service.errors import MigrationMismatchError, MigrationRefusedError
from service.gallery import partitions as parts
from service.gallery.store import STREAM_MAXLEN, GalleryStore, _redis_errors

#: Subjects read, written and checked per round trip (at most).
BATCH = 100
#: Faces per round trip: a batch whose subjects have more is cut into chunks of about this many
#: (a subject with more faces is a chunk of its own); bounds the memory of a run.
FACES_PER_CHUNK = 1000
#: Mismatches named in the error (all are counted).
SHOWN_MISMATCHES = 10

_COPY_SUBJECT = """
-- KEYS: subject, subject faces, subjects, rev, changes, then per face: face, model faces, photo
-- ARGV: subject id, creation score, stream maxlen, n, the subject's n field/value items, then per
--       face: face id, model id, set photo key ('1'/'0'), m, the face's m field/value items
-- Writes one subject with its faces as enrollments would (a revision and a stream entry per
-- face); a subject that exists already is left alone (0).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], unpack(ARGV, 5, 4 + n))
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
local i = 5 + n
local k = 6
while i <= #ARGV do
  local fid, model, m = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 3])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 4, i + 3 + m))
  redis.call('SADD', KEYS[2], fid)
  redis.call('SADD', KEYS[k + 1], fid)
  if ARGV[i + 2] == '1' then redis.call('SET', KEYS[k + 2], fid) end
  local rev = redis.call('INCR', KEYS[4])
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'rev', rev, 'op', 'add', 'face', fid,
    'subject', ARGV[1], 'model', model)
  i = i + 4 + m
  k = k + 3
end
return 1
"""


def cluster_face_id(face_id: str, partition: int, partitions: int = parts.CLUSTER_PARTITIONS) -> str:
    """The id of a migrated face in ``partition``: its own id when it hashes there, else the first
    ``BLAKE2b-96(old id:n)`` (24 hex digits, n = 0, 1, ...) that does. A pure function: every run
    gives the same id."""
    if parts.partition_of(face_id, partitions) == partition:
        return face_id
    n = 0
    while True:
        candidate = hashlib.blake2b(f"{face_id}:{n}".encode(), digest_size=12).hexdigest()
        if parts.partition_of(candidate, partitions) == partition:
            return candidate
        n += 1


def face_checksum(fields: dict[bytes, bytes], in_model_set: bool, photo_points_here: bool) -> str:
    """SHA-256 of a face: every field of its hash (sorted by name), whether its model's face set
    holds it and whether its photo key names it."""
    digest = hashlib.sha256()
    for name in sorted(fields):
        for part in (name, fields[name]):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    digest.update(b"%d%d" % (in_model_set, photo_points_here))
    return digest.hexdigest()


@dataclass
class SourceFace:
    """A face read from the source, with its id in the cluster."""

    old_id: str
    new_id: str
    fields: dict[bytes, bytes]
    photo_key_is_own: bool

    @property
    def model_id(self) -> str:
        return self.fields[b"model_id"].decode()

    @property
    def photo_sha256(self) -> str:
        return self.fields.get(b"photo_sha256", b"").decode()

    def checksum(self) -> str:
        return face_checksum(self.fields, True, self.photo_key_is_own)


@dataclass
class Head:
    """A subject's record, creation score and face ids, read before its faces."""

    id: str
    fields: dict[bytes, bytes]
    score: float
    face_ids: list[str]


@dataclass
class SourceSubject:
    """A subject read from the source: its hash, creation score and faces."""

    id: str
    fields: dict[bytes, bytes]
    score: float
    faces: list[SourceFace]


@dataclass
class MigrationReport:
    """What a run did and found."""

    subjects: int = 0
    subjects_copied: int = 0
    faces: int = 0
    faces_copied: int = 0
    faces_renamed: int = 0
    api_keys: int = 0
    api_keys_copied: int = 0
    faces_per_model: dict[str, int] = field(default_factory=dict)
    complete: bool = False
    dry_run: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        models = ", ".join(f"{m}: {n}" for m, n in sorted(self.faces_per_model.items())) or "none"
        verb = "would copy" if self.dry_run else "copied"
        lines = [
            f"{verb} {self.subjects_copied} of {self.subjects} subjects and {self.faces_copied} of "
            f"{self.faces} faces ({models}); {self.api_keys_copied} of {self.api_keys} API keys",
            f"{self.faces_renamed} face ids changed (the file of ids maps old to new)",
        ]
        if self.dry_run:
            lines.append("dry run: nothing was written")
        elif self.complete:
            rate = self.faces / self.seconds if self.seconds else 0.0
            lines.append(
                f"checked: every face and count matches the source ({self.seconds:.1f} s, {rate:.0f} faces/s)"
            )
        else:
            lines.append("stopped before the end (--max-subjects): run the same command again to go on")
        return "\n".join(lines)


class GalleryMigration:
    """Copy the gallery of ``source`` (one Redis) into ``target`` (a Redis Cluster) and check it.

    ``into_nonempty``: go on even though the cluster holds a gallery that is not this source's
    (subjects with the same id are then left as they are there, and fail the check if they
    differ). ``max_subjects``: stop after copying that many subjects (the rest on a later run)."""

    def __init__(
        self,
        source: redis.Redis,
        target: RedisCluster,
        prefix: str = "sf:",
        *,
        into_nonempty: bool = False,
        max_subjects: int | None = None,
    ) -> None:
        if not isinstance(target, RedisCluster):
            raise MigrationRefusedError("the target of a migration must be a Redis Cluster client")
        if max_subjects is not None and max_subjects < 1:
            raise MigrationRefusedError(f"--max-subjects must be at least 1, not {max_subjects}")
        self.source = GalleryStore(source, prefix, partitions=1)
        self.target = GalleryStore(target, prefix)
        self.prefix = prefix
        self.into_nonempty = into_nonempty
        self.max_subjects = max_subjects
        self._copy = target.register_script(_COPY_SUBJECT)
        #: the cluster holds subjects of another gallery too (``into_nonempty``)
        self.shared = False

    # -- checks before copying ------------------------------------------------------------------
    def marker_key(self, epoch: bytes) -> str:
        """The cluster's record of a migration from the source of ``epoch`` (a hash: when it
        started and finished, and whether the cluster held other subjects then)."""
        return f"{self.prefix}migration:{epoch.decode()}"

    def preflight(self) -> bytes:
        """Refuse an empty or unreachable source and a cluster that holds another gallery;
        returns the source's epoch (its identity, which names the migration's record)."""
        try:
            self.source.redis.ping()
        except redis.RedisError as exc:
            raise MigrationRefusedError(f"the source Redis cannot be reached: {exc}") from exc
        self.source.ensure_schema()
        with _redis_errors():
            subjects = self.source.redis.zcard(self.source.subjects_key)
            keys = self.source.redis.scard(f"{self.prefix}apikeys")
        if not subjects and not keys:
            raise MigrationRefusedError("the source gallery is empty: no subjects and no API keys to copy")
        _, epoch = self.source.revision_and_epoch()
        with _redis_errors():
            marker = self.target.redis.hgetall(self.marker_key(epoch))
            held = self.target.stats("").subjects
        if marker:  # a run from this source started here: go on
            self.shared = marker.get(b"shared") == b"1"
            return epoch
        self.shared = held > 0
        if self.shared and not self.into_nonempty:
            raise MigrationRefusedError(
                f"the cluster already holds a gallery of {held} subjects that was not migrated from this "
                "source; empty it, or pass --into-nonempty to copy into it anyway"
            )
        return epoch

    # -- reading the source ---------------------------------------------------------------------
    def subject_batches(self) -> Iterator[list[str]]:
        """The source's subject ids in creation order, :data:`BATCH` at a time."""
        batch: list[str] = []
        for subject_id in self.source.subject_ids():
            batch.append(subject_id)
            if len(batch) == BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def source_chunks(self) -> Iterator[list[SourceSubject]]:
        """The source's subjects with their faces, in chunks of at most :data:`BATCH` subjects
        and about :data:`FACES_PER_CHUNK` faces (a subject is never split)."""
        for batch in self.subject_batches():
            chunk: list[Head] = []
            faces = 0
            for head in self.read_heads(batch):
                if chunk and faces + len(head.face_ids) > FACES_PER_CHUNK:
                    yield self.read_faces(chunk)
                    chunk, faces = [], 0
                chunk.append(head)
                faces += len(head.face_ids)
            if chunk:
                yield self.read_faces(chunk)

    def read_heads(self, subject_ids: Sequence[str]) -> list[Head]:
        """Subjects' records, creation scores and face ids, in one pipelined round trip (a
        subject deleted meanwhile is left out)."""
        src = self.source
        with _redis_errors():
            pipe = src.redis.pipeline(transaction=False)
            for sid in subject_ids:
                pipe.hgetall(src.subject_key(sid))
                pipe.zscore(src.subjects_key, sid)
                pipe.smembers(src.subject_faces_key(sid))
            replies = pipe.execute()
        return [
            Head(sid, record, float(score or 0.0), sorted(f.decode() for f in faces))
            for sid, record, score, faces in zip(
                subject_ids, replies[0::3], replies[1::3], replies[2::3], strict=True
            )
            if record
        ]

    def read_faces(self, heads: Sequence[Head]) -> list[SourceSubject]:
        """The subjects of ``heads`` with every field of their faces (one pipelined round trip),
        and which faces their photo keys name (another)."""
        with _redis_errors():
            pipe = self.source.redis.pipeline(transaction=False)
            for head in heads:
                for fid in head.face_ids:
                    pipe.hgetall(self.source.face_key(fid))
            records = iter(pipe.execute())
        subjects = []
        for head in heads:
            fields = [(fid, next(records)) for fid in head.face_ids]
            subjects.append(SourceSubject(head.id, head.fields, head.score, self._faces(head.id, fields)))
        self._mark_photo_keys(subjects)
        return subjects

    def _faces(self, subject_id: str, records: list[tuple[str, dict]]) -> list[SourceFace]:
        partition = self.target.partition_of(subject_id)
        return [
            SourceFace(fid, cluster_face_id(fid, partition, self.target.partitions), record, False)
            for fid, record in records
            if record and b"model_id" in record
        ]

    def _mark_photo_keys(self, subjects: list[SourceSubject]) -> None:
        """Note which faces their photo key names on the source (the key is copied for those)."""
        faces = [face for subject in subjects for face in subject.faces]
        with _redis_errors():
            pipe = self.source.redis.pipeline(transaction=False)
            for face in faces:
                pipe.get(self.source.photo_key(face.model_id, face.photo_sha256))
            owners = pipe.execute()
        for face, owner in zip(faces, owners, strict=True):
            face.photo_key_is_own = owner is not None and owner.decode() == face.old_id

    # -- writing and checking the cluster -------------------------------------------------------
    def copy_keys(self, subject: SourceSubject) -> list[str]:
        """The keys of the copy script for one subject (all in its partition)."""
        t = self.target
        partition = t.partition_of(subject.id)
        keys = [
            t.subject_key(subject.id),
            t.subject_faces_key(subject.id),
            t.subjects_key_of(partition),
            t.rev_key_of(partition),
            t.changes_key_of(partition),
        ]
        for face in subject.faces:
            keys += [
                t.key(partition, f"face:{face.new_id}"),
                t.model_faces_key(face.model_id, partition),
                t.photo_key(face.model_id, face.photo_sha256, partition),
            ]
        return keys

    @staticmethod
    def copy_args(subject: SourceSubject) -> list:
        """The arguments of the copy script for one subject."""
        args: list = [subject.id, repr(subject.score), STREAM_MAXLEN, len(subject.fields) * 2]
        args += [part for item in subject.fields.items() for part in item]
        for face in subject.faces:
            args += [face.new_id, face.model_id, "1" if face.photo_key_is_own else "0", len(face.fields) * 2]
            args += [part for item in face.fields.items() for part in item]
        return args

    def write(self, subjects: Sequence[SourceSubject]) -> list[bool]:
        """Copy subjects into the cluster (one script each, pipelined); which were written."""
        with _redis_errors():
            pipe = self.target.redis.pipeline(transaction=False)
            for subject in subjects:
                self.target._script(self._copy, self.copy_keys(subject), self.copy_args(subject), pipe=pipe)
            return [bool(int(done)) for done in pipe.execute()]

    def check(self, subjects: Sequence[SourceSubject]) -> list[str]:
        """Read the subjects back from the cluster and compare them with the source: what differs."""
        t = self.target
        with _redis_errors():
            pipe = t.redis.pipeline(transaction=False)
            for subject in subjects:
                partition = t.partition_of(subject.id)
                pipe.hgetall(t.subject_key(subject.id))
                pipe.zscore(t.subjects_key_of(partition), subject.id)
                pipe.smembers(t.subject_faces_key(subject.id))
                for face in subject.faces:
                    pipe.hgetall(t.key(partition, f"face:{face.new_id}"))
                    pipe.sismember(t.model_faces_key(face.model_id, partition), face.new_id)
                    pipe.get(t.photo_key(face.model_id, face.photo_sha256, partition))
            replies = iter(pipe.execute())
        problems = []
        for subject in subjects:
            problems += self._compare(subject, replies)
        return problems

    @staticmethod
    def _compare(subject: SourceSubject, replies: Iterator) -> list[str]:
        """What differs between a source subject and the next replies of :meth:`check`."""
        record, score, members = next(replies), next(replies), next(replies)
        problems = []
        if record != subject.fields:
            problems.append(f"subject {subject.id!r}: its record differs")
        if score is None or float(score) != subject.score:
            problems.append(f"subject {subject.id!r}: not in the subject list at its creation time")
        if {m.decode() for m in members} != {f.new_id for f in subject.faces}:
            problems.append(f"subject {subject.id!r}: its face set differs")
        for face in subject.faces:
            fields, in_set, photo = next(replies), next(replies), next(replies)
            own = photo is not None and photo.decode() == face.new_id
            if face_checksum(fields, bool(in_set), own) != face.checksum():
                problems.append(
                    f"face {face.old_id} (as {face.new_id}) of subject {subject.id!r}: checksum differs"
                )
        return problems

    # -- API keys -------------------------------------------------------------------------------
    def copy_api_keys(self, report: MigrationReport, dry_run: bool) -> list[str]:
        """Copy the API keys that the cluster lacks (with the index); what differs after."""
        index = f"{self.prefix}apikeys"
        with _redis_errors():
            key_ids = sorted(k.decode() for k in self.source.redis.smembers(index))
            pipe = self.source.redis.pipeline(transaction=False)
            for key_id in key_ids:
                pipe.hgetall(f"{self.prefix}apikey:{key_id}")
            records = dict(zip(key_ids, pipe.execute(), strict=True))
            there = {k: self.target.redis.hgetall(f"{self.prefix}apikey:{k}") for k in key_ids}
            missing = [k for k in key_ids if records[k] and not there[k]]
            report.api_keys, report.api_keys_copied = len(key_ids), len(missing)
            if dry_run:
                return []
            for key_id in missing:
                self.target.redis.hset(f"{self.prefix}apikey:{key_id}", mapping=records[key_id])
            if key_ids:
                self.target.redis.sadd(index, *key_ids)
            problems = [
                f"API key {k}: its record differs"
                for k in key_ids
                if records[k] and self.target.redis.hgetall(f"{self.prefix}apikey:{k}") != records[k]
            ]
        return problems

    # -- the whole run --------------------------------------------------------------------------
    def run(
        self, *, dry_run: bool = False, progress: bool = True, id_map: Path | None = None
    ) -> MigrationReport:
        """Copy, check and report (see the module docstring); the face ids of the subjects walked
        go to the CSV ``id_map``. Raises MigrationRefusedError before writing anything,
        MigrationMismatchError when the copy differs from the source."""
        started = time.perf_counter()
        epoch = self.preflight()
        report = MigrationReport(dry_run=dry_run)
        problems = Problems()
        problems.add(self.copy_api_keys(report, dry_run))
        if not dry_run:
            self._record(epoch, finished=False)
        with IdMap(None if dry_run else id_map) as ids:
            stopped = self._walk(report, problems, ids, dry_run=dry_run, progress=progress)
        if problems.count:
            raise problems.error()
        if not dry_run and not stopped:
            self._check_totals(report)
            self._record(epoch, finished=True, report=report)
            report.complete = True
        report.seconds = time.perf_counter() - started
        return report

    def _walk(
        self, report: MigrationReport, problems: Problems, ids: IdMap, *, dry_run: bool, progress: bool
    ) -> bool:
        """Copy and check the subjects batch by batch; whether it stopped at ``max_subjects``."""
        from tqdm import tqdm

        with _redis_errors():
            total = self.source.redis.zcard(self.source.subjects_key)
        with tqdm(total=total, desc="migrate", unit="subject", disable=not progress) as bar:
            for chunk in self.source_chunks():
                subjects = self._within_limit(chunk, report.subjects_copied)
                if dry_run:
                    copied = self._absent(subjects)
                else:
                    copied = self.write(subjects)
                    problems.add(self.check(subjects))
                self._count(report, subjects, copied)
                ids.write(subjects)
                bar.update(len(subjects))
                if self.max_subjects is not None and report.subjects_copied >= self.max_subjects:
                    return True
        return False

    def _within_limit(self, subjects: list[SourceSubject], copied: int) -> list[SourceSubject]:
        """The first subjects of a batch, up to the one that reaches ``max_subjects`` copies."""
        if self.max_subjects is None:
            return subjects
        room = self.max_subjects - copied
        for end, absent in enumerate(self._absent(subjects), start=1):
            room -= int(absent)
            if room <= 0:
                return subjects[:end]
        return subjects

    def _absent(self, subjects: Sequence[SourceSubject]) -> list[bool]:
        """Which subjects the cluster does not hold yet (what a dry run would copy)."""
        with _redis_errors():
            pipe = self.target.redis.pipeline(transaction=False)
            for subject in subjects:
                pipe.exists(self.target.subject_key(subject.id))
            return [not int(n) for n in pipe.execute()]

    @staticmethod
    def _count(report: MigrationReport, subjects: Sequence[SourceSubject], copied: Sequence[bool]) -> None:
        """Add a batch to the report."""
        for subject, done in zip(subjects, copied, strict=True):
            report.subjects += 1
            report.subjects_copied += int(done)
            report.faces += len(subject.faces)
            report.faces_copied += len(subject.faces) if done else 0
            for face in subject.faces:
                report.faces_per_model[face.model_id] = report.faces_per_model.get(face.model_id, 0) + 1
                report.faces_renamed += int(face.new_id != face.old_id)

    def _check_totals(self, report: MigrationReport) -> None:
        """The subjects and the faces of each model, counted on both sides, must agree (the
        cluster may hold more when it held other subjects before: ``into_nonempty``)."""

        def differ(here: int, there: int) -> bool:
            return there < here if self.shared else there != here

        source_models = self.source.faces_per_model()
        target_models = self.target.faces_per_model()
        problems = [
            f"model {m}: {source_models.get(m, 0)} faces in the source, {target_models.get(m, 0)} in the "
            "cluster"
            for m in sorted(set(source_models) | set(target_models))
            if differ(source_models.get(m, 0), target_models.get(m, 0))
        ]
        if report.faces_per_model != source_models:
            problems.append(
                f"the faces reached through subjects ({report.faces_per_model}) are not every face of the "
                f"source's model sets ({source_models}): faces without a subject are not copied"
            )
        with _redis_errors():
            source_subjects = self.source.redis.zcard(self.source.subjects_key)
        target_subjects = self.target.stats("").subjects
        if differ(source_subjects, target_subjects):
            problems.append(f"{source_subjects} subjects in the source, {target_subjects} in the cluster")
        if problems:
            found = Problems()
            found.add(problems)
            raise found.error()

    def _record(self, epoch: bytes, *, finished: bool, report: MigrationReport | None = None) -> None:
        """Note the migration in the cluster: when it started (once) and finished (once)."""
        key = self.marker_key(epoch)
        with _redis_errors():
            marker = self.target.redis.hgetall(key)
            if b"finished_at" in marker:
                return
            mapping: dict[str, str | int] = {}
            if not marker:
                mapping |= {"started_at": _now(), "shared": int(self.shared)}
            if finished and report is not None:
                mapping |= {"finished_at": _now(), "subjects": report.subjects, "faces": report.faces}
            if mapping:
                self.target.redis.hset(key, mapping=mapping)


class IdMap:
    """The CSV file of face ids, written as the subjects are walked: ``old_id,new_id,subject_id,
    model_id``, one row per face (nothing when the path is None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = None
        self._out = None

    def __enter__(self) -> IdMap:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", newline="")
            self._out = csv.writer(self._file)
            self._out.writerow(("old_id", "new_id", "subject_id", "model_id"))
        return self

    def write(self, subjects: Sequence[SourceSubject]) -> None:
        if self._out is not None:
            self._out.writerows((f.old_id, f.new_id, s.id, f.model_id) for s in subjects for f in s.faces)

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()


class Problems:
    """Differences found by the checks: counted, the first :data:`SHOWN_MISMATCHES` kept."""

    def __init__(self) -> None:
        self.count = 0
        self.shown: list[str] = []

    def add(self, found: Sequence[str]) -> None:
        self.count += len(found)
        self.shown += found[: max(0, SHOWN_MISMATCHES - len(self.shown))]

    def error(self) -> MigrationMismatchError:
        more = f" (and {self.count - len(self.shown)} more)" if self.count > len(self.shown) else ""
        return MigrationMismatchError(
            f"the cluster does not match the source in {self.count} places: {'; '.join(self.shown)}{more}"
        )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
