"""``sphereface prepare train.rec``: an insightface RecordIO set into the packed shards training reads.

The output folder is the one :func:`training.prepare.prepare_dataset` writes (see
:mod:`training.prepare`: ``images_NNNNN.npy`` uint8 ``(n, 112, 96, 3)`` RGB, ``labels_NNNNN.npy``,
``meta_NNNNN.json``, ``manifest.json`` last), so ``sphereface train`` and
:func:`training.prepare.load_training_set` read it as any other. What differs is the input:

* The records hold faces already aligned to the ArcFace 112x112 template, so nothing is detected:
  each image is decoded and cut to the trainer's template by
  :func:`training.formats.insightface.crop_from_arcface` (for SphereFace's 112x96, columns 8-103).
* The images are taken in the set's order (:class:`~training.formats.insightface.InsightFaceRecordIO`)
  and cut into shards of ``shard_size`` records; shards are written atomically, meta last, and a
  re-run redoes only the shards without one, as for photo folders. The records are decoded by
  worker processes in chunks of :data:`CHUNK_RECORDS`.
* An identity is named by its label, zero-padded to :data:`NAME_DIGITS` digits (``00000042``);
  labels are re-numbered ``0..C-1`` in label order, so a set labelled ``0..C-1`` keeps its labels.
  Two RecordIO sets therefore share names: combining them with ``load_training_set`` would merge
  label 42 of one with label 42 of the other.
* A damaged file stops the job with :class:`~training.formats.recordio.DamagedRecordError`,
  which names the record and its byte offset (bad magic, truncated payload, an index offset past
  the end, an image that cannot be decoded); nothing is skipped silently. With an identity header,
  every image must carry the label of its identity's first image, and the identities as many
  labels as there are identity records.
* Excluded identities (by name) are recorded as skipped rows with the reason ``excluded_identity``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.align import ARCFACE_TEMPLATE_112x112
from models.arcface_crop import ARCFACE_SIZE, crop_from_arcface
from training.align_workers import TEMPLATE
from training.formats.insightface import (
    LAYOUT_IDENTITY_HEADER,
    InsightFaceRecordIO,
    class_label,
    crop_rule,
    decode_face,
    open_insightface,
)
from training.formats.recordio import damaged, read_record, unpack_image_record
from training.prepare import (
    DEFAULT_SHARD_SIZE,
    FORMAT_VERSION,
    IMAGE_SHAPE,
    DatasetError,
    PreparedDataset,
    _check_output_folder,
    _exclusion_set,
    _finish,
    _loaded,
    _mark_complete,
    _mark_incomplete,
    _progress,
    _shard_complete,
    _write_shard,
)
from training.worker_pool import WorkerDied, died_in_shards, ordered_results

log = logging.getLogger(__name__)

#: Records per worker task.
CHUNK_RECORDS = 64
#: Digits of an identity's name (its zero-padded label): names sort as their labels do below 10^8.
NAME_DIGITS = 8
EXCLUDED_REASON = "excluded_identity"
INPUT_FORMAT = "mxnet_recordio"


def identity_name(label: int) -> str:
    """The identity name of a label: ``42`` -> ``"00000042"``."""
    return f"{label:0{NAME_DIGITS}d}"


@dataclass(frozen=True)
class _RecordJob:
    """What the shards of one RecordIO preparation are made from (``out`` and ``fingerprint`` as
    :func:`training.prepare._check_output_folder` reads them)."""

    data: InsightFaceRecordIO
    out: Path
    fingerprint: str
    workers: int
    excluded: frozenset[str]


def prepare_recordio(
    src: str | Path,
    out: str | Path,
    *,
    exclude_identities: Iterable[str] | str | Path | None = None,
    workers: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
) -> PreparedDataset:
    """Decode and crop every image of an insightface RecordIO set into packed shards in ``out``.

    Args:
        src: ``train.rec`` (``train.idx`` beside it) or the folder holding both.
        out: the output folder (created); resumable: finished shards are kept.
        exclude_identities: identity names (zero-padded labels, :func:`identity_name`) to leave
            out, or a text file with one per line (blank lines and ``#`` comments ignored).
        workers: decoding processes (default: all cores); 1 decodes in this process.
        shard_size: image records per shard (the last shard may hold fewer).
        progress: show a tqdm bar over records.

    Returns:
        the prepared folder, loaded with memory-mapped images, ``last_run`` saying what this
        call did.

    Raises:
        DatasetError: ``src`` is not a RecordIO set, an image is not a 112k-pixel square, or
            nothing is left after the exclusions.
        DamagedRecordError: the file or its index is damaged (the record and offset are named).
        DatasetMismatchError: ``out`` holds a preparation of another set or other settings.
    """
    started = time.perf_counter()
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    out = Path(out)
    data = open_insightface(src)
    excluded = frozenset(_exclusion_set(exclude_identities))
    settings = _settings(data, shard_size, excluded)
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    job = _RecordJob(data, out, _fingerprint(data, settings), workers, excluded)
    ranges = [(a, min(a + shard_size, len(data))) for a in range(0, len(data), shard_size)]
    out.mkdir(parents=True, exist_ok=True)
    old = _check_output_folder(job, len(ranges))  # type: ignore[arg-type]
    metas = {}
    for k, shard_range in enumerate(ranges):
        meta = _shard_complete(out, k, job.fingerprint, shard_range)
        if meta is not None:
            metas[k] = meta
    pending = [k for k in range(len(ranges)) if k not in metas]
    if old is not None and not pending:
        return _loaded(out, started, processed=0, written=0, reused=len(ranges))
    _mark_incomplete(out)
    processed = _decode_pending(job, ranges, pending, metas, progress)
    manifest = _manifest(job, settings, ranges, metas)
    return _mark_complete(out, manifest, started, processed, written=len(pending), shards=len(ranges))


def _settings(data: InsightFaceRecordIO, shard_size: int, excluded: frozenset[str]) -> dict[str, Any]:
    """What the shards depend on besides the files (part of the fingerprint)."""
    identities = None if data.identity_ranges is None else len(data.identity_ranges)
    return {
        "format_version": FORMAT_VERSION,
        "template": TEMPLATE.name,
        "image_shape": list(IMAGE_SHAPE),
        "detector": {"name": "none", "face_policy": "aligned_records"},
        "input": {
            "format": INPUT_FORMAT,
            "layout": data.layout,
            "image_records": len(data),
            "identity_records": identities,
            "aligned_to": ARCFACE_TEMPLATE_112x112.name,
            "crop": crop_rule(TEMPLATE),
        },
        "exclude_identities": sorted(excluded),
        "shard_size": shard_size,
    }


def _fingerprint(data: InsightFaceRecordIO, settings: dict[str, Any]) -> str:
    """SHA-256 over the settings, the ``.rec`` file's name and size and the whole index."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
    digest.update(f"\n{data.rec.name}\t{data.size}\n".encode())
    with open(data.idx, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Decoding, in worker processes
# --------------------------------------------------------------------------------------------

#: This process's open ``.rec``: ``{"rec": Path, "size": int, "file": BinaryIO | None}``.
_WORKER: dict[str, Any] = {}


def _worker_init(rec: str, size: int) -> None:
    _WORKER.update(rec=Path(rec), size=int(size), file=None)


def decode_chunk(task: tuple[int, np.ndarray, np.ndarray]) -> tuple[int, np.ndarray, np.ndarray]:
    """Pool task ``(position of the first record, keys, offsets)`` -> ``(position, crops (n, 112,
    96, 3) uint8, labels (n,) int64)``; a damaged record raises, naming its key and offset."""
    first, keys, offsets = task
    rec, size = _WORKER["rec"], _WORKER["size"]
    if _WORKER["file"] is None or _WORKER["file"].name != str(rec):
        _WORKER["file"] = open(rec, "rb")  # noqa: SIM115 - kept open for this process's next tasks
    file = _WORKER["file"]
    faces = np.empty((len(keys), *ARCFACE_SIZE, 3), dtype=np.uint8)
    labels = np.empty(len(keys), dtype=np.int64)
    for row, (key, offset) in enumerate(zip(keys.tolist(), offsets.tolist(), strict=True)):
        record = unpack_image_record(read_record(file, size, rec, key, offset), rec, key, offset)
        labels[row] = class_label(record, rec, key, offset)
        faces[row] = decode_face(record.image, rec, key, offset)
    return first, crop_from_arcface(faces, TEMPLATE), labels


def decoded_chunks(
    tasks: list[tuple[int, np.ndarray, np.ndarray]], workers: int, rec: Path, size: int
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """:func:`decode_chunk` over ``tasks``, in task order (``workers <= 1``: in this process)."""
    if not tasks:
        return
    if workers <= 1:
        _worker_init(str(rec), size)
        try:
            for task in tasks:
                yield decode_chunk(task)
        finally:
            if _WORKER.get("file") is not None:
                _WORKER["file"].close()
                _WORKER["file"] = None
        return
    setup = (str(rec), size)
    yield from ordered_results(decode_chunk, tasks, workers, initializer=_worker_init, initargs=setup)


# --------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------


def _decode_pending(
    job: _RecordJob,
    ranges: list[tuple[int, int]],
    pending: list[int],
    metas: dict[int, dict[str, Any]],
    progress: bool,
) -> int:
    """Decode the records of the ``pending`` shards and write each shard (its meta into
    ``metas``); returns the number of records decoded."""
    data = job.data
    tasks = [
        (a, data.image_keys[a:b], data.image_offsets[a:b]) for k in pending for a, b in _chunks(*ranges[k])
    ]
    todo = sum(ranges[k][1] - ranges[k][0] for k in pending)
    bar = _progress(len(data), len(data) - todo, progress)
    stream = decoded_chunks(tasks, job.workers, data.rec, data.size)
    try:
        for k in pending:
            first, last = ranges[k]
            shard_started = time.perf_counter()
            crops, labels, paths, skipped = _collect_shard(job, stream, first, last, bar)
            metas[k] = _write_shard(
                job.out, k, job.fingerprint, (first, last), crops, labels, paths, skipped,
                time.perf_counter() - shard_started,
            )  # fmt: skip
    except WorkerDied as died:
        on = [(a, f"records {keys[0]}..{keys[-1]}") for a, keys, _ in died.tasks]  # record keys
        raise died_in_shards(died, on, ranges, len(metas)) from None
    finally:
        stream.close()  # stops the worker pool, also when this loop fails or is interrupted
        if bar is not None:
            bar.close()
    return todo


def _chunks(first: int, last: int) -> Iterator[tuple[int, int]]:
    for a in range(first, last, CHUNK_RECORDS):
        yield a, min(a + CHUNK_RECORDS, last)


def _collect_shard(
    job: _RecordJob,
    stream: Iterator[tuple[int, np.ndarray, np.ndarray]],
    first: int,
    last: int,
    bar: Any,
) -> tuple[np.ndarray, np.ndarray, list[str], list[dict[str, str]]]:
    """The decoded records ``first .. last - 1`` from ``stream``: the kept crops, their labels and
    ``identity/key`` names, and the rows of excluded identities as skipped."""
    crops = np.empty((last - first, *IMAGE_SHAPE), dtype=np.uint8)
    labels = np.empty(last - first, dtype=np.int64)
    at = first
    while at < last:
        start, chunk_crops, chunk_labels = next(stream)
        if start != at:  # results come in task order; anything else is a bug
            raise RuntimeError(f"record {start} arrived where record {at} was expected")
        n = len(chunk_labels)
        crops[at - first : at - first + n] = chunk_crops
        labels[at - first : at - first + n] = chunk_labels
        at += n
        if bar is not None:
            bar.update(n)
    if job.data.layout == LAYOUT_IDENTITY_HEADER:
        check_identity_labels(job.data, first, last, labels)
    keys = job.data.image_keys[first:last].tolist()
    names = [identity_name(label) for label in labels.tolist()]
    keep = [name not in job.excluded for name in names]
    paths = [f"{name}/{key}" for name, key, kept in zip(names, keys, keep, strict=True) if kept]
    skipped = [
        {"path": f"{name}/{key}", "reason": EXCLUDED_REASON, "message": "its identity is excluded by request"}
        for name, key, kept in zip(names, keys, keep, strict=True)
        if not kept
    ]
    if all(keep):
        return crops, labels, paths, skipped
    return crops[keep], labels[keep], paths, skipped


def check_identity_labels(data: InsightFaceRecordIO, first: int, last: int, labels: np.ndarray) -> None:
    """Every image at positions ``first .. last - 1`` carries the label of its identity's first
    image (the identity record whose range holds it).

    Raises:
        DamagedRecordError: naming the first image whose label differs.
    """
    assert data.identity_ranges is not None and data.identity_keys is not None
    keys = data.image_keys[first:last]
    identities = data.identity_of(keys)
    runs = np.flatnonzero(np.r_[True, identities[1:] != identities[:-1]])
    for s, e in zip(runs.tolist(), [*runs[1:].tolist(), len(keys)], strict=True):
        identity = int(identities[s])
        start = int(data.identity_ranges[identity, 0])
        expected = int(labels[s]) if int(keys[s]) == start else _first_label(data, start)
        wrong = np.flatnonzero(labels[s:e] != expected)
        if wrong.size:
            row = s + int(wrong[0])
            raise damaged(
                data.rec, int(keys[row]), int(data.image_offsets[first + row]),
                f"its label {int(labels[row])} differs from the label {expected} of record {start}, the "
                f"first image of the identity that identity record {int(data.identity_keys[identity])} "
                "gives it to",
            )  # fmt: skip


def _first_label(data: InsightFaceRecordIO, key: int) -> int:
    """The label of image record ``key`` (header layout: image keys are their position + 1)."""
    offset = int(data.image_offsets[key - 1])
    with open(data.rec, "rb") as file:
        return class_label(data.read(file, key, offset), data.rec, key, offset)


def _manifest(
    job: _RecordJob, settings: dict[str, Any], ranges: list[tuple[int, int]], metas: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """Give labels their final contiguous values and build the manifest (not yet written)."""
    kept = {path.split("/", 1)[0] for meta in metas.values() for path in meta["paths"]}
    excluded = {
        entry["path"].split("/", 1)[0]
        for meta in metas.values()
        for entry in meta["skipped"]
        if entry["reason"] == EXCLUDED_REASON
    }
    data = job.data
    if data.identity_ranges is not None and len(kept | excluded) != len(data.identity_ranges):
        raise DatasetError(
            f"{data.rec}: the images carry {len(kept | excluded):,} different labels but the identity "
            f"records list {len(data.identity_ranges):,} identities, so some identities share a label; "
            "the set is inconsistent"
        )
    if not kept:
        raise DatasetError(f"every identity of {data.rec} is excluded; nothing is left to prepare")
    manifest = _finish(
        data.rec, job.out, identities=sorted(kept), photos=range(len(data)), ranges=ranges, metas=metas,
        excluded=sorted(excluded), not_found=sorted(job.excluded - excluded), limit_identities=None,
        fingerprint=job.fingerprint, settings=settings, providers="none", workers=job.workers,
    )  # fmt: skip
    manifest["input"] = {**settings["input"], "rec": str(data.rec.resolve()), "idx": str(data.idx.resolve())}
    return manifest
