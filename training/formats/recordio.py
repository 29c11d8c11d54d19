"""MXNet's RecordIO container, read without MXNet: the record framing, the ``.idx`` index and the
image record header.

Framing (dmlc-core's ``RecordIOWriter``), little-endian, every part starting 4-byte aligned::

    uint32 magic    0xCED7230A
    uint32 lrecord  upper 3 bits: cflag; lower 29 bits: the length of this part's data in bytes
    data[length]    then zero bytes up to the next multiple of 4

The writer never lets the magic number stand in a record's data at a 4-byte aligned position: it
cuts the record there, leaves those 4 bytes out, and writes the pieces as consecutive parts with
cflag 1 (first), 2 (middle) and 3 (last); cflag 0 is a whole record. A reader joins the parts
with the magic number between them. Every part but the last ends at an aligned position, so only
the last one is padded.

Index (``.idx``): text, one line per record, ``key<TAB>offset``: the byte offset of the record's
first part. Keys need not follow file order (insightface's packer writes record 0 after the
images).

Image record (``mxnet.recordio.pack``): the header ``struct "IfQQ"`` (flag uint32, label
float32, id uint64, id2 uint64: 24 bytes, no padding); when ``flag > 0`` the label field is
unused and ``flag`` float32 labels follow; then the encoded image (JPEG or PNG) to the end.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from training.prepare import DatasetError

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
#: The longest part the 29-bit length field holds, in bytes.
MAX_PART_BYTES = (1 << 29) - 1
FRAME = struct.Struct("<II")
IMAGE_HEADER = struct.Struct("<IfQQ")
#: cflag of a whole record, and of the first, middle and last part of a split one.
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
_INDEX_BLOCK_BYTES = 64 << 20


class DamagedRecordError(DatasetError):
    """A RecordIO file or its index is damaged: the message names the file, the record (its key)
    and the byte offset where the damage is."""

    code = "damaged_recordio"


def damaged(path: Path, key: int, offset: int, problem: str) -> DamagedRecordError:
    """The error for record ``key`` at byte ``offset`` of ``path``."""
    return DamagedRecordError(f"{path}: record {key} at byte offset {offset}: {problem}; the file is damaged")


@dataclass(frozen=True)
class ImageRecord:
    """One unpacked image record.

    Attributes:
        flag: the header's flag: 0 for one label in the header, else the number of labels.
        labels: ``(label,)`` when ``flag == 0``, else the ``flag`` labels that follow the header.
        id, id2: the header's two ids (MXNet's packers write the record's key and 0).
        image: the encoded image bytes (empty in insightface's header and identity records).
    """

    flag: int
    labels: tuple[float, ...]
    id: int
    id2: int
    image: bytes


def unpack_image_record(payload: bytes, path: Path, key: int, offset: int) -> ImageRecord:
    """Split a record's bytes into the ``IfQQ`` header, its labels and the image.

    Raises:
        DamagedRecordError: the record is shorter than its header and labels.
    """
    if len(payload) < IMAGE_HEADER.size:
        problem = f"its {len(payload)} bytes are shorter than the 24-byte image header"
        raise damaged(path, key, offset, problem)
    flag, label, id1, id2 = IMAGE_HEADER.unpack_from(payload)
    start = IMAGE_HEADER.size
    if flag == 0:
        return ImageRecord(0, (float(label),), id1, id2, payload[start:])
    end = start + 4 * flag
    if end > len(payload):
        raise damaged(
            path, key, offset,
            f"its header announces {flag} float labels ({4 * flag} bytes) but only "
            f"{len(payload) - start} bytes follow the header",
        )  # fmt: skip
    labels = tuple(float(v) for v in np.frombuffer(payload, dtype="<f4", count=flag, offset=start))
    return ImageRecord(flag, labels, id1, id2, payload[end:])


def read_record(file: BinaryIO, size: int, path: Path, key: int, offset: int) -> bytes:
    """The bytes of the record whose first part starts at ``offset``, its parts rejoined.

    Args:
        file: ``path`` opened for binary reading (it is seeked).
        size: the file's size in bytes.

    Raises:
        DamagedRecordError: a part without the magic number, a record that starts with a middle
            or last part, a split record whose parts are out of order, or a part running past the
            end of the file.
    """
    parts: list[bytes] = []
    position = offset
    while True:
        if position + FRAME.size > size:
            raise damaged(
                path, key, offset,
                f"the part header at byte {position} runs past the end of the file ({size} bytes): truncated",
            )  # fmt: skip
        file.seek(position)
        magic, lrecord = FRAME.unpack(file.read(FRAME.size))
        if magic != MAGIC:
            where = "" if position == offset else f" (part at byte {position})"
            raise damaged(path, key, offset, f"bad magic 0x{magic:08x}{where}, expected 0x{MAGIC:08x}")
        cflag, length = lrecord >> 29, lrecord & MAX_PART_BYTES
        _check_cflag(path, key, offset, position, cflag, first=not parts)
        padded = (length + 3) & ~3
        data = file.read(padded)
        if len(data) < padded:
            raise damaged(
                path, key, offset,
                f"its payload of {length} bytes at byte {position + FRAME.size} runs past the end of the "
                f"file ({size} bytes): truncated",
            )  # fmt: skip
        parts.append(data[:length])
        position += FRAME.size + padded
        if cflag in (WHOLE, LAST):
            return MAGIC_BYTES.join(parts)


def _check_cflag(path: Path, key: int, offset: int, position: int, cflag: int, first: bool) -> None:
    if first and cflag not in (WHOLE, FIRST):
        raise damaged(
            path, key, offset,
            f"it starts with a continuation part (cflag {cflag}): the index points into the middle of "
            "a record",
        )  # fmt: skip
    if not first and cflag not in (MIDDLE, LAST):
        raise damaged(
            path, key, offset,
            f"the part at byte {position} has cflag {cflag}, but a split record continues with cflag 2 or 3",
        )  # fmt: skip


def read_index(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The keys and offsets of a ``.idx`` file, in line order, as two int64 arrays.

    Raises:
        DatasetError: the file cannot be read or holds no record.
        DamagedRecordError: a line that is not ``key<TAB>offset`` (the message names it), a
            negative offset, or a key given twice.
    """
    path = Path(path)
    keys: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    line = 1
    for block in _index_blocks(path):
        values = _parse_index_block(path, block, line)
        keys.append(values[0::2])
        offsets.append(values[1::2])
        line += len(values) // 2
    all_keys = np.concatenate(keys) if keys else np.empty(0, np.int64)
    all_offsets = np.concatenate(offsets) if offsets else np.empty(0, np.int64)
    if len(all_keys) == 0:
        raise DatasetError(f"the index {path} lists no record")
    _check_index_values(path, all_keys, all_offsets)
    return all_keys, all_offsets


def _index_blocks(path: Path) -> Iterator[bytes]:
    """The index file in blocks of whole lines (about 64 MiB each), blank tail removed."""
    try:
        with open(path, "rb") as file:
            rest = b""
            while chunk := file.read(_INDEX_BLOCK_BYTES):
                chunk = rest + chunk
                cut = chunk.rfind(b"\n") + 1
                rest = chunk[cut:]
                if chunk[:cut].strip():
                    yield chunk[:cut]
            if rest.strip():
                yield rest
    except OSError as exc:
        raise DatasetError(f"cannot read the index {path}: {exc.strerror or exc}") from exc


def _parse_index_block(path: Path, block: bytes, first_line: int) -> np.ndarray:
    """``[key0, offset0, key1, offset1, ...]`` of a block of whole lines."""
    block = block.rstrip()
    lines = block.count(b"\n") + 1
    try:
        values = np.fromstring(block, dtype=np.int64, sep=" ")
    except ValueError:
        values = None
    if values is None or len(values) != 2 * lines:
        raise DamagedRecordError(_bad_index_line(path, block, first_line))
    return values


def _bad_index_line(path: Path, block: bytes, first_line: int) -> str:
    for number, text in enumerate(block.split(b"\n"), start=first_line):
        fields = text.strip().split(b"\t")
        if len(fields) != 2 or not all(f.strip().lstrip(b"-").isdigit() for f in fields):
            shown = text[:80].decode("utf-8", "replace")
            return f"{path} line {number} is {shown!r}, not 'key<TAB>offset'; the index is damaged"
    return f"{path} has a line that is not 'key<TAB>offset' after line {first_line}; the index is damaged"


def _check_index_values(path: Path, keys: np.ndarray, offsets: np.ndarray) -> None:
    if (offsets < 0).any():
        at = int(np.argmax(offsets < 0))
        raise DamagedRecordError(
            f"{path} line {at + 1}: record {keys[at]} has the negative offset {offsets[at]}; the index "
            "is damaged"
        )
    unique, counts = np.unique(keys, return_counts=True)
    if (counts > 1).any():
        twice = int(unique[np.argmax(counts > 1)])
        lines = (np.flatnonzero(keys == twice)[:2] + 1).tolist()
        raise DamagedRecordError(
            f"{path}: record {twice} is listed twice (lines {lines[0]} and {lines[1]}); the index is damaged"
        )


def check_offsets(rec_path: Path, size: int, keys: np.ndarray, offsets: np.ndarray) -> None:
    """Every offset leaves room for a part header inside the file.

    Raises:
        DamagedRecordError: naming the first record (in index order) whose offset is past the end.
    """
    past = offsets + FRAME.size > size
    if past.any():
        at = int(np.argmax(past))
        raise damaged(
            rec_path, int(keys[at]), int(offsets[at]),
            f"the index puts it past the end of the file ({size} bytes)",
        )  # fmt: skip
