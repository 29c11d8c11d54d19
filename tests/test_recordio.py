"""insightface RecordIO sets: our reader against a writer written here byte for byte from the
format (dmlc-core's framing, MXNet's ``IfQQ`` header, insightface's two layouts), on real faces
aligned by the project's MTCNN to the ArcFace 112x112 template; ``sphereface prepare train.rec``
then ``sphereface train``; damaged files refused naming the record and its byte offset; resume;
WebFace42M's folders of identity folders read as one set.

No second, independent writer is installed: PyPI has no pure-Python MXNet RecordIO writer
(``mx-recordio`` loads ``libmxnet.so`` and pins numpy < 2; ``recordio-py``, ``pyrecordio`` and
``pp-recordio`` write other formats of the same name), and MXNet itself is not installed. The
writer below is therefore checked against the bytes of dmlc-core's own framing example.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.align import ARCFACE_TEMPLATE_112x112, align_face
from tests.conftest import require_shared
from training.formats.insightface import LAYOUT_IDENTITY_HEADER, LAYOUT_PLAIN, open_insightface
from training.formats.prepare_recordio import prepare_recordio
from training.formats.recordio import DamagedRecordError, read_index, read_record
from training.prepare import IMAGE_EXTENSIONS, DatasetError, list_photos, load_prepared

pytestmark = pytest.mark.shared_data

IDENTITIES = 4
PHOTOS_PER_IDENTITY = 8

# --------------------------------------------------------------------------------------------
# A writer of the format, independent of the reader: struct calls, by hand
# --------------------------------------------------------------------------------------------

MAGIC = 0xCED7230A


def frame(payload: bytes) -> bytes:
    """One record as dmlc-core's RecordIOWriter lays it out: cut at every 4-byte aligned copy of
    the magic number (those 4 bytes are not written), the pieces as parts with cflag 1, 2, 3
    (0 when there is one), each ``magic, (cflag << 29) | length, data``, zero-padded to 4."""
    magic = struct.pack("<I", MAGIC)
    cuts = [i for i in range(0, len(payload) // 4 * 4, 4) if payload[i : i + 4] == magic]
    starts = [0, *(i + 4 for i in cuts)]
    ends = [*cuts, len(payload)]
    out = b""
    for n, (a, b) in enumerate(zip(starts, ends, strict=True)):
        cflag = 0 if len(starts) == 1 else 1 if n == 0 else 3 if n == len(starts) - 1 else 2
        out += struct.pack("<II", MAGIC, (cflag << 29) | (b - a)) + payload[a:b] + b"\0" * (-(b - a) % 4)
    return out


def pack(image: bytes, key: int, label: float | None = None, labels: list[float] | None = None) -> bytes:
    """MXNet's image record: ``IfQQ`` (flag, label, id, id2), then ``flag`` float labels, then the
    image; one label goes in the header with flag 0."""
    if labels is None:
        return struct.pack("<IfQQ", 0, label, key, 0) + image
    return struct.pack("<IfQQ", len(labels), 0.0, key, 0) + struct.pack(f"<{len(labels)}f", *labels) + image


def write_pair(folder: Path, records: list[tuple[int, bytes]]) -> Path:
    """``train.rec`` + ``train.idx`` (``key<TAB>offset`` per line) with the records in this order."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.rec", "wb") as rec, open(folder / "train.idx", "w") as idx:
        for key, payload in records:
            idx.write(f"{key}\t{rec.tell()}\n")
            rec.write(frame(payload))
    return folder / "train.rec"


def with_magic_inside(jpeg: bytes, header_bytes: int) -> bytes:
    """``jpeg`` with a comment segment holding the magic number twice at 4-byte aligned positions
    of the record (``header_bytes`` precede the image in it), so the writer must split it."""
    pad = -(header_bytes + 2 + 4) % 4
    body = b"x" * pad + struct.pack("<I", MAGIC) * 2 + b"tail"
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


