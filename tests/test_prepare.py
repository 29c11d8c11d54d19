"""Training-data preparation: detect + align a CASIA-style identity-folder dataset into shards."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.align import SPHEREFACE_TEMPLATE_112x96, similarity_transform
from models.errors import FacePathError
from models.mtcnn import MTCNNDetector, select_faces
from tests.conftest import require_shared
from training.prepare import (
    IMAGE_EXTENSIONS,
    DatasetError,
    DatasetMismatchError,
    PreparedDataset,
    load_prepared,
    prepare_dataset,
)

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
    assert isinstance(info.value, FacePathError) and info.value.code == "dataset_error"
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


def test_loading_a_folder_without_a_manifest_says_to_prepare_first(tmp_path):
    with pytest.raises(DatasetError, match="sphereface prepare"):
        load_prepared(tmp_path)
