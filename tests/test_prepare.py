"""Training-data preparation: detect + align a CASIA-style identity-folder dataset into shards."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.align import SPHEREFACE_TEMPLATE_112x96, similarity_transform
from models.errors import SphereFaceError
from models.mtcnn import MTCNNDetector, select_faces
from tests.conftest import require_shared
from training.prepare import (
    IMAGE_EXTENSIONS,
    DatasetError,
    DatasetMismatchError,
    PreparedDataset,
    load_prepared,
    load_training_set,
    prepare_dataset,
)
from training.worker_pool import WorkerDied, ordered_results

pytestmark = pytest.mark.shared_data

LIMIT = 3
SHARD_SIZE = 16  # several shards (one of them partial) from about 60 photos


@pytest.fixture(scope="module")
def celeba() -> Path:
    return require_shared("celeba_faces")


@pytest.fixture(scope="module")
def first_identities(celeba: Path) -> list[str]:
    return sorted(p.name for p in celeba.iterdir() if p.is_dir())[:LIMIT]


def _photos(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


@pytest.fixture(scope="module")
def prepared(celeba: Path, tmp_path_factory: pytest.TempPathFactory) -> PreparedDataset:
    out = tmp_path_factory.mktemp("prepared") / "celeba3"
    return prepare_dataset(
        celeba, out, limit_identities=LIMIT, workers=2, shard_size=SHARD_SIZE, progress=False
    )


@pytest.fixture(scope="module")
def detector() -> MTCNNDetector:
    return MTCNNDetector(intra_op_threads=1)


def _shard_paths(dataset: PreparedDataset) -> list[str]:
    paths: list[str] = []
    for entry in dataset.manifest["shards"]:
        paths.extend(json.loads((dataset.path / entry["meta"]).read_text())["paths"])
    return paths


def _small_source(celeba: Path, names: list[str], root: Path, per_identity: int = 2) -> Path:
    """A copy of the first ``per_identity`` photos of each identity in ``names``."""
    for name in names:
        (root / name).mkdir(parents=True)
        for photo in _photos(celeba / name)[:per_identity]:
            shutil.copy(photo, root / name / photo.name)
    return root


# --------------------------------------------------------------------------------------------
# The output folder
# --------------------------------------------------------------------------------------------


def test_shards_are_memory_mappable_uint8_crops_with_int_labels(prepared):
    assert len(prepared.shards) == len(prepared.manifest["shards"]) >= 3
    total = 0
    for (images, labels), entry in zip(prepared.shards, prepared.manifest["shards"], strict=True):
        assert isinstance(images, np.memmap)
        assert images.dtype == np.uint8 and images.shape == (entry["count"], 112, 96, 3)
        assert labels.dtype == np.int64 and labels.shape == (entry["count"],)
        on_disk = np.load(prepared.path / entry["labels"], mmap_mode="r")
        assert on_disk.dtype == np.int32
        np.testing.assert_array_equal(on_disk, labels)
        assert entry["photos"] <= SHARD_SIZE
        total += entry["count"]
    assert len(prepared) == prepared.num_images == total
    images, labels = prepared.concatenate()
    assert images.shape == (total, 112, 96, 3) and images.dtype == np.uint8 and images.flags.c_contiguous
    assert labels.shape == (total,) and labels.dtype == np.int64
    # Crops are photos, not black frames.
    assert images.reshape(total, -1).mean(axis=1).min() > 30


def test_labels_are_contiguous_and_name_the_identity_folders(prepared, first_identities):
    assert prepared.identities == first_identities
    assert prepared.num_classes == LIMIT
    _, labels = prepared.concatenate()
    np.testing.assert_array_equal(np.unique(labels), np.arange(LIMIT))
    paths = _shard_paths(prepared)
    assert len(paths) == len(labels)
    assert [prepared.identities[label] for label in labels] == [p.split("/")[0] for p in paths]
    counts = np.bincount(labels, minlength=LIMIT)
    assert prepared.manifest["identity_counts"] == dict(zip(first_identities, counts.tolist(), strict=True))


def test_every_listed_photo_is_either_kept_or_skipped(prepared, celeba, first_identities):
    listed = [f"{n}/{p.name}" for n in first_identities for p in _photos(celeba / n)]
    manifest = prepared.manifest
    assert manifest["num_photos"] == len(listed)
    skipped = [entry["path"] for entry in manifest["skipped"]]
    assert sorted(_shard_paths(prepared) + skipped) == sorted(listed)
    assert manifest["num_images"] + manifest["num_skipped"] == len(listed)
    assert sum(manifest["skipped_by_reason"].values()) == manifest["num_skipped"]


def test_manifest_records_the_settings(prepared, celeba):
    manifest = prepared.manifest
    assert manifest["template"] == "sphereface_112x96"
    assert manifest["image_shape"] == [112, 96, 3]
    assert manifest["source"] == str(celeba.resolve())
    assert manifest["detector"]["face_policy"] == "central"
    assert manifest["detector"]["workers"] == 2
    assert manifest["detector"]["intra_op_threads"] == 1
    assert manifest["excluded_identities"] == [] and manifest["limit_identities"] == LIMIT
    assert manifest["created"].endswith("+00:00")
    assert manifest["elapsed_seconds"] > 0
    assert [s["images"] for s in manifest["shards"]][:2] == ["images_00000.npy", "images_00001.npy"]
    text = prepared.summary()
    assert f"{prepared.num_images:,} aligned 112x96 faces" in text and f"{LIMIT} classes" in text


def test_crops_are_aligned_re_aligning_them_changes_almost_nothing(prepared, detector):
    """Landmarks found again on a crop (padded into a black canvas) already sit where the
    template puts them: the similarity that would re-align the crop is nearly the identity."""
    images, _ = prepared.concatenate()
    template = SPHEREFACE_TEMPLATE_112x96.as_array()
    moves, scales, template_errors = [], [], []
    for crop in images:
        canvas = np.zeros((224, 192, 3), dtype=np.uint8)
        canvas[56:168, 48:144] = crop
        faces = select_faces(detector.detect(canvas), "central", canvas.shape)
        if not faces:
            moves.append(np.inf)
            continue
        points = faces[0].landmarks - [48, 56]
        matrix = similarity_transform(points, template)
        moved = points @ matrix[:, :2].T + matrix[:, 2]
        moves.append(np.linalg.norm(moved - points, axis=1).max())
        scales.append(np.hypot(matrix[0, 0], matrix[1, 0]))
        template_errors.append(np.linalg.norm(points - template, axis=1).mean())
    moves = np.asarray(moves)
    assert np.mean(moves < 4.0) >= 0.85, np.sort(moves)
    assert np.median(moves) < 2.0
    assert abs(np.median(scales) - 1.0) < 0.03
    # Real faces are not template-shaped, so the points themselves are a few pixels off it.
    assert np.median(template_errors) < 5.0


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------


def test_a_complete_folder_is_returned_without_detecting_again(prepared, celeba):
    started = time.perf_counter()
    again = prepare_dataset(
        celeba, prepared.path, limit_identities=LIMIT, workers=2, shard_size=SHARD_SIZE, progress=False
    )
    assert time.perf_counter() - started < 5.0
    assert again.last_run["photos_processed"] == 0
    assert again.last_run["shards_reused"] == len(prepared.shards)
    assert again.manifest == prepared.manifest


def test_a_deleted_shard_is_redone_and_the_arrays_are_identical(prepared, celeba, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(prepared.path, out)
    for name in ("images_00001.npy", "labels_00001.npy", "meta_00001.json"):
        (out / name).unlink()
    # A killed run: shard 2's arrays were replaced but its meta never written.
    (out / "meta_00002.json").unlink()
    np.save(out / "images_00002.npy", np.zeros((1, 112, 96, 3), dtype=np.uint8))
    again = prepare_dataset(
        celeba, out, limit_identities=LIMIT, workers=1, shard_size=SHARD_SIZE, progress=False
    )
    assert again.last_run["shards_written"] == 2
    assert again.last_run["photos_processed"] == 2 * SHARD_SIZE
    old_images, old_labels = prepared.concatenate()
    new_images, new_labels = again.concatenate()
    np.testing.assert_array_equal(new_images, old_images)
    np.testing.assert_array_equal(new_labels, old_labels)
    assert again.identities == prepared.identities
    assert not list(out.glob(".*tmp*"))


def test_a_folder_made_from_another_photo_list_is_refused(prepared, celeba):
    with pytest.raises(DatasetMismatchError) as info:
        prepare_dataset(celeba, prepared.path, limit_identities=LIMIT - 1, workers=1, progress=False)
    assert info.value.code == "dataset_mismatch"
    with pytest.raises(DatasetMismatchError):
        prepare_dataset(
            celeba,
            prepared.path,
            limit_identities=LIMIT,
            shard_size=SHARD_SIZE * 2,
            workers=1,
            progress=False,
        )
    # The refusal left the folder as it was.
    assert load_prepared(prepared.path).manifest == prepared.manifest


def test_shards_without_a_manifest_from_another_job_are_refused(prepared, celeba, tmp_path):
    out = tmp_path / "half"
    out.mkdir()
    shutil.copy(prepared.path / "meta_00000.json", out / "meta_00000.json")
    with pytest.raises(DatasetMismatchError):
        prepare_dataset(celeba, out, limit_identities=LIMIT, shard_size=SHARD_SIZE + 1, progress=False)


# --------------------------------------------------------------------------------------------
# Exclusions, skipped photos, errors
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_source(celeba, first_identities, tmp_path_factory) -> Path:
    return _small_source(celeba, first_identities, tmp_path_factory.mktemp("small") / "src")


def test_excluded_identities_by_list_are_dropped(small_source, first_identities, tmp_path):
    result = prepare_dataset(
        small_source,
        tmp_path / "out",
        exclude_identities=[first_identities[0], "nobody"],
        workers=1,
        progress=False,
    )
    assert result.identities == first_identities[1:]
    assert result.manifest["excluded_identities"] == [first_identities[0]]
    assert result.manifest["exclusions_not_found"] == ["nobody"]
    assert result.manifest["num_photos"] == 2 * (LIMIT - 1)
    assert not any(p.startswith(first_identities[0] + "/") for p in _shard_paths(result))


def test_excluded_identities_by_file_are_dropped(small_source, first_identities, tmp_path):
    listing = tmp_path / "exclude.txt"
    listing.write_text(f"# people also in LFW\n\n{first_identities[1]}   # a comment\n  \n")
    result = prepare_dataset(
        small_source, tmp_path / "out", exclude_identities=listing, workers=1, progress=False
    )
    assert result.identities == [first_identities[0], first_identities[2]]
    assert result.manifest["excluded_identities"] == [first_identities[1]]
    _, labels = result.concatenate()
    np.testing.assert_array_equal(np.unique(labels), [0, 1])


def test_unreadable_and_faceless_photos_are_skipped_and_labels_stay_contiguous(
    celeba, first_identities, tmp_path
):
    src = _small_source(celeba, first_identities[:2], tmp_path / "src")
    keep = first_identities[0]
    (src / keep / "zz_garbage.jpg").write_bytes(b"this is not a JPEG at all" * 10)
    Image.new("RGB", (250, 250), (128, 128, 128)).save(src / keep / "zz_gray.png")
    (src / keep / "notes.txt").write_text("not a photo")
    (src / "0_all_broken").mkdir()  # sorts first; loses every photo, so labels must be re-mapped
    for name in ("a.JPG", "b.jpeg", "c.png"):  # fills shard 0 exactly
        (src / "0_all_broken" / name).write_bytes(b"" if name == "a.JPG" else b"\x89PNG broken")
    (src / ".hidden").mkdir()

    result = prepare_dataset(src, tmp_path / "out", workers=1, shard_size=3, progress=False)
    manifest = result.manifest
    assert manifest["num_photos"] == 3 + 4 + 2
    assert result.identities == first_identities[:2]
    assert manifest["dropped_identities"] == ["0_all_broken"]
    assert manifest["skipped_by_reason"] == {"no_face": 1, "unreadable_image": 4}
    reasons = {entry["path"]: entry["reason"] for entry in manifest["skipped"]}
    assert reasons == {
        "0_all_broken/a.JPG": "unreadable_image",
        "0_all_broken/b.jpeg": "unreadable_image",
        "0_all_broken/c.png": "unreadable_image",
        f"{keep}/zz_garbage.jpg": "unreadable_image",
        f"{keep}/zz_gray.png": "no_face",
    }
    assert all(entry["message"] for entry in manifest["skipped"])
    _, labels = result.concatenate()
    np.testing.assert_array_equal(labels, [0, 0, 1, 1])
    assert [p.split("/")[0] for p in _shard_paths(result)] == [
        keep,
        keep,
        first_identities[1],
        first_identities[1],
    ]
    # The shard that lost all its photos is still a valid (empty) shard.
    assert [entry["count"] for entry in manifest["shards"]] == [0, 2, 2]
    assert result.shards[0][0].shape == (0, 112, 96, 3)


def test_a_missing_or_empty_source_gives_a_typed_error(tmp_path):
    with pytest.raises(DatasetError) as info:
        prepare_dataset(tmp_path / "no_such_folder", tmp_path / "out", progress=False)
    assert isinstance(info.value, SphereFaceError) and info.value.code == "dataset_error"
    assert "no_such_folder" in info.value.message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no identity sub-folders"):
        prepare_dataset(empty, tmp_path / "out", progress=False)
    (empty / "someone").mkdir()
    (empty / "someone" / "readme.txt").write_text("no photos here")
    with pytest.raises(DatasetError, match="no photos"):
        prepare_dataset(empty, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_lower_minimum_face_size_reaches_the_workers_and_keeps_small_faces(tmp_path):
    # A real face shrunk to 20x20 pixels on a 120x120 canvas: MTCNN finds it looking for faces of
    # 12 px, not of 20 (its default).
    lfw = require_shared("lfw")
    face = Image.open(lfw / "images" / "Aaron_Peirsol" / "Aaron_Peirsol_0001.jpg").resize((20, 20), Image.BOX)
    canvas = Image.new("RGB", (120, 120), (128, 128, 128))
    canvas.paste(face, (40, 40))
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        canvas.save(tmp_path / "src" / name / "small.png")
    default = prepare_dataset(tmp_path / "src", tmp_path / "at20", workers=2, progress=False)
    assert default.num_images == 0 and default.manifest["skipped_by_reason"] == {"no_face": 2}
    assert default.manifest["detector"]["min_face_size"] == 20.0
    small = prepare_dataset(tmp_path / "src", tmp_path / "at12", workers=2, progress=False, min_face_size=12)
    assert small.num_images == 2 and small.manifest["detector"]["min_face_size"] == 12.0
    # The same folder again with another minimum is another preparation, and one under 12 is refused.
    with pytest.raises(DatasetMismatchError, match="other settings"):
        prepare_dataset(tmp_path / "src", tmp_path / "at12", workers=1, progress=False)
    with pytest.raises(ValueError, match="at least 12"):
        prepare_dataset(tmp_path / "src", tmp_path / "at8", progress=False, min_face_size=8)


def test_loading_a_folder_without_a_manifest_says_to_prepare_first(tmp_path):
    with pytest.raises(DatasetError, match="sphereface prepare"):
        load_prepared(tmp_path)


# --------------------------------------------------------------------------------------------
# Training sets from several prepared folders
# --------------------------------------------------------------------------------------------

# Photos (by index into each identity's sorted photos) of the first four identities in two
# sources. Identity 1 is in both, with different photos: 2 + 1 = 3 faces, so only merging keeps
# it at min_photos=3. Faces per identity over both sources: 1, 3, 3, 4.
SOURCE_A = {0: [0], 1: [0, 1], 2: [0, 1, 2]}
SOURCE_B = {1: [2], 3: [0, 1, 2, 3]}
MERGED_COUNTS = [1, 3, 3, 4]


def _copy_photos(celeba: Path, names: list[str], picks: dict[int, list[int]], root: Path) -> Path:
    for index, chosen in picks.items():
        (root / names[index]).mkdir(parents=True)
        photos = _photos(celeba / names[index])
        for i in chosen:
            shutil.copy(photos[i], root / names[index] / photos[i].name)
    return root


@pytest.fixture(scope="module")
def four_identities(celeba: Path) -> list[str]:
    return sorted(p.name for p in celeba.iterdir() if p.is_dir())[:4]


@pytest.fixture(scope="module")
def two_sources(celeba, four_identities, tmp_path_factory) -> tuple[PreparedDataset, PreparedDataset]:
    root = tmp_path_factory.mktemp("two_sources")
    prepared_sources = []
    for key, picks in (("a", SOURCE_A), ("b", SOURCE_B)):
        src = _copy_photos(celeba, four_identities, picks, root / f"src_{key}")
        # Two photos per shard: several shards, some mixing identities.
        dataset = prepare_dataset(src, root / f"out_{key}", workers=1, shard_size=2, progress=False)
        # Every copied photo must have kept its face, or the counts below would not hold.
        assert dataset.manifest["num_skipped"] == 0, dataset.manifest["skipped"]
        prepared_sources.append(dataset)
    return prepared_sources[0], prepared_sources[1]


def _rows(dataset: PreparedDataset) -> tuple[list[str], np.ndarray]:
    """Identity name and crop of every row, in shard order."""
    images, labels = dataset.concatenate()
    return [dataset.identities[label] for label in labels], images


def _expected_rows(sources, keep: set[str]) -> tuple[list[str], np.ndarray]:
    names, crops = [], []
    for source in sources:
        source_names, source_images = _rows(source)
        for name, crop in zip(source_names, source_images, strict=True):
            if name in keep:
                names.append(name)
                crops.append(crop)
    return names, np.stack(crops)


def test_two_folders_merge_a_shared_identity_into_one_class(two_sources, four_identities):
    a, b = two_sources
    result = load_training_set([a.path, str(b.path)])
    assert result.identities == four_identities
    assert result.num_classes == 4 and result.num_images == a.num_images + b.num_images == 11
    assert result.manifest["identity_counts"] == dict(zip(four_identities, MERGED_COUNTS, strict=True))
    assert result.manifest["merged_identities"] == [four_identities[1]]
    # The shared identity has one label, used by rows of both sources.
    _, labels = result.concatenate()
    names, images = _rows(result)
    assert names.count(four_identities[1]) == 3
    assert {int(label) for label, name in zip(labels, names, strict=True) if name == four_identities[1]} == {
        1
    }
    expected_names, expected_images = _expected_rows(two_sources, set(four_identities))
    assert names == expected_names
    np.testing.assert_array_equal(images, expected_images)
    # Nothing was dropped, so every shard is still the source's memory map.
    assert len(result.shards) == len(a.shards) + len(b.shards)
    assert all(isinstance(shard_images, np.memmap) for shard_images, _ in result.shards)
    manifest = result.manifest
    assert [(s["num_images"], s["num_classes"]) for s in manifest["sources"]] == [(6, 3), (5, 2)]
    assert manifest["sources"][1]["path"] == str(b.path.resolve())
    assert manifest["min_photos"] == 1 and manifest["dropped_identities_min_photos"] == 0
    assert result.path == a.path
    # Sources in the other order: the same classes (sorted names), rows in source order.
    reverse = load_training_set([b.path, a.path])
    assert reverse.identities == four_identities and reverse.path == b.path
    reverse_names, reverse_images = _rows(reverse)
    expected_names, expected_images = _expected_rows([b, a], set(four_identities))
    assert reverse_names == expected_names
    np.testing.assert_array_equal(reverse_images, expected_images)


@pytest.mark.parametrize("min_photos", [2, 3, 4])
def test_min_photos_drops_exactly_the_identities_below_it(two_sources, four_identities, min_photos):
    a, b = two_sources
    result = load_training_set([a.path, b.path], min_photos=min_photos)
    keep = [name for name, n in zip(four_identities, MERGED_COUNTS, strict=True) if n >= min_photos]
    assert result.identities == keep
    assert (four_identities[1] in keep) == (min_photos <= 3)  # kept only by merging at 3
    assert result.num_classes == len(keep)
    assert result.manifest["dropped_identities_min_photos"] == 4 - len(keep)
    names, images = _rows(result)
    expected_names, expected_images = _expected_rows(two_sources, set(keep))
    assert names == expected_names
    np.testing.assert_array_equal(images, expected_images)
    _, labels = result.concatenate()
    np.testing.assert_array_equal(np.unique(labels), np.arange(len(keep)))
    counts = np.bincount(labels, minlength=len(keep)).tolist()
    assert result.manifest["identity_counts"] == dict(zip(keep, counts, strict=True))
    assert result.num_images == len(labels) == sum(counts)
    # A shard stays a memory map exactly when it lost no rows; emptied shards are gone.
    for (shard_images, _), entry in zip(result.shards, result.manifest["shards"], strict=True):
        source = (a, b)[entry["source"]]
        source_labels = source.shards[entry["shard"]][1]
        kept_rows = sum(source.identities[label] in keep for label in source_labels)
        assert entry["count"] == len(shard_images) == kept_rows > 0
        assert entry["in_memory"] == (kept_rows < len(source_labels))
        assert isinstance(shard_images, np.memmap) != entry["in_memory"]
    if min_photos == 4:  # only identity 3 is left: all of source A's shards are omitted
        assert {entry["source"] for entry in result.manifest["shards"]} == {1}
        assert result.manifest["sources"][0]["num_images_kept"] == 0
    text = result.summary()
    assert f"{result.num_images:,} aligned 112x96 faces of {len(keep)} classes" in text
    assert f"at least {min_photos} face(s)" in text


def test_one_folder_with_min_photos_1_is_load_prepared(prepared):
    plain = load_prepared(prepared.path)
    for given in (prepared.path, str(prepared.path), [prepared.path]):
        result = load_training_set(given)
        assert type(result) is PreparedDataset
        assert result.manifest == plain.manifest and result.identities == plain.identities
        assert len(result.shards) == len(plain.shards)
        for (images, labels), (plain_images, plain_labels) in zip(result.shards, plain.shards, strict=True):
            assert isinstance(images, np.memmap) and images.filename == plain_images.filename
            assert labels.dtype == np.int64
            np.testing.assert_array_equal(labels, plain_labels)


def test_one_folder_with_min_photos_drops_and_renumbers(two_sources, four_identities):
    a, _ = two_sources
    result = load_training_set(a.path, min_photos=2)
    assert result.identities == four_identities[1:3]
    _, labels = result.concatenate()
    np.testing.assert_array_equal(labels, [0, 0, 1, 1, 1])
    assert result.manifest["merged_identities"] == []
    # Shard 0 held identities 0 and 1: read into memory with identity 1's row only.
    assert [entry["in_memory"] for entry in result.manifest["shards"]] == [True, False, False]
    names, images = _rows(result)
    expected_names, expected_images = _expected_rows([a], set(four_identities[1:3]))
    assert names == expected_names
    np.testing.assert_array_equal(images, expected_images)


def test_training_set_errors_are_clear(two_sources, tmp_path):
    a, b = two_sources
    with pytest.raises(DatasetError, match="no prepared folders given"):
        load_training_set([])
    with pytest.raises(DatasetError, match="sphereface prepare") as info:
        load_training_set([a.path, tmp_path])
    assert str(tmp_path) in info.value.message
    for bad in (0, -1, 2.5, True):
        with pytest.raises(DatasetError, match="min_photos"):
            load_training_set(a.path, min_photos=bad)
    with pytest.raises(DatasetError, match="given twice"):
        load_training_set([a.path, b.path, Path(str(a.path) + "/.")])
    with pytest.raises(DatasetError) as info:
        load_training_set([a.path, b.path], min_photos=5)
    message = info.value.message
    assert "no identity has 5 or more faces" in message
    assert "its 4 identities have at most 4 faces each (1 with 4, 2 with 3, 1 with 1)" in message


# --------------------------------------------------------------------------------------------
# A worker process that dies
# --------------------------------------------------------------------------------------------


def _square_or_die(task: int) -> int:
    """A pool task: ``task ** 2``, except that the worker running task 7 kills itself."""
    if task == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return task * task


def test_the_pool_names_the_task_whose_worker_died_and_the_next_pool_works():
    results = []
    started = time.monotonic()
    with pytest.raises(WorkerDied) as died:
        for value in ordered_results(_square_or_die, list(range(40)), workers=2):
            results.append(value)
    assert time.monotonic() - started < 60  # no waiting for a result that never comes
    assert died.value.tasks == [7]  # the other worker, stopped by the pool, is not blamed
    assert len(results) <= 7 and results == [i * i for i in range(len(results))]
    assert list(ordered_results(_square_or_die, [1, 2, 3, 4], workers=2, chunksize=2)) == [1, 4, 9, 16]


def _prepare_in_a_thread(celeba: Path, out: Path) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = prepare_dataset(
                celeba, out, limit_identities=LIMIT, workers=2, shard_size=SHARD_SIZE, progress=False
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_prepare_fails_clearly_when_a_worker_is_killed_and_a_rerun_completes(prepared, celeba, tmp_path):
    out = tmp_path / "killed"
    before = {p.pid for p in multiprocessing.active_children()}
    thread, outcome = _prepare_in_a_thread(celeba, out)
    deadline = time.monotonic() + 120
    while not (out / "meta_00000.json").exists():  # the first shard is written
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.01)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "prepare hangs after a worker died"
    error = outcome.get("error")
    assert isinstance(error, WorkerDied) and error.code == "worker_died", outcome
    found = re.search(r"while on photo (\d+) \((.+?)\) of shard (\d+) \(killed", str(error))
    assert found, str(error)
    photo, shard = int(found.group(1)), int(found.group(3))
    assert shard >= 1 and shard * SHARD_SIZE <= photo < (shard + 1) * SHARD_SIZE
    assert found.group(2).split("/")[0] in prepared.manifest["identity_counts"]
    assert "shards are written and kept: run the same command again" in str(error)
    kept = (out / "meta_00000.json").read_bytes()

    again = prepare_dataset(
        celeba, out, limit_identities=LIMIT, workers=2, shard_size=SHARD_SIZE, progress=False
    )
    assert again.last_run["shards_reused"] >= 1 and (out / "meta_00000.json").read_bytes() == kept
    for new, old in zip(again.concatenate(), prepared.concatenate(), strict=True):
        np.testing.assert_array_equal(new, old)