def face2rec2_records(faces: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """insightface's identity-header layout: images 1..N (labels ``[label, 1.0]``), then record
    0 (labels ``[N+1, N+1+C]``, no image) and one identity record per label (``[start, end)``)."""
    images = [
        (key, pack(jpeg, key, labels=[float(label), 1.0])) for key, (label, jpeg) in enumerate(faces, 1)
    ]
    bounds = []
    for key, (label, _) in enumerate(faces, 1):
        if not bounds or faces[bounds[-1][0] - 1][0] != label:
            bounds.append([key, key + 1])
        bounds[-1][1] = key + 1
    first_identity = len(faces) + 1
    header = (0, pack(b"", 0, labels=[float(first_identity), float(first_identity + len(bounds))]))
    identities = [
        (first_identity + j, pack(b"", first_identity + j, labels=[float(a), float(b)]))
        for j, (a, b) in enumerate(bounds)
    ]
    return [*images, header, *identities]


def recbuilder_records(faces: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """insightface's plain layout: images 0..N-1, the label in the header (flag 0)."""
    return [(key, pack(jpeg, key, label=float(label))) for key, (label, jpeg) in enumerate(faces)]


# --------------------------------------------------------------------------------------------
# Real faces, aligned to the ArcFace template
# --------------------------------------------------------------------------------------------


def _jpeg(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _decoded(jpeg: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


@pytest.fixture(scope="module")
def faces() -> list[tuple[int, bytes]]:
    """``(label, ArcFace-aligned 112x112 JPEG)`` of a few celeba_faces identities, by label; one
    record holds the magic number twice."""
    from models.image import read_image
    from models.mtcnn import MTCNNDetector, select_faces

    celeba = require_shared("celeba_faces")
    detector = MTCNNDetector(intra_op_threads=1)
    out = []
    for label, folder in enumerate(sorted(p for p in celeba.iterdir() if p.is_dir())[:IDENTITIES]):
        photos = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        for photo in photos[:PHOTOS_PER_IDENTITY]:
            image = read_image(photo)
            found = select_faces(detector.detect(image), "central", image.shape)
            if found:
                out.append((label, _jpeg(align_face(image, found[0].landmarks, ARCFACE_TEMPLATE_112x112))))
    assert len({label for label, _ in out}) == IDENTITIES and len(out) >= 24
    label, jpeg = out[5]
    out[5] = (label, with_magic_inside(jpeg, 24 + 8))  # face2rec2's image header: IfQQ + 2 labels
    return out


@pytest.fixture(scope="module")
def header_set(faces, tmp_path_factory) -> Path:
    return write_pair(tmp_path_factory.mktemp("rec") / "face2rec2", face2rec2_records(faces))


@pytest.fixture(scope="module")
def plain_set(faces, tmp_path_factory) -> Path:
    return write_pair(tmp_path_factory.mktemp("rec") / "recbuilder", recbuilder_records(faces))


def _parts(rec: Path) -> list[int]:
    """The cflag of every part of a .rec file, walking the framing from the start."""
    data, position, flags = rec.read_bytes(), 0, []
    while position < len(data):
        magic, lrecord = struct.unpack_from("<II", data, position)
        assert magic == MAGIC
        flags.append(lrecord >> 29)
        position += 8 + ((lrecord & ((1 << 29) - 1)) + 3) // 4 * 4
    return flags


# --------------------------------------------------------------------------------------------
# The framing and the reader
# --------------------------------------------------------------------------------------------


def test_the_writer_lays_out_dmlc_cores_own_example_and_the_reader_joins_it(tmp_path):
    """dmlc-core's recordio test writes the words {magic, 0, 2, 3, magic, magic}: a record split
    in four parts (an empty first, the three words, two empty ones), the magic numbers left out."""
    payload = struct.pack("<6I", MAGIC, 0, 2, 3, MAGIC, MAGIC)
    expected = b"".join(
        [
            struct.pack("<II", MAGIC, 1 << 29 | 0),
            struct.pack("<II", MAGIC, 2 << 29 | 12) + struct.pack("<3I", 0, 2, 3),
            struct.pack("<II", MAGIC, 2 << 29 | 0),
            struct.pack("<II", MAGIC, 3 << 29 | 0),
        ]
    )
    assert frame(payload) == expected
    second = b"hello worldxx!"  # 14 bytes: 2 bytes of padding
    rec = write_pair(tmp_path, [(7, payload), (9, second)])
    keys, offsets = read_index(tmp_path / "train.idx")
    assert keys.tolist() == [7, 9] and offsets.tolist() == [0, len(expected)]
    with open(rec, "rb") as file:
        size = rec.stat().st_size
        assert read_record(file, size, rec, 7, 0) == payload
        assert read_record(file, size, rec, 9, len(expected)) == second
    assert size == len(expected) + 8 + 16


@pytest.mark.parametrize("layout", [LAYOUT_IDENTITY_HEADER, LAYOUT_PLAIN])
def test_reading_returns_the_written_images_and_labels(layout, faces, header_set, plain_set):
    data = open_insightface(header_set.parent if layout == LAYOUT_IDENTITY_HEADER else plain_set)
    assert data.layout == layout
    assert len(data) == len(faces)
    read = list(data.records())
    assert [label for _, label, _ in read] == [label for label, _ in faces]
    assert [record.image for _, _, record in read] == [jpeg for _, jpeg in faces]
    first = 1 if layout == LAYOUT_IDENTITY_HEADER else 0
    assert [key for key, _, _ in read] == list(range(first, first + len(faces)))
    for (_, _, record), (_, jpeg) in zip(read, faces, strict=True):
        assert np.array_equal(_decoded(record.image), _decoded(jpeg))
    if layout == LAYOUT_IDENTITY_HEADER:
        counts = np.bincount([label for label, _ in faces])
        assert (data.identity_ranges[:, 1] - data.identity_ranges[:, 0]).tolist() == counts.tolist()
        assert data.identity_ranges[0, 0] == 1 and data.identity_ranges[-1, 1] == len(faces) + 1
        assert read[5][2].labels == (float(faces[5][0]), 1.0)
    else:
        assert data.identity_ranges is None and read[0][2].flag == 0


def test_a_record_holding_the_magic_number_is_split_and_rejoined(faces, header_set):
    """The writer cut the record that holds the magic number twice into first, middle and last
    parts; the reader gives back its exact bytes."""
    flags = _parts(header_set)
    assert flags.count(1) == 1 and flags.count(2) == 1 and flags.count(3) == 1
    data = open_insightface(header_set)
    with open(header_set, "rb") as file:
        record = data.read(file, 6, int(data.image_offsets[5]))
    assert record.image == faces[5][1] and struct.pack("<I", MAGIC) * 2 in record.image


def test_the_crop_rule_names_the_columns_or_the_padding():
    from models.align import DLIB_TEMPLATE_150x150, SPHEREFACE_TEMPLATE_112x96
    from training.formats.insightface import crop_rule

    assert crop_rule(SPHEREFACE_TEMPLATE_112x96).startswith("rows 0-111, columns 8-103 of each")
    rewarped = crop_rule(DLIB_TEMPLATE_150x150)
    assert rewarped.startswith("re-warped from the ArcFace template's five points onto dlib_150x150")
    assert "black (0) padding where the crop reaches beyond the record (10.3% of it)" in rewarped


# --------------------------------------------------------------------------------------------
# sphereface prepare train.rec, then sphereface train
# --------------------------------------------------------------------------------------------


def _train_overrides(prepared: Path, out_dir: Path, name: str, steps: int) -> list[str]:
    return [
        f"data={prepared}", f"out_dir={out_dir}", f"name={name}", "network=sphereface4", "batch_size=8",
        "log_every=1", "checkpoint_every=10", 'lfw=""', "threads=1", f"steps={steps}", "lr=0.01",
    ]  # fmt: skip


@pytest.mark.slow
def test_prepare_from_recordio_then_train_20_steps(faces, header_set, tmp_path, capsys):
    from models.cli import main

    out = tmp_path / "prepared"
    assert main(["prepare", str(header_set), "--out", str(out), "--workers", "2", "--shard-size", "10"]) == 0
    assert "Prepared" in capsys.readouterr().out
    dataset = load_prepared(out)
    images, labels = dataset.concatenate()
    expected = np.stack([_decoded(jpeg)[:, 8:104] for _, jpeg in faces])
    assert images.shape == (len(faces), 112, 96, 3) and np.array_equal(images, expected)
    assert labels.tolist() == [label for label, _ in faces]
    assert dataset.identities == [f"{label:08d}" for label in range(IDENTITIES)]
    manifest = dataset.manifest
    assert manifest["input"]["layout"] == LAYOUT_IDENTITY_HEADER
    assert manifest["input"]["crop"].startswith("rows 0-111, columns 8-103")
    assert manifest["template"] == "sphereface_112x96" and manifest["num_skipped"] == 0
    assert len(manifest["shards"]) == -(-len(faces) // 10)

    overrides = _train_overrides(out, tmp_path / "runs", "rec", 20)
    assert main(["train", "--no-progress", *(a for o in overrides for a in ("--set", o))]) == 0
    with (tmp_path / "runs" / "rec" / "log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    assert all(np.isfinite(float(r["loss"])) for r in rows)
    summary = json.loads((tmp_path / "runs" / "rec" / "summary.json").read_text())
    assert summary["num_classes"] == IDENTITIES


def test_the_plain_layout_prepares_with_the_header_labels(faces, plain_set, tmp_path):
    dataset = prepare_recordio(plain_set.parent, tmp_path / "plain", workers=1, progress=False)
    images, labels = dataset.concatenate()
    assert labels.tolist() == [label for label, _ in faces]
    assert np.array_equal(images[3], _decoded(faces[3][1])[:, 8:104])
    assert dataset.manifest["input"]["layout"] == LAYOUT_PLAIN


def test_excluded_identities_are_left_out_and_recorded(faces, header_set, tmp_path):
    dataset = prepare_recordio(
        header_set, tmp_path / "ex", exclude_identities=["00000001", "00000099"], workers=1, progress=False
    )
    assert dataset.identities == ["00000000", "00000002", "00000003"]
    assert dataset.num_images == sum(1 for label, _ in faces if label != 1)
    manifest = dataset.manifest
    assert manifest["excluded_identities"] == ["00000001"]
    assert manifest["exclusions_not_found"] == ["00000099"]
    assert manifest["skipped_by_reason"] == {"excluded_identity": sum(1 for label, _ in faces if label == 1)}


def test_a_deleted_shard_is_redone_and_the_rest_reused(header_set, tmp_path):
    out = tmp_path / "resume"
    first = prepare_recordio(header_set, out, workers=1, shard_size=8, progress=False)
    images, labels = first.concatenate()
    for name in ("images_00001.npy", "meta_00001.json"):
        (out / name).unlink()
    again = prepare_recordio(header_set, out, workers=1, shard_size=8, progress=False)
    assert again.last_run["shards_written"] == 1
    assert again.last_run["shards_reused"] == len(first.manifest["shards"]) - 1
    assert again.last_run["photos_processed"] == 8
    redone_images, redone_labels = again.concatenate()
    assert np.array_equal(redone_images, images) and np.array_equal(redone_labels, labels)
    done = prepare_recordio(header_set, out, workers=1, shard_size=8, progress=False)
    assert done.last_run["photos_processed"] == 0


def test_a_dead_worker_is_named_by_its_records_and_a_rerun_continues(header_set, tmp_path, monkeypatch):
    """A worker that dies on the second shard (here: the pool's report of it, raised after the
    first shard's chunks) names the record keys it was on; the written shard is kept."""
    import training.formats.prepare_recordio as prepare_module
    from training.worker_pool import WorkerDied

    real = prepare_module.decoded_chunks

    def dies_on_the_second_shard(tasks, workers, rec, size):
        for task in tasks:
            if task[0] >= 8:
                raise WorkerDied("a worker process died while running 1 task(s)", [task])
            yield from real([task], 1, rec, size)

    monkeypatch.setattr(prepare_module, "decoded_chunks", dies_on_the_second_shard)
    out = tmp_path / "died"
    with pytest.raises(
        WorkerDied, match=r"while on records 9\.\.16 of shard 1 \(killed.*1 of \d+ shards are written"
    ):
        prepare_recordio(header_set, out, workers=2, shard_size=8, progress=False)
    kept = (out / "meta_00000.json").read_bytes()
    monkeypatch.setattr(prepare_module, "decoded_chunks", real)
    again = prepare_recordio(header_set, out, workers=2, shard_size=8, progress=False)
    assert again.last_run["shards_reused"] == 1 and (out / "meta_00000.json").read_bytes() == kept


# --------------------------------------------------------------------------------------------
# Damaged files
# --------------------------------------------------------------------------------------------


def _copy(rec: Path, tmp_path: Path) -> tuple[Path, dict[int, int]]:
    folder = tmp_path / "damaged"
    shutil.copytree(rec.parent, folder)
    keys, offsets = read_index(folder / "train.idx")
    return folder / "train.rec", dict(zip(keys.tolist(), offsets.tolist(), strict=True))


def _bad_magic(rec: Path, offset_of: dict[int, int]) -> tuple[int, str]:
    data = bytearray(rec.read_bytes())
    data[offset_of[9] : offset_of[9] + 4] = b"JUNK"
    rec.write_bytes(bytes(data))
    return 9, "bad magic"


def _truncated(rec: Path, offset_of: dict[int, int]) -> tuple[int, str]:
    """(On the plain layout, whose last record is an image.) The last record cut short."""
    last = max(offset_of, key=offset_of.get)
    rec.write_bytes(rec.read_bytes()[: offset_of[last] + 100])
    return last, "truncated"


def _offset_past_end(rec: Path, offset_of: dict[int, int]) -> tuple[int, str]:
    idx = rec.with_suffix(".idx")
    lines = idx.read_text().splitlines()
    lines = [f"12\t{rec.stat().st_size + 64}" if line.split("\t")[0] == "12" else line for line in lines]
    idx.write_text("\n".join(lines) + "\n")
    return 12, "past the end of the file"


def _undecodable(rec: Path, offset_of: dict[int, int]) -> tuple[int, str]:
    data = bytearray(rec.read_bytes())
    start = offset_of[3] + 8 + 24 + 8  # part header, IfQQ, two labels: the JPEG's first byte
    data[start : start + 400] = bytes(range(200)) * 2
    rec.write_bytes(bytes(data))
    return 3, "cannot be decoded"


@pytest.mark.parametrize("damage", [_bad_magic, _truncated, _offset_past_end, _undecodable])
def test_a_damaged_file_is_refused_naming_the_record_and_its_offset(damage, header_set, plain_set, tmp_path):
    rec, offset_of = _copy(plain_set if damage is _truncated else header_set, tmp_path)
    key, problem = damage(rec, offset_of)
    keys, offsets = read_index(rec.with_suffix(".idx"))
    offset = int(offsets[keys.tolist().index(key)])
    with pytest.raises(DamagedRecordError, match=f"record {key} at byte offset {offset}: .*{problem}"):
        prepare_recordio(rec, tmp_path / "out", workers=2, shard_size=8, progress=False)


def test_the_command_line_names_the_damage(header_set, tmp_path, capsys):
    from models.cli import main

    rec, offset_of = _copy(header_set, tmp_path)
    _bad_magic(rec, offset_of)
    assert main(["prepare", str(rec), "--out", str(tmp_path / "out"), "--workers", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert error.startswith("error [damaged_recordio]: ")
    assert f"record 9 at byte offset {offset_of[9]}: bad magic 0x4b4e554a" in error


def test_an_image_whose_label_is_not_its_identitys_is_refused(faces, tmp_path):
    """Identity record 0 gives image 2 to the first identity; a label of 3 there is refused."""
    records = face2rec2_records(faces)
    key, payload = records[1]
    records[1] = (key, payload[:24] + struct.pack("<2f", 3.0, 1.0) + payload[32:])
    rec = write_pair(tmp_path / "mislabelled", records)
    with pytest.raises(
        DamagedRecordError, match="record 2 at byte offset .* label 3 differs from the label 0"
    ):
        prepare_recordio(rec, tmp_path / "out", workers=1, progress=False)


def test_an_index_line_that_is_not_key_and_offset_is_named(header_set, tmp_path):
    rec, _ = _copy(header_set, tmp_path)
    idx = rec.with_suffix(".idx")
    lines = idx.read_text().splitlines()
    lines[4] = "5 oops"
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(DamagedRecordError, match="line 5 is '5 oops', not 'key<TAB>offset'"):
        open_insightface(rec)


def test_a_rec_without_its_index_is_refused(header_set, tmp_path):
    lonely = tmp_path / "train.rec"
    shutil.copy(header_set, lonely)
    with pytest.raises(DatasetError, match="has no index train.idx beside it"):
        open_insightface(lonely)


# --------------------------------------------------------------------------------------------
# WebFace42M's layout: folders of identity folders
# --------------------------------------------------------------------------------------------


def _nested_copy(celeba: Path, root: Path, groups: int, per_group: int, photos: int) -> list[str]:
    """``root/<g>/<identity>/`` for ``groups`` groups of ``per_group`` identities (symlinks to
    ``photos`` celeba photos each), as WebFace42M's folders 0..9; returns the identity names."""
    names = sorted(p.name for p in celeba.iterdir() if p.is_dir())[: groups * per_group]
    for i, name in enumerate(names):
        folder = root / str(i // per_group) / name
        folder.mkdir(parents=True)
        for photo in sorted((celeba / name).iterdir())[:photos]:
            (folder / photo.name).symlink_to(photo)
    return names


def test_folders_of_identity_folders_are_listed_as_one_set(tmp_path):
    celeba = require_shared("celeba_faces")
    names = _nested_copy(celeba, tmp_path / "webface", groups=3, per_group=2, photos=2)
    identities, photos, _, _ = list_photos(tmp_path / "webface")
    assert identities == names
    assert photos[0] == (f"0/{names[0]}/{sorted(p.name for p in (celeba / names[0]).iterdir())[0]}", 0)
    assert [label for _, label in photos] == [i for i in range(6) for _ in range(2)]
    (tmp_path / "webface" / "2" / names[0]).mkdir()
    with pytest.raises(DatasetError, match=f"the identity '{names[0]}' is in two of them"):
        list_photos(tmp_path / "webface")


def test_a_loose_photo_beside_the_groups_keeps_the_one_level_layout(tmp_path):
    celeba = require_shared("celeba_faces")
    names = _nested_copy(celeba, tmp_path / "mixed", groups=2, per_group=1, photos=1)
    (tmp_path / "mixed" / "0" / "loose.jpg").symlink_to(next((celeba / names[0]).iterdir()))
    identities, photos, _, _ = list_photos(tmp_path / "mixed")
    assert identities == ["0", "1"] and [p for p, _ in photos] == ["0/loose.jpg"]


@pytest.mark.slow
def test_webface42m_layout_prepares_as_the_flat_one_does(tmp_path):
    from training.prepare import prepare_dataset

    celeba = require_shared("celeba_faces")
    names = _nested_copy(celeba, tmp_path / "nested", groups=2, per_group=2, photos=2)
    for name in names:
        (tmp_path / "flat" / name).mkdir(parents=True)
        for photo in sorted((celeba / name).iterdir())[:2]:
            (tmp_path / "flat" / name / photo.name).symlink_to(photo)
    nested = prepare_dataset(tmp_path / "nested", tmp_path / "out_nested", workers=1, progress=False)
    flat = prepare_dataset(tmp_path / "flat", tmp_path / "out_flat", workers=1, progress=False)
    assert nested.identities == flat.identities == names
    for a, b in zip(nested.concatenate(), flat.concatenate(), strict=True):
        assert np.array_equal(a, b)
    meta = json.loads((tmp_path / "out_nested" / "meta_00000.json").read_text())
    assert meta["paths"][0].startswith(f"0/{names[0]}/")
