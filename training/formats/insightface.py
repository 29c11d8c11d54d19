"""insightface's face training sets in RecordIO: which records are images, their identities, and
the aligned crop they hold.

A set is a pair ``train.rec`` + ``train.idx`` (faces_webface_112x112, MS1M-ArcFace, Glint360K,
...). Two layouts are in use, told apart by record 0 as insightface's own loaders do:

* **identity header** (insightface's ``face2rec2`` packer): record 0 has ``flag > 0``, no image,
  and the labels ``(a, b)``: the images are records ``1 .. a-1``; records ``a .. b-1`` are the
  identity records, one per identity in order, whose labels ``(start, end)`` give that identity's
  images as records ``start .. end-1``. The packer writes record 0 and the identity records after
  the images. Each image record's first label is its identity's label.
* **plain** (insightface's ``RecBuilder``): every record in the index is an image, in index order,
  its label in the header (``flag == 0``) or first of its labels.

Each image is a face already aligned to the ArcFace template, a 112x112 crop (insightface's
``norm_crop``). No face is detected again: the crop a model needs is cut from the known template
points (:func:`models.arcface_crop.crop_from_arcface`; :func:`crop_rule` says how, in words).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.align import AlignmentTemplate
from models.arcface_crop import ARCFACE_SIZE, padding_share, whole_pixel_shift
from models.errors import FacePathError
from training.formats.recordio import (
    ImageRecord,
    check_offsets,
    damaged,
    read_index,
    read_record,
    unpack_image_record,
)
from training.prepare import DatasetError

LAYOUT_IDENTITY_HEADER = "insightface_identity_header"
LAYOUT_PLAIN = "insightface_plain"


def recordio_pair(path: str | Path) -> tuple[Path, Path] | None:
    """``(train.rec, train.idx)`` when ``path`` names a RecordIO set: a ``.rec`` file (its ``.idx``
    beside it), or a folder holding ``train.rec``; None for anything else.

    Raises:
        DatasetError: a RecordIO file without its index beside it.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "train.rec").is_file():
            return None
        path = path / "train.rec"
    elif path.suffix.lower() != ".rec":
        return None
    index = path.with_suffix(".idx")
    if not path.is_file():
        raise DatasetError(f"the RecordIO file {path} does not exist")
    if not index.is_file():
        raise DatasetError(
            f"the RecordIO file {path} has no index {index.name} beside it (insightface's sets come as "
            "train.rec + train.idx)"
        )
    return path, index


@dataclass(frozen=True)
class InsightFaceRecordIO:
    """An opened insightface RecordIO set: where its images are and, with an identity header, how
    its identities divide them.

    Attributes:
        rec, idx: the two files.
        size: the ``.rec`` file's size in bytes.
        layout: :data:`LAYOUT_IDENTITY_HEADER` or :data:`LAYOUT_PLAIN`.
        image_keys, image_offsets: int64 ``(N,)``: every image record's key and byte offset, in
            the set's order (record key order with a header, index order without).
        identity_ranges: int64 ``(C, 2)``: ``[start, end)`` image keys of each identity, from the
            identity records (None in the plain layout).
        identity_keys, identity_offsets: int64 ``(C,)``: the identity records (None without).
    """

    rec: Path
    idx: Path
    size: int
    layout: str
    image_keys: np.ndarray
    image_offsets: np.ndarray
    identity_ranges: np.ndarray | None = None
    identity_keys: np.ndarray | None = None
    identity_offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.image_keys)

    def read(self, file, key: int, offset: int) -> ImageRecord:
        """The image record ``key`` at ``offset``, read from ``file`` (``rec`` opened "rb")."""
        return unpack_image_record(read_record(file, self.size, self.rec, key, offset), self.rec, key, offset)

    def records(self) -> Iterator[tuple[int, int, ImageRecord]]:
        """``(key, label, record)`` of every image, in the set's order (:func:`class_label`)."""
        with open(self.rec, "rb") as file:
            for key, offset in zip(self.image_keys.tolist(), self.image_offsets.tolist(), strict=True):
                record = self.read(file, key, offset)
                yield key, class_label(record, self.rec, key, offset), record

    def identity_of(self, keys: np.ndarray) -> np.ndarray:
        """The identity (row of ``identity_ranges``) of each image key; header layout only."""
        assert self.identity_ranges is not None
        return np.searchsorted(self.identity_ranges[:, 0], keys, side="right") - 1


def class_label(record: ImageRecord, path: Path, key: int, offset: int) -> int:
    """An image record's identity label: its first label, a whole number >= 0.

    Raises:
        DamagedRecordError: the record has no label, or one that is not a class number.
    """
    if not record.labels:
        raise damaged(path, key, offset, "it has no label")
    label = record.labels[0]
    if not (label >= 0 and float(label).is_integer()):
        raise damaged(path, key, offset, f"its label {label!r} is not a class number (a whole number >= 0)")
    return int(label)


def open_insightface(path: str | Path) -> InsightFaceRecordIO:
    """Open a set (``train.rec``, or the folder holding it): read the index, check that every
    offset is inside the file, and find the images (and identities) by record 0.

    Raises:
        DatasetError: ``path`` is not a RecordIO set, or its index lists no record.
        DamagedRecordError: the index is malformed or points past the end of the file; record 0 or
            an identity record is damaged; the identity records do not divide the images.
    """
    pair = recordio_pair(path)
    if pair is None:
        raise DatasetError(f"{path} is neither a .rec file nor a folder holding train.rec")
    rec, idx = pair
    keys, offsets = read_index(idx)
    size = rec.stat().st_size
    check_offsets(rec, size, keys, offsets)
    offset_of = dict(zip(keys.tolist(), offsets.tolist(), strict=True))
    plain = InsightFaceRecordIO(rec, idx, size, LAYOUT_PLAIN, keys, offsets)
    if 0 not in offset_of:
        return plain
    with open(rec, "rb") as file:
        first = plain.read(file, 0, offset_of[0])
        if first.flag == 0 or first.image:
            return plain  # record 0 is an image: no identity header
        return _with_identity_header(plain, file, first, offset_of)


