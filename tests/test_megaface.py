"""MegaFace protocol: metrics on hand-made scores, the chunked search against brute force, the
resumable cache, and the job end to end on a tiny real set whose answers are known by construction."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from training.evaluation.cache import RowCache
from training.evaluation.errors import MegaFaceDataError
from training.evaluation.faces import FaceSet, cap_per_identity, load_face_set, removed_mask
from training.evaluation.megaface import local_protocol, run_megaface
from training.evaluation.megaface_metrics import (
    genuine_scores,
    identity_groups,
    search_ranks,
    summarise,
    threshold_at_far,
    verification_at,
)
from training.evaluation.megaface_search import distractor_sizes, merge_top_k, search_distractors
from training.evaluation.verification import tar_at_far


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _random_unit(rng: np.random.Generator, n: int, d: int = 16) -> np.ndarray:
    return _unit(rng.normal(size=(n, d)))


# -- metrics on hand-made scores -------------------------------------------------------------


def test_tar_at_far_on_a_hand_made_score_list():
    # 10 impostor scores 0.90, 0.80, ..., 0.00 and 4 genuine scores.
    impostor = np.round(np.arange(9, -1, -1) / 10, 2)
    genuine = np.array([0.95, 0.85, 0.75, 0.10])
    # FAR 0.1: at most 1 of 10 impostors accepted -> threshold = 2nd highest = 0.80; genuine
    # accepted strictly above it: 0.95, 0.85 -> TAR 0.5.
    out = verification_at(genuine, impostor, len(impostor), fars=(0.1, 0.3, 0.05))
    assert out["threshold_at_far"]["1e-01"] == pytest.approx(0.8)
    assert out["tar_at_far"]["1e-01"] == pytest.approx(0.5)
    # FAR 0.3: 3 impostors may pass -> threshold 0.60 -> 3 of 4 genuine.
    assert out["threshold_at_far"]["3e-01"] == pytest.approx(0.6)
    assert out["tar_at_far"]["3e-01"] == pytest.approx(0.75)
    # FAR 0.05 * 10 impostors < 1: not measurable.
    assert out["tar_at_far"]["5e-02"] is None
    assert (out["n_genuine"], out["n_impostor"]) == (4, 10)


def test_tar_at_far_matches_the_lfw_rule_from_the_kept_top_scores_only():
    rng = np.random.default_rng(3)
    impostor = rng.normal(0.0, 0.2, 50_000)
    genuine = rng.normal(0.6, 0.2, 2_000)
    scores = np.r_[genuine, impostor]
    is_same = np.r_[np.ones(len(genuine), bool), np.zeros(len(impostor), bool)]
    kept = np.sort(impostor)[::-1][: math.floor(1e-3 * len(impostor)) + 1]  # what the search keeps
    for far in (1e-3, 1e-4):
        expected_tar, expected_threshold = tar_at_far(scores, is_same, far)
        assert threshold_at_far(kept, len(impostor), far) == pytest.approx(expected_threshold)
        out = verification_at(genuine, kept, len(impostor), fars=(far,))
        assert out["tar_at_far"][f"{far:.0e}"] == pytest.approx(expected_tar)
    assert threshold_at_far(kept, len(impostor), 1e-5) is None  # 0.5 impostor pairs


def test_search_ranks_counts_the_distractors_that_beat_the_genuine_match():
    # Identity A has images 0 and 1 with cosine 0.8; identity B images 2, 3 with cosine 0.5.
    angles = np.deg2rad([0.0, math.degrees(math.acos(0.8)), 90.0, 90.0 + math.degrees(math.acos(0.5))])
    features = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    groups = identity_groups(["A", "A", "B", "B"])
    top = np.array(
        [
            [0.9, 0.7, 0.1],  # probe 0: one distractor above 0.8 -> rank 2
            [0.8, 0.2, 0.1],  # probe 1: a tie at 0.8 does not beat the genuine match -> rank 1
            [0.6, 0.55, 0.52],  # probe 2: three above 0.5 -> rank > 3 (saturates at k = 3)
            [0.4, 0.3, 0.2],  # probe 3: none above -> rank 1
        ],
        dtype=np.float32,
    )
    assert search_ranks(features, groups, top).tolist() == [1, 0, 3, 0]
    assert genuine_scores(features, groups) == pytest.approx([0.8, 0.5], abs=1e-6)


def test_distractor_sizes_follow_the_challenge_and_add_the_whole_set():
    assert distractor_sizes(10_318) == [10, 100, 1_000, 10_000, 10_318]
    assert distractor_sizes(1_000_000) == [10, 100, 1_000, 10_000, 100_000, 1_000_000]
    assert distractor_sizes(5) == [5]
    assert distractor_sizes(50, [0, 10, 10]) == [0, 10]
    with pytest.raises(MegaFaceDataError, match="only 50"):
        distractor_sizes(50, [100])


# -- the chunked search against brute force --------------------------------------------------


def test_merge_top_k_keeps_each_rows_best_scores_in_order():
    rng = np.random.default_rng(0)
    top = np.full((30, 5), -np.inf, dtype=np.float32)
    seen = []
    for width in (3, 40, 200, 7):  # the partition path (many candidates) and the sparse path
        block = rng.normal(size=(30, width)).astype(np.float32)
        seen.append(block)
        top = merge_top_k(top, block)
        everything = np.concatenate(seen, axis=1)
        expected = -np.sort(-everything, axis=1)[:, :5]
        if expected.shape[1] < 5:
            expected = np.pad(expected, ((0, 0), (0, 5 - expected.shape[1])), constant_values=-np.inf)
        np.testing.assert_array_equal(top, expected)


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
def test_chunked_search_equals_brute_force_raw_and_cleaned(device):
    if device == "torch-cpu":
        pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    probes, pool = _random_unit(rng, 40), _random_unit(rng, 2_500)
    order = rng.permutation(len(pool))
    removed_p = np.zeros(40, bool)
    removed_p[[3, 17]] = True
    removed_d = np.zeros(len(pool), bool)
    removed_d[rng.choice(len(pool), 100, replace=False)] = True
    sizes = [0, 10, 1_000, 2_500]
    result = search_distractors(
        probes, pool, order, sizes, removed_probes=removed_p, removed_distractors=removed_d,
        top_k=8, chunk_mb=0.05, device=device, progress=False,
    )  # fmt: skip
    assert result.rows["cleaned"].tolist() == np.flatnonzero(~removed_p).tolist()
    for size in sizes:
        chosen = order[:size]
        for variant, rows, mask in (
            ("raw", np.arange(40), np.zeros(size, bool)),
            ("cleaned", np.flatnonzero(~removed_p), removed_d[chosen]),
        ):
            scores = probes[rows] @ pool[chosen].T
            scores[:, mask] = -np.inf
            expected = np.full((len(rows), 8), -np.inf, dtype=np.float32)
            best = -np.sort(-scores, axis=1)[:, :8]
            expected[:, : best.shape[1]] = best
            top, impostor = result.variants[variant][size]
            np.testing.assert_allclose(top, expected, atol=1e-6)
            kept = math.floor(1e-3 * len(rows) * max(sizes)) + 1
            flat = np.sort(scores.ravel())[::-1][:kept]
            np.testing.assert_allclose(impostor[: len(flat)], flat, atol=1e-6)


def test_summary_of_a_search_with_zero_distractors_finds_every_probe():
    rng = np.random.default_rng(2)
    features = _random_unit(rng, 12)
    identities = ["a"] * 4 + ["b"] * 3 + ["c"] * 5
    result = search_distractors(features, np.zeros((0, 16), np.float32), np.arange(0), [0], progress=False)
    out = summarise(features, identities, result)["raw"]
    assert out["identification"]["0"] == {"rank1": 1.0, "rank10": 1.0, "searches": 4 * 3 + 3 * 2 + 5 * 4}
    assert out["verification"]["0"]["tar_at_far"]["1e-03"] is None  # no impostor pairs


# -- sets, lists and the cache -----------------------------------------------------------------


def test_removal_lists_match_keys_path_endings_and_file_names():
    keys = ["Aaron/Aaron_1.png", "Aaron/Aaron_2.png", "Bo/x/Bo_3.jpg", "Bo/Bo_3.jpg"]
    mask = removed_mask(keys, {"Aaron_2.png", "x/Bo_3.jpg"})
    assert mask.tolist() == [False, True, True, False]
    assert not removed_mask(keys, set()).any()


def test_face_sets_from_folders_and_lists(tmp_path):
    for name in ("ann/1.jpg", "ann/2.jpg", "ann/3.jpg", "bob/1.png", "cy/only.jpg"):
        (tmp_path / "p" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "p" / name).write_bytes(b"x")
    probes = load_face_set(tmp_path / "p", "probes", probes=True)
    assert probes.identities == ["ann", "ann", "ann", "bob", "cy"]
    capped = cap_per_identity(probes, 2)
    assert capped.keys == ["ann/1.jpg", "ann/2.jpg"]  # bob and cy have one image: no searches
    (tmp_path / "p" / "list.txt").write_text("# a list\nann/1.jpg\n\nbob/1.png\n")
    listed = load_face_set(tmp_path / "p" / "list.txt", "probes", probes=True)
    assert listed.keys == ["ann/1.jpg", "bob/1.png"]
    (tmp_path / "p" / "bad.txt").write_text("ann/9.jpg\n")
    with pytest.raises(MegaFaceDataError, match="do not exist"):
        load_face_set(tmp_path / "p" / "bad.txt", "probes", probes=True)
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with pytest.raises(MegaFaceDataError, match="one folder per identity"):
        load_face_set(tmp_path / "flat", "probes", probes=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegaFaceDataError, match="no images"):
        load_face_set(tmp_path / "empty", "distractors", probes=False)


def test_row_cache_resumes_after_a_crash_and_grows(tmp_path):
    columns = {"x": ((3,), np.float32)}
    calls: list[int] = []
    crash = {"at": 50}

    def produce(i: int) -> float:
        calls.append(i)
        if i == crash["at"]:
            raise KeyboardInterrupt  # stopped half way
        return float(i)

    def store_into(cache):
        def store(first: int, items: list[float]) -> None:
            cache["x"][first : first + len(items)] = np.array(items)[:, None]

        return store

    with RowCache(tmp_path / "c", {"what": "test"}, 80, columns) as cache, pytest.raises(KeyboardInterrupt):
        cache.fill(
            produce, store_into(cache), batch_size=8, workers=1, desc="t", progress=False, commit_seconds=0
        )
    assert cache.done == 48  # six whole batches were committed
    calls.clear()
    crash["at"] = None
    with RowCache(tmp_path / "c", {"what": "test"}, 80, columns) as again:
        assert again.done == 48
        again.fill(produce, store_into(again), batch_size=8, workers=1, desc="t", progress=False)
    assert calls == list(range(48, 80))  # nothing done twice
    np.testing.assert_array_equal(again["x"][:, 0], np.arange(80))
    with RowCache(tmp_path / "c", {"what": "test"}, 100, columns) as grown:
        assert grown.done == 80
        np.testing.assert_array_equal(grown["x"][:80, 0], np.arange(80))
    with RowCache(tmp_path / "c", {"what": "something else"}, 100, columns) as other:
        assert other.done == 0


def _fill_slowly(folder: str, started, log_path: str) -> None:
    """Fill a 24-row cache, 20 ms a row, noting each row it computes (a child process)."""
    import time

    def produce(i: int) -> float:
        started.set()
        with open(log_path, "a") as log:
            log.write(f"{i}\n")
        time.sleep(0.02)
        return float(i)

    with RowCache(Path(folder), {"what": "test"}, 24, {"x": ((), np.float32)}) as cache:

        def store(first: int, items: list[float]) -> None:
            cache["x"][first : first + len(items)] = items

        cache.fill(produce, store, batch_size=4, workers=1, desc="t", progress=False)


def test_two_processes_filling_one_row_cache_take_turns(tmp_path):
    # Two `sphereface evaluate megaface` side by side used to race on the same cache files (one
    # failed on progress.json.tmp). The second now waits for the first and finds its rows.
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    started = context.Event()
    log_path = tmp_path / "rows.txt"
    first = context.Process(target=_fill_slowly, args=(str(tmp_path / "c"), started, str(log_path)))
    first.start()
    assert started.wait(60)  # the first process is filling
    second = context.Process(target=_fill_slowly, args=(str(tmp_path / "c"), started, str(log_path)))
    second.start()
    for process in (first, second):
        process.join(60)
        assert process.exitcode == 0
    assert sorted(int(line) for line in log_path.read_text().split()) == list(range(24))  # each row once
    with RowCache(tmp_path / "c", {"what": "test"}, 24, {"x": ((), np.float32)}) as cache:
        assert cache.done == 24
        np.testing.assert_array_equal(cache["x"], np.arange(24))


# -- real faces ------------------------------------------------------------------------------


def _link_tree(root: Path, files: dict[str, Path]) -> Path:
    for key, source in files.items():
        target = root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve())
    return root


@pytest.fixture(scope="module")
def tiny_sets(tmp_path_factory, shared_data):
    """Four LFW people with 2-3 photos as probes; 40 LFW single-photo people and CelebA photos as
    distractors (symlinks to ../shared/data)."""
    lfw = shared_data / "lfw" / "images"
    root = tmp_path_factory.mktemp("tiny_megaface")
    probes = {}
    for person, count in (
        ("Serena_Williams", 3),
        ("Tony_Blair", 3),
        ("Vladimir_Putin", 2),
        ("Laura_Bush", 2),
    ):
        for i in range(1, count + 1):
            probes[f"{person}/{person}_{i:04d}.jpg"] = lfw / person / f"{person}_{i:04d}.jpg"
    singles = sorted(p for p in lfw.iterdir() if len(list(p.iterdir())) == 1)[:40]
    distractors = {f"lfw/{p.name}/{next(p.iterdir()).name}": next(p.iterdir()) for p in singles}
    celeba = sorted((shared_data / "celeba_faces").iterdir())[:10]
    for folder in celeba:
        photo = sorted(folder.iterdir())[0]
        distractors[f"celeba/{folder.name}/{photo.name}"] = photo
    return _link_tree(root / "probes", probes), _link_tree(root / "distractors", distractors)


@pytest.mark.shared_data
def test_tiny_real_set_answers_known_by_construction(tiny_sets, reference_model_dir, tmp_path):
    probes, distractors = tiny_sets
    report = run_megaface(
        reference_model_dir, probes=probes, distractors=distractors, sizes=[0, 10, 50],
        json_out=tmp_path / "out.json", plots_dir=tmp_path / "plots", cache_dir=tmp_path / "cache",
        progress=False,
    )  # fmt: skip
    raw = report["results"]["raw"]
    assert report["probes"]["images"] == 10 and report["probes"]["identities"] == 4
    assert report["distractors"]["total"] == 50 and report["sizes"] == [0, 10, 50]
    searches = 3 * 2 + 3 * 2 + 2 * 1 + 2 * 1
    # No distractors: the genuine photo is the whole gallery, so every search finds it first.
    assert raw["identification"]["0"] == {"rank1": 1.0, "rank10": 1.0, "searches": searches}
    # These are clean, frontal photos of well-known people; the reference model (99.3% on LFW) puts
    # every one of their other photos above 50 strangers.
    assert raw["identification"]["50"]["rank1"] == 1.0
    assert raw["verification"]["50"]["n_genuine"] == 3 + 3 + 1 + 1
    assert raw["verification"]["50"]["n_impostor"] == 10 * 50
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["results"]["raw"]["identification"]["50"]["rank1"] == 1.0
    from models.cli import main

    out_md = tmp_path / "t.md"
    assert main(["report", str(tmp_path / "out.json"), "--names", "tiny", "--out", str(out_md)]) == 0
    table = out_md.read_text()
    assert "| tiny | raw |" in table and "| 100.00 |" in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "cmc.png",
        "identification_vs_distractors.png",
        "roc.png",
    ]

    # The cache makes a second run skip every photo; the same numbers come out. A noise list
    # adds the cleaned variant: Serena_Williams_0001 removed leaves 2 of her photos (2 searches).
    (tmp_path / "noise.txt").write_text("Serena_Williams_0001.jpg\n")
    again = run_megaface(
        reference_model_dir, probes=probes, distractors=distractors, sizes=[0, 10, 50],
        remove_probes=tmp_path / "noise.txt", cache_dir=tmp_path / "cache", progress=False,
        detector=_NoDetector(),
    )  # fmt: skip
    assert again["results"]["raw"]["identification"] == raw["identification"]
    cleaned = again["results"]["cleaned"]
    assert cleaned["probe_images"] == 9
    assert cleaned["identification"]["0"]["searches"] == searches - 4


class _NoDetector:
    """A detector that must not be called (everything is cached)."""

    def detect(self, image):
        raise AssertionError("the landmark cache was not used")

    landmarks_in_box = detect


@pytest.mark.shared_data
def test_augmented_distractors_stay_near_their_source_face(tiny_sets, reference_model_dir, tmp_path):
    from models.embedder import Embedder
    from training.evaluation.cache import ModelKey, detect_landmarks, embed_faces
    from training.evaluation.megaface_augment import embed_augmented

    _, distractors = tiny_sets
    source = load_face_set(distractors, "distractors", probes=False).subset(np.arange(50) < 6)
    embedder = Embedder(reference_model_dir, "cpu")
    model = ModelKey.of(reference_model_dir)
    marks, _ = detect_landmarks(source, tmp_path, progress=False)
    real = np.asarray(embed_faces(source, marks, model, embedder, tmp_path, progress=False))
    augmented, keys = embed_augmented(source, marks, 12, model, embedder, tmp_path, progress=False)
    augmented = np.array(augmented)
    sources = [next(i for i, k in enumerate(source.keys) if key.endswith(k)) for key in keys]
    similarity = augmented @ real.T
    # Each augmented face is nearer its own source photo than any other photo.
    assert (similarity.argmax(axis=1) == np.array(sources)).all()
    assert (similarity[np.arange(12), sources] < 0.9999).all()  # and it is not a copy
    # Deterministic and resumable: asking for more keeps the first rows.
    more, _ = embed_augmented(source, marks, 18, model, embedder, tmp_path, progress=False)
    np.testing.assert_array_equal(np.asarray(more)[:12], augmented)


@pytest.mark.shared_data
def test_local_protocol_sets(shared_data):
    probes, distractors = local_protocol(shared_data)
    assert len(probes) == 7_381 and len(set(probes.identities)) == 1_680
    assert max(probes.identities.count(i) for i in ("George_W_Bush", "Colin_Powell")) == 20
    assert len(distractors) == 4_069 + 6_249
    probe_people = set(probes.identities)
    lfw_distractors = {k.split("/")[1] for k in distractors.keys if k.startswith("lfw/")}
    assert not probe_people & lfw_distractors


def test_cli_errors_are_clear(tmp_path, capsys):
    from models.cli import main

    code = main(["evaluate", "megaface", "--model", str(tmp_path), "--protocol", "local"])
    assert code == 2
    assert "--protocol local needs --data" in capsys.readouterr().err
    code = main(
        ["evaluate", "megaface", "--model", str(tmp_path), "--probes", str(tmp_path), "--sizes", "ten"]
    )
    assert code == 2
    assert "--sizes must be comma-separated" in capsys.readouterr().err


def test_face_set_subset_and_digest(tmp_path):
    files = []
    for i in range(3):
        f = tmp_path / f"{i}.jpg"
        f.write_bytes(b"x" * i)
        files.append(f)
    full = FaceSet("d", files, [f.name for f in files])
    part = full.subset(np.array([True, False, True]))
    assert part.keys == ["0.jpg", "2.jpg"]
    before = full.digest()
    files[1].write_bytes(b"changed")
    assert full.digest() != before


@pytest.mark.shared_data
def test_distractors_embedded_in_shards_give_the_same_search(tiny_sets, default_model_dir, tmp_path):
    """The distributed path (deploy/megaface): every pod embeds every N-th distractor into its own
    .npy; the search over all shards' files equals the search over the whole set."""
    from models.cli import main
    from training.evaluation.faces import load_face_set, shard_of
    from training.evaluation.megaface import embed_distractor_shard

    probes, distractors = tiny_sets
    files = []
    for shard in range(3):
        out = tmp_path / "features" / f"shard-{shard}.npy"
        summary = embed_distractor_shard(
            default_model_dir,
            distractors,
            shard,
            3,
            out,
            cache_dir=tmp_path / f"cache{shard}",
            progress=False,
        )
        assert summary["images"] == len(np.load(out)) and json.loads(out.with_suffix(".json").read_text())
        files.append(out)
    everything = load_face_set(distractors, "distractors", probes=False)
    assert sum(len(np.load(f)) for f in files) == len(everything) == 50
    assert [len(shard_of(everything, i, 3)) for i in range(3)] == [17, 17, 16]

    whole = run_megaface(
        default_model_dir, probes=probes, distractors=distractors, sizes=[50],
        cache_dir=tmp_path / "cache-whole", progress=False,
    )  # fmt: skip
    # the shards' rows are the whole set's rows, interleaved
    (whole_cache,) = (tmp_path / "cache-whole" / "features").glob("*/distractors-*")
    full = np.load(next(whole_cache.rglob("features*")), mmap_mode="r")
    np.testing.assert_allclose(np.load(files[1]), full[1::3], atol=1e-6)
    sharded = tmp_path / "sharded.json"
    args = ["evaluate", "megaface", "--model", str(default_model_dir), "--probes", str(probes)]
    args += ["--extra-features", *map(str, files), "--sizes", "50", "--json", str(sharded)]
    args += ["--cache", str(tmp_path / "cache-whole"), "--no-progress"]
    assert main(args) == 0
    report = json.loads(sharded.read_text())
    assert report["distractors"]["total"] == 50
    assert report["results"]["raw"]["identification"]["50"] == whole["results"]["raw"]["identification"]["50"]
    assert report["results"]["raw"]["verification"]["50"] == whole["results"]["raw"]["verification"]["50"]
    with pytest.raises(MegaFaceDataError, match="shard must be"):
        shard_of(everything, 3, 3)