def _with_identity_header(
    plain: InsightFaceRecordIO, file, header: ImageRecord, offset_of: dict[int, int]
) -> InsightFaceRecordIO:
    """The set whose record 0 is the identity header ``header``."""
    rec = plain.rec
    labels = header.labels
    if len(labels) < 2 or not all(v.is_integer() for v in labels[:2]) or not 1 <= labels[0] <= labels[1]:
        raise damaged(
            rec, 0, offset_of[0],
            f"record 0 has flag {header.flag} and no image, as insightface's identity header, but its "
            f"labels {list(labels[:2])} are not the ranges (first identity record, end of identity records)",
        )  # fmt: skip
    first_identity, end = int(labels[0]), int(labels[1])
    image_keys = np.arange(1, first_identity, dtype=np.int64)
    identity_keys = np.arange(first_identity, end, dtype=np.int64)
    for needed in (image_keys, identity_keys):
        missing = [k for k in needed.tolist() if k not in offset_of]
        if missing:
            raise DatasetError(
                f"{plain.idx} lists no record {missing[0]} ({len(missing)} missing), though record 0's "
                f"identity header puts images at records 1..{first_identity - 1} and identities at "
                f"records {first_identity}..{end - 1}; the index does not belong to this file"
            )
    identity_offsets = np.asarray([offset_of[k] for k in identity_keys.tolist()], dtype=np.int64)
    ranges = _identity_ranges(plain, file, identity_keys, identity_offsets)
    _check_identity_ranges(rec, ranges, identity_keys, identity_offsets, first_identity)
    return InsightFaceRecordIO(
        rec, plain.idx, plain.size, LAYOUT_IDENTITY_HEADER, image_keys,
        np.asarray([offset_of[k] for k in image_keys.tolist()], dtype=np.int64),
        ranges, identity_keys, identity_offsets,
    )  # fmt: skip


def _identity_ranges(plain: InsightFaceRecordIO, file, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``(C, 2)`` ``[start, end)`` of every identity record, read in file order."""
    ranges = np.empty((len(keys), 2), dtype=np.int64)
    for row in np.argsort(offsets, kind="stable").tolist():
        key, offset = int(keys[row]), int(offsets[row])
        record = plain.read(file, key, offset)
        labels = record.labels
        if record.flag < 2 or not all(v.is_integer() for v in labels[:2]):
            raise damaged(
                plain.rec, key, offset,
                f"as identity record {row} it needs the labels (first image, end of images), but it has "
                f"flag {record.flag} and labels {list(labels[:2])}",
            )  # fmt: skip
        ranges[row] = (int(labels[0]), int(labels[1]))
    return ranges


def _check_identity_ranges(
    rec: Path, ranges: np.ndarray, keys: np.ndarray, offsets: np.ndarray, first_identity: int
) -> None:
    """The identity ranges cover the images ``1 .. first_identity-1`` in order, each non-empty."""
    expected_start = 1
    for row, (start, end) in enumerate(ranges.tolist()):
        if start != expected_start or end <= start:
            raise damaged(
                rec, int(keys[row]), int(offsets[row]),
                f"identity {row} covers image records [{start}, {end}); the identities must divide the "
                f"images 1..{first_identity - 1} in order, so it should start at {expected_start} and not be "
                "empty",
            )  # fmt: skip
        expected_start = end
    if expected_start != first_identity:
        raise damaged(
            rec, int(keys[-1]), int(offsets[-1]),
            f"the identities end at image record {expected_start - 1}, but the images run to record "
            f"{first_identity - 1}",
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The aligned crops
# --------------------------------------------------------------------------------------------


def crop_rule(template: AlignmentTemplate) -> str:
    """How :func:`models.arcface_crop.crop_from_arcface` makes ``template``'s crop from a 112x112
    record, in words (for the manifest)."""
    shift = whole_pixel_shift(template)
    if shift is not None:
        left, top = -shift[0], -shift[1]
        return (
            f"rows {top}-{top + template.height - 1}, columns {left}-{left + template.width - 1} of each "
            f"ArcFace-aligned 112x112 record ({template.name} is the ArcFace template moved by whole "
            "pixels); no detection"
        )
    return (
        f"re-warped from the ArcFace template's five points onto {template.name} (similarity transform, "
        f"bilinear); black (0) padding where the crop reaches beyond the record "
        f"({100 * padding_share(template):.1f}% of it); no detection"
    )


def decode_face(data: bytes, path: Path, key: int, offset: int) -> np.ndarray:
    """Decode a record's image: an ArcFace-aligned ``(112, 112, 3)`` uint8 RGB face.

    Raises:
        DamagedRecordError: the image cannot be decoded.
        DatasetError: it is not 112x112, so not an ArcFace-aligned face.
    """
    from models.image import decode_image

    try:
        image = decode_image(data)
    except FacePathError as exc:
        raise damaged(path, key, offset, f"its image cannot be decoded ({exc.message})") from None
    height, width = image.shape[:2]
    if (height, width) != ARCFACE_SIZE:
        raise DatasetError(
            f"{path}: record {key} at byte offset {offset} holds a {width}x{height} image; insightface's "
            "sets hold ArcFace-aligned 112x112 faces, which this is not"
        )
    return image
