"""LFW: pairs/landmarks parsing, the official SphereFace 10-fold protocol, ROC, and the job end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from training.evaluation.errors import LFWDataError
from training.evaluation.landmarks import central_box, landmark_error_stats
from training.evaluation.lfw import lfw_ensemble, plot_roc, run_lfw_evaluation
from training.evaluation.lfw_files import pair_features, read_landmarks, read_pairs
from training.evaluation.verification import (
    THRESHOLD_GRID,
    best_threshold,
    grid_accuracies,
    lfw_10fold_accuracy,
    roc_curve,
    tar_at_far,
    verification_accuracy,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _folds(n_folds: int, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """is_same and fold labels laid out like pairs.txt: per fold, same pairs then different pairs."""
    block = np.r_[np.ones(per_class, bool), np.zeros(per_class, bool)]
    return np.tile(block, n_folds), np.repeat(np.arange(n_folds), 2 * per_class)


def _pairs_with_scores(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2-d unit features whose pairs have exactly the cosine ``scores``; each pair comes with its
    antipodal copy, so the mean of any set of whole folds is 0 and mean subtraction is a no-op."""
    angles = np.arccos(np.asarray(scores, dtype=np.float64))
    left = np.tile([1.0, 0.0], (len(scores), 1))
    right = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    return np.concatenate([left, -left]), np.concatenate([right, -right])


def _naive_protocol(left, right, is_same, folds):
    """The protocol written the slow, literal way of evaluation.m (a G x N comparison matrix)."""
    accuracies, thresholds = [], []
    for k in np.unique(folds):
        train = folds != k
        mu = np.mean(np.concatenate([left[train], right[train]]), axis=0)
        scores = np.sum(_unit(left - mu) * _unit(right - mu), axis=1)
        s, y = scores[train], is_same[train]
        acc = (
            (s[None, y] > THRESHOLD_GRID[:, None]).sum(1) + (s[None, ~y] < THRESHOLD_GRID[:, None]).sum(1)
        ) / len(s)
        t = THRESHOLD_GRID[acc == acc.max()].mean()
        test = ~train
        accuracies.append(
            ((scores[test][is_same[test]] > t).sum() + (scores[test][~is_same[test]] < t).sum()) / test.sum()
        )
        thresholds.append(t)
    return np.array(accuracies), np.array(thresholds)


# --- the threshold rule ------------------------------------------------------------------------


def test_threshold_is_the_middle_of_the_max_accuracy_interval():
    # same {0.9, 0.5}, different {0.1, 0.3}: every t in (0.3, 0.5) is perfect -> mean of
    # 0.3001 .. 0.4999 = 0.4. t = 0.3 or 0.5 is not (ties are errors).
    threshold, accuracy = best_threshold(np.array([0.9, 0.5, 0.1, 0.3]), np.array([1, 1, 0, 0], bool))
    assert accuracy == 1.0
    assert threshold == pytest.approx(0.4, abs=1e-12)


def test_threshold_is_the_mean_of_all_argmax_thresholds_even_in_separate_intervals():
    # same {0.2, 0.6}, different {0.4}: accuracy 2/3 for t < 0.2 and for 0.4 < t < 0.6, 1/3 between.
    threshold, accuracy = best_threshold(np.array([0.2, 0.6, 0.4]), np.array([1, 1, 0], bool))
    low = np.arange(-10000, 2000) / 10000  # -1 .. 0.1999
    high = np.arange(4001, 6000) / 10000  # 0.4001 .. 0.5999
    assert accuracy == pytest.approx(2 / 3)
    assert threshold == pytest.approx(np.r_[low, high].mean(), abs=1e-12)
    assert threshold == pytest.approx((12000 * -0.40005 + 1999 * 0.5) / 13999, abs=1e-9)


def test_scores_equal_to_the_threshold_count_as_errors_for_both_classes():
    assert verification_accuracy(np.array([0.5, 0.5]), np.array([True, False]), 0.5) == 0.0
    assert verification_accuracy(np.array([0.6, 0.4]), np.array([True, False]), 0.5) == 1.0


def test_grid_accuracies_match_a_direct_count_at_every_threshold():
    rng = np.random.default_rng(1)
    scores = np.round(rng.uniform(-1, 1, 300), 3)  # rounded: many ties with grid values
    same = rng.random(300) < 0.5
    direct = (scores[None, same] > THRESHOLD_GRID[:, None]).sum(1) + (
        scores[None, ~same] < THRESHOLD_GRID[:, None]
    ).sum(1)
    np.testing.assert_array_equal(grid_accuracies(scores, same), direct)


# --- the 10-fold protocol -----------------------------------------------------------------------


def test_perfectly_separable_features_give_100_percent():
    rng = np.random.default_rng(0)
    is_same, folds = _folds(10, 30)
    left = rng.normal(size=(len(folds), 64))
    right = rng.normal(size=(len(folds), 64))
    right[is_same] = left[is_same]  # same pairs: cosine 1 whatever mean is subtracted
    result = lfw_10fold_accuracy(left, right, is_same, folds)
    assert result.accuracy == 1.0
    assert result.fold_accuracies == [1.0] * 10
    assert result.std == 0.0
    assert all(0.2 < t < 1.0 for t in result.fold_thresholds)
    assert result.threshold == pytest.approx(np.mean(result.fold_thresholds))


def test_protocol_threshold_equals_the_hand_computed_value():
    # Every fold: same pairs at cosine 0.9 and 0.5, different at 0.1 and 0.3 (plus antipodal
    # copies, so the fold means are 0): the threshold is 0.4 in every fold, accuracy 100%.
    left_fold, right_fold = _pairs_with_scores(np.array([0.9, 0.5, 0.1, 0.3]))
    same_fold = np.array([1, 1, 0, 0, 1, 1, 0, 0], bool)
    left, right = np.tile(left_fold, (10, 1)), np.tile(right_fold, (10, 1))
    is_same, folds = np.tile(same_fold, 10), np.repeat(np.arange(10), 8)
    result = lfw_10fold_accuracy(left, right, is_same, folds)
    assert result.accuracy == 1.0
    np.testing.assert_allclose(result.fold_thresholds, 0.4, atol=1e-9)
    assert result.threshold == pytest.approx(0.4, abs=1e-9)


def test_fold_mean_and_threshold_use_only_the_nine_training_folds():
    rng = np.random.default_rng(2)
    is_same, folds = _folds(10, 20)
    offset = rng.normal(size=32) * 3.0  # a large common component that mean subtraction removes
    left = offset + rng.normal(size=(len(folds), 32))
    right = offset + rng.normal(size=(len(folds), 32))
    right[is_same] = left[is_same] + 0.8 * rng.normal(size=(is_same.sum(), 32))
    before = lfw_10fold_accuracy(left, right, is_same, folds)

    changed_left, changed_right = left.copy(), right.copy()
    test = folds == 3
    changed_left[test] += 50.0 * rng.normal(size=(test.sum(), 32))
    changed_right[test] -= 20.0
    after = lfw_10fold_accuracy(changed_left, changed_right, is_same, folds)

    # Fold 3's threshold comes from folds != 3 only (their mean and scores): unchanged.
    assert after.fold_thresholds[3] == before.fold_thresholds[3]
    assert after.fold_train_accuracies[3] == before.fold_train_accuracies[3]
    # Every other fold has fold 3 in its training set: its mean, hence its threshold, moves.
    assert sum(after.fold_thresholds[k] != before.fold_thresholds[k] for k in range(10) if k != 3) >= 5


def test_training_fold_mean_removes_a_common_offset():
    rng = np.random.default_rng(3)
    is_same, folds = _folds(10, 30)
    offset = np.full(16, 20.0)  # raw cosines all close to 1 without mean subtraction
    left = rng.normal(size=(len(folds), 16))
    right = rng.normal(size=(len(folds), 16))
    right[is_same] = left[is_same] + 0.3 * rng.normal(size=(is_same.sum(), 16))
    raw = np.sum(_unit(left + offset) * _unit(right + offset), axis=1)
    assert raw.min() > 0.9
    result = lfw_10fold_accuracy(left + offset, right + offset, is_same, folds)
    assert result.accuracy > 0.97


def test_vectorised_protocol_matches_the_literal_implementation():
    rng = np.random.default_rng(4)
    is_same, folds = _folds(10, 12)
    left = rng.normal(size=(len(folds), 8)) + 1.0
    right = rng.normal(size=(len(folds), 8)) + 1.0
    right[is_same] = left[is_same] + 1.2 * rng.normal(size=(is_same.sum(), 8))
    result = lfw_10fold_accuracy(left, right, is_same, folds)
    accuracies, thresholds = _naive_protocol(left, right, is_same, folds)
    np.testing.assert_allclose(result.fold_accuracies, accuracies, atol=1e-12)
    np.testing.assert_allclose(result.fold_thresholds, thresholds, atol=1e-12)
    assert result.std == pytest.approx(np.std(accuracies, ddof=1))


def test_protocol_on_lfw_sized_input_equals_the_literal_implementation():
    """6,000 pairs in 10 folds of 300 + 300, 256-d float32 features as the embedder gives: the
    vectorised protocol (sorted scores, binary search) gives exactly the fold accuracies and
    thresholds of the literal G x N comparison, and the accuracy the features' signal implies."""
    rng = np.random.default_rng(5)
    is_same, folds = _folds(10, 300)
    left = (rng.normal(size=(6000, 256)) + 0.5).astype(np.float32)
    right = (rng.normal(size=(6000, 256)) + 0.5).astype(np.float32)
    right[is_same] = left[is_same] + 5.0 * rng.normal(size=(int(is_same.sum()), 256)).astype(np.float32)
    result = lfw_10fold_accuracy(left, right, is_same, folds)
    accuracies, thresholds = _naive_protocol(
        left.astype(np.float64), right.astype(np.float64), is_same, folds
    )
    np.testing.assert_allclose(result.fold_accuracies, accuracies, atol=1e-12)
    np.testing.assert_allclose(result.fold_thresholds, thresholds, atol=1e-12)
    assert result.accuracy == pytest.approx(accuracies.mean(), abs=1e-12)
    # After centring, same pairs have a cosine of about 1/sqrt(1 + 5^2) = 0.196 and different
    # pairs about 0, both with a spread of about 1/sqrt(256) = 0.0625: the best threshold is near
    # 0.098, 1.57 spreads from each mean, so about Phi(1.57) = 94% of the pairs are right.
    assert result.accuracy == pytest.approx(0.94, abs=0.015)
    assert result.threshold == pytest.approx(0.098, abs=0.03)


def test_protocol_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="shape"):
        lfw_10fold_accuracy(np.zeros((4, 3)), np.zeros((4, 2)), np.zeros(4, bool), np.arange(4))
    with pytest.raises(ValueError, match="2 folds"):
        lfw_10fold_accuracy(np.ones((4, 3)), np.ones((4, 3)), np.zeros(4, bool), np.zeros(4))


# --- ROC --------------------------------------------------------------------------------------


def test_roc_of_separable_scores_has_auc_one_and_ends_at_one_one():
    scores = np.r_[np.linspace(0.6, 0.9, 50), np.linspace(-0.2, 0.3, 2000)]
    same = np.r_[np.ones(50, bool), np.zeros(2000, bool)]
    curve = roc_curve(scores, same)
    assert curve.auc == pytest.approx(1.0)
    assert (curve.far[0], curve.tar[0]) == (0.0, 0.0)
    assert (curve.far[-1], curve.tar[-1]) == (1.0, 1.0)
    assert np.all(np.diff(curve.far) >= 0) and np.all(np.diff(curve.tar) >= 0)
    assert curve.tar_at_far == {"1e-01": 1.0, "1e-02": 1.0, "1e-03": 1.0}


def test_tar_at_far_allows_floor_far_times_n_false_accepts():
    different = np.arange(1000) / 1000.0  # 0.000 .. 0.999
    same = np.array([0.9975, 0.9985, 0.9995, 0.5])
    scores = np.r_[same, different]
    is_same = np.r_[np.ones(4, bool), np.zeros(1000, bool)]
    # FAR 1e-3 of 1000 -> 1 false accept allowed: threshold = 2nd highest different score 0.998.
    tar, threshold = tar_at_far(scores, is_same, 1e-3)
    assert threshold == pytest.approx(0.998)
    assert tar == pytest.approx(2 / 4)  # 0.9985 and 0.9995 exceed 0.998; 0.9975 and 0.5 do not


def test_tar_at_far_is_none_when_not_measurable():
    scores = np.r_[np.ones(10), np.zeros(100)]
    is_same = np.r_[np.ones(10, bool), np.zeros(100, bool)]
    assert tar_at_far(scores, is_same, 1e-3) is None  # 100 different pairs: 1e-3 * 100 < 1
    assert roc_curve(scores, is_same).tar_at_far["1e-03"] is None


def test_roc_plot_is_a_png(tmp_path):
    rng = np.random.default_rng(6)
    scores = np.r_[rng.normal(0.6, 0.1, 300), rng.normal(0.0, 0.1, 300)]
    same = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    path = plot_roc(roc_curve(scores, same), tmp_path / "sub" / "roc.png", "test model, 99.00%")
    assert path.read_bytes()[:8] == PNG_MAGIC


# --- landmark statistics and the no-face fallback box -----------------------------------------


def test_central_box_is_a_centred_square_of_half_the_short_side():
    np.testing.assert_allclose(central_box((192, 192, 3)), [48, 48, 144, 144])
    np.testing.assert_allclose(central_box((100, 200, 3)), [75, 25, 125, 75])


def test_landmark_error_stats_in_pixels():
    reference = np.tile(np.array([[30, 50], [66, 50], [48, 70], [34, 92], [62, 92]], float), (2, 1, 1))
    predicted = reference.copy()
    predicted[0, 0] += [3, 4]  # 5 px off on image 0's left eye
    stats = landmark_error_stats(predicted, reference)
    assert stats["mean"] == pytest.approx(5 / 10)
    assert stats["median"] == 0.0
    assert stats["per_point"]["left_eye"] == pytest.approx(2.5)
    assert stats["per_point"]["nose"] == 0.0
    assert stats["images"] == 2
    assert stats["mean_offset_xy"] == pytest.approx([0.3, 0.4])
    assert landmark_error_stats(np.zeros((0, 5, 2)), np.zeros((0, 5, 2)))["mean"] is None


# --- parsing ------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_tiny_pairs_file_parses_into_paths_labels_and_folds(tmp_path):
    path = _write(tmp_path / "pairs.txt", "2\t1\nAl\t1\t2\nAl\t1\tBo\t3\nBo\t2\t13\nCy\t4\tAl\t2\n")
    pairs = read_pairs(path)
    assert pairs.left == ("Al/Al_0001.jpg", "Al/Al_0001.jpg", "Bo/Bo_0002.jpg", "Cy/Cy_0004.jpg")
    assert pairs.right == ("Al/Al_0002.jpg", "Bo/Bo_0003.jpg", "Bo/Bo_0013.jpg", "Al/Al_0002.jpg")
    assert pairs.is_same.tolist() == [True, False, True, False]
    assert pairs.fold.tolist() == [0, 0, 1, 1]
    assert pairs.n_folds == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ten\t300\n", r"pairs.txt:1: expected the header"),
        ("2\t1\nAl\t1\t2\nAl\t1\tBo\t3\n", r"promises 2 folds x 2 pairs = 4 pair lines, the file has 2"),
        ("1\t1\nAl\t1\tBo\t2\nAl\t1\tBo\t3\n", r"pairs.txt:2: expected a same-person line"),
        ("1\t1\nAl\t1\t2\nAl\t1\tBo\n", r"pairs.txt:3: expected a different-person line"),
        ("1\t1\nAl\t1\tx\nAl\t1\tBo\t3\n", r"pairs.txt:2: expected a same-person line"),
        ("", r"is empty"),
    ],
)
def test_malformed_pairs_file_names_the_file_and_line(tmp_path, text, message):
    path = _write(tmp_path / "pairs.txt", text)
    with pytest.raises(LFWDataError, match=message) as info:
        read_pairs(path)
    assert str(path) in str(info.value)


def test_missing_pairs_and_landmarks_files_are_clear_errors(tmp_path):
    with pytest.raises(LFWDataError, match=r"pairs file .*nothere.txt does not exist"):
        read_pairs(tmp_path / "nothere.txt")
    with pytest.raises(LFWDataError, match=r"landmarks file .*nothere.txt does not exist"):
        read_landmarks(tmp_path / "nothere.txt")


def test_tiny_landmarks_file_parses_into_points(tmp_path):
    path = _write(tmp_path / "landmarks.txt", "Al/Al_0001.jpg\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\n")
    points = read_landmarks(path)
    np.testing.assert_array_equal(points["Al/Al_0001.jpg"], [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]])


@pytest.mark.parametrize(
    ("line2", "message"),
    [
        ("Bo/Bo_0001.jpg\t1\t2\t3\t4\t5\t6\t7\t8\t9", r"landmarks.txt:2: expected .*\(11 fields\), got 10"),
        ("Bo/Bo_0001.jpg\t1\t2\t3\t4\t5\t6\t7\t8\t9\tx", r"landmarks.txt:2: coordinates must be numbers"),
        ("Al/Al_0001.jpg\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10", r"landmarks.txt:2: Al/Al_0001.jpg is listed twice"),
    ],
)
def test_malformed_landmarks_file_names_the_file_and_line(tmp_path, line2, message):
    first = "Al/Al_0001.jpg\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\n"
    path = _write(tmp_path / "landmarks.txt", first + line2 + "\n")
    with pytest.raises(LFWDataError, match=message):
        read_landmarks(path)


@pytest.mark.shared_data
def test_real_pairs_file_has_10_folds_of_300_same_and_300_different(lfw_dir):
    pairs = read_pairs(lfw_dir / "pairs.txt")
    assert len(pairs) == 6000
    assert pairs.n_folds == 10
    for k in range(10):
        in_fold = pairs.fold == k
        assert in_fold.sum() == 600
        assert pairs.is_same[in_fold].sum() == 300
        assert pairs.is_same[in_fold][:300].all()  # same pairs first in every fold
    assert pairs.left[0] == "Abel_Pacheco/Abel_Pacheco_0001.jpg"
    assert pairs.right[0] == "Abel_Pacheco/Abel_Pacheco_0004.jpg"
    images = pairs.images()
    assert 7000 < len(images) < 13233
    assert all((lfw_dir / "images" / name).is_file() for name in images)
    names_left = [n.split("/")[0] for n in pairs.left]
    names_right = [n.split("/")[0] for n in pairs.right]
    assert all((a == b) == s for a, b, s in zip(names_left, names_right, pairs.is_same, strict=True))


@pytest.mark.shared_data
def test_real_landmarks_file_covers_every_image_inside_the_crop(lfw_dir):
    points = read_landmarks(lfw_dir / "landmarks.txt")
    assert len(points) == 13233
    assert set(read_pairs(lfw_dir / "pairs.txt").images()) <= set(points)
    stacked = np.stack(list(points.values()))
    assert stacked.min() >= 0 and stacked.max() < 192
    # Left eye left of the right eye, eyes above the mouth, in (almost) every image.
    assert np.mean(stacked[:, 0, 0] < stacked[:, 1, 0]) > 0.99
    assert np.mean(stacked[:, 0, 1] < stacked[:, 3, 1]) > 0.99


@pytest.mark.shared_data
def test_subset_keeps_the_first_same_and_different_pairs_of_each_fold(lfw_dir):
    pairs = read_pairs(lfw_dir / "pairs.txt")
    subset = pairs.subset(20)
    assert len(subset) == 200
    for k in range(10):
        assert subset.is_same[subset.fold == k].sum() == 10
    assert subset.left[:10] == pairs.left[:10]
    assert subset.left[10] == pairs.left[300]
    with pytest.raises(ValueError, match="even"):
        pairs.subset(7)


# --- ensembles ----------------------------------------------------------------------------------


def test_concatenated_unit_features_score_the_mean_of_the_models_cosines():
    from models.ensemble import concatenated_unit_features

    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(6, 8)) * 5, rng.normal(size=(6, 4)) * 0.1  # different widths and scales
    both = concatenated_unit_features([a, b])
    assert both.shape == (6, 12)
    np.testing.assert_allclose(np.linalg.norm(both, axis=1), 1.0)
    cos = lambda x: _unit(x[:3]) @ _unit(x[3:]).T  # noqa: E731
    np.testing.assert_allclose(both[:3] @ both[3:].T, (cos(a) + cos(b)) / 2, atol=1e-12)
    with pytest.raises(ValueError, match="row counts"):
        concatenated_unit_features([a, b[:5]])
    with pytest.raises(ValueError, match="at least one"):
        concatenated_unit_features([])


@pytest.mark.shared_data
@pytest.mark.slow
def test_lfw_ensemble_of_two_real_models_scores_the_mean_cosine(
    lfw_dir, reference_model_dir, default_model_dir
):
    """`sphereface evaluate lfw --with`: the reference MobileFaceNet and dlib's ResNet on the same
    200 pairs; the ensemble's ROC is that of the mean of their cosines, and a model with itself is
    the model alone."""
    runs = [
        run_lfw_evaluation(model, lfw_dir, landmarks="file", pairs_per_fold=10, progress=False)
        for model in (reference_model_dir, default_model_dir)
    ]
    ensemble = lfw_ensemble(runs)
    assert ensemble.model_ids == [r.model_id for r in runs]
    cosines = []
    for r in runs:
        left, right = pair_features(_unit(r.features.astype(np.float64)), r.names, r.pairs)
        cosines.append(np.sum(left * right, axis=1))
    assert ensemble.roc.auc == pytest.approx(
        roc_curve((cosines[0] + cosines[1]) / 2, runs[0].pairs.is_same).auc
    )
    alone = lfw_ensemble([runs[0], runs[0]])
    assert alone.protocol.fold_accuracies == pytest.approx(runs[0].protocol.fold_accuracies)
    assert alone.cosine.accuracy == pytest.approx(runs[0].cosine.accuracy)
    assert "ensemble of" in ensemble.summary()
    with pytest.raises(ValueError, match="at least two"):
        lfw_ensemble(runs[:1])


@pytest.mark.shared_data
def test_evaluate_lfw_with_refuses_to_write_one_models_manifest(reference_model_dir, capsys):
    from models.cli import main

    code = main(
        [
            "evaluate",
            "lfw",
            "--model",
            str(reference_model_dir),
            "--with",
            str(reference_model_dir),
            "--data",
            "nowhere",
            "--write-lfw",
        ]
    )
    assert code == 2 and "--write-lfw" in capsys.readouterr().err


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.shared_data
@pytest.mark.slow
def test_file_landmarks_end_to_end_on_a_subset_is_accurate_and_writes_json_and_png(
    lfw_dir, reference_model_dir, tmp_path
):
    result = run_lfw_evaluation(
        model_dir=reference_model_dir,
        data_dir=lfw_dir,
        landmarks="file",
        json_out=tmp_path / "lfw.json",
        plot_out=tmp_path / "lfw.png",
        pairs_per_fold=20,
        progress=False,
    )
    assert result.n_pairs == 200
    assert result.accuracy > 0.9
    assert (tmp_path / "lfw.png").read_bytes()[:8] == PNG_MAGIC
    written = json.loads((tmp_path / "lfw.json").read_text())
    for key in (
        "accuracy",
        "std",
        "fold_accuracies",
        "threshold",
        "fold_thresholds",
        "no_face_images",
        "model_id",
        "provider",
        "landmarks",
        "n_pairs",
        "timing_s",
    ):
        assert key in written, key
    assert written["accuracy"] == pytest.approx(result.accuracy)
    assert len(written["fold_accuracies"]) == 10
    assert written["no_face_images"] == 0
    assert written["provider"] == "CPUExecutionProvider"
    summary = result.summary()
    assert f"{100 * result.accuracy:.2f}%" in summary and "threshold" in summary


@pytest.mark.shared_data
def test_detect_mode_falls_back_to_the_central_box_and_lists_images_without_a_face(
    lfw_dir, reference_model_dir, tmp_path, monkeypatch
):
    pytest.importorskip("models.mtcnn")
    from models.image import read_image
    from models.mtcnn import DetectedFace

    pairs = read_pairs(lfw_dir / "pairs.txt").subset(2)
    reference = read_landmarks(lfw_dir / "landmarks.txt")
    names = pairs.images()
    blind = set(names[:3])
    by_pixels = {read_image(lfw_dir / "images" / n).tobytes(): n for n in names}
    boxes: list[np.ndarray] = []

    class Detector:
        provider = "fake"

        def detect(self, image):
            name = by_pixels[image.tobytes()]
            if name in blind:
                return []
            points = reference[name]
            box = np.r_[points.min(0) - 20, points.max(0) + 20]
            return [DetectedFace(box=box, score=0.99, landmarks=points + 1.0)]

        def landmarks_in_box(self, image, box):
            boxes.append(np.asarray(box, dtype=float))
            points = reference[by_pixels[image.tobytes()]]
            return DetectedFace(box=np.asarray(box), score=0.5, landmarks=points)

    result = run_lfw_evaluation(
        model_dir=reference_model_dir,
        data_dir=lfw_dir,
        landmarks="detect",
        json_out=tmp_path / "detect.json",
        pairs_per_fold=2,
        detector=Detector(),
        progress=False,
    )
    written = json.loads((tmp_path / "detect.json").read_text())
    assert written["no_face_images"] == 3
    assert sorted(written["no_face_list"]) == sorted(blind)
    assert written["faces_found_share"] == pytest.approx((len(names) - 3) / len(names))
    assert "central" in written["no_face_policy"]
    assert len(boxes) == 3
    for box in boxes:
        np.testing.assert_allclose(box, [48, 48, 144, 144])
    # Found faces are 1 px off in x and y on every point: sqrt(2) px.
    assert written["landmark_error_px"]["mean"] == pytest.approx(np.sqrt(2))
    assert written["landmark_error_px"]["images"] == len(names) - 3
    assert "landmark error" in result.summary()


@pytest.mark.shared_data
@pytest.mark.slow
def test_detect_mode_with_our_mtcnn_finds_lfw_faces_near_the_file_landmarks(
    lfw_dir, reference_model_dir, tmp_path
):
    result = run_lfw_evaluation(
        model_dir=reference_model_dir,
        data_dir=lfw_dir,
        landmarks="detect",
        json_out=tmp_path / "detect.json",
        plot_out=tmp_path / "detect.png",
        pairs_per_fold=6,
        progress=False,
    )
    written = json.loads((tmp_path / "detect.json").read_text())
    assert written["landmarks"] == "detect"
    assert written["faces_found_share"] >= 0.95
    assert written["landmark_error_px"]["mean"] < 4.0
    assert result.accuracy > 0.85
    assert (tmp_path / "detect.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.shared_data
def test_detector_landmark_report_over_the_first_lfw_images(lfw_dir):
    from models.mtcnn import MTCNNDetector
    from training.evaluation.landmarks import detector_landmark_report

    report = detector_landmark_report(lfw_dir, MTCNNDetector(intra_op_threads=1), limit=24, progress=False)
    assert report["images"] == 24
    assert report["faces_found"] + report["no_face_images"] == 24
    assert report["faces_found_share"] >= 0.9
    assert report["landmark_error_px"]["mean"] < 4.0
    assert set(report["landmark_error_px"]["per_point"]) == {
        "left_eye",
        "right_eye",
        "nose",
        "left_mouth",
        "right_mouth",
    }


def test_cosine_protocol_scores_pairs_as_the_service_does_without_the_mean():
    """``subtract_mean=False``: the same folds and threshold rule on the raw cosine; with a large
    offset shared by every feature the two protocols disagree, and the raw one is what a
    hand-computed per-fold threshold on the cosine gives."""
    from training.evaluation.verification import best_threshold, lfw_10fold_accuracy, verification_accuracy

    rng = np.random.default_rng(4)
    n, dim = 400, 8
    is_same = np.arange(n) % 2 == 0
    left = rng.standard_normal((n, dim))
    right = np.where(
        is_same[:, None], left + 0.9 * rng.standard_normal((n, dim)), rng.standard_normal((n, dim))
    )
    offset = 3.0 * np.ones(dim)
    folds = np.arange(n) % 10
    raw = lfw_10fold_accuracy(left + offset, right + offset, is_same, folds, subtract_mean=False)
    centred = lfw_10fold_accuracy(left + offset, right + offset, is_same, folds)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    cosine = np.sum(unit(left + offset) * unit(right + offset), axis=1)
    expected = []
    for k in range(10):
        threshold, _ = best_threshold(cosine[folds != k], is_same[folds != k])
        expected.append(verification_accuracy(cosine[folds == k], is_same[folds == k], threshold))
    assert raw.accuracy == pytest.approx(np.mean(expected))
    assert centred.accuracy > raw.accuracy + 0.05  # the offset hides the signal from the raw cosine


# --- aligned crops for training and export: landmarks from the file or from our MTCNN -------------


def test_aligned_lfw_crops_rejects_an_unknown_landmarks_mode(tmp_path):
    from training.evaluation.lfw import aligned_lfw_crops

    with pytest.raises(ValueError, match=r"landmarks must be one of \('file', 'detect'\), got 'dlib'"):
        aligned_lfw_crops(tmp_path, landmarks="dlib")


def test_detected_landmarks_key_changes_with_the_images_and_the_detector(tmp_path):
    import os

    from training.evaluation.cache import detected_landmarks_key

    for name in ("A/A_0001.jpg", "B/B_0001.jpg"):
        (tmp_path / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / name).write_bytes(b"jpeg")
    names = ["A/A_0001.jpg", "B/B_0001.jpg"]
    key = detected_landmarks_key(tmp_path, names)
    assert key == detected_landmarks_key(tmp_path, list(names))
    assert key["lfw_dir"] == str(tmp_path.resolve())
    assert detected_landmarks_key(tmp_path, names[:1]) != key  # another image list
    os.utime(tmp_path / "images" / names[1], ns=(1, 1))  # a photo replaced in place
    touched = detected_landmarks_key(tmp_path, names)
    assert touched["images_sha256"] != key["images_sha256"]
    detector = key["detector"]
    assert detector["provider"] == "CPUExecutionProvider"
    assert detector["settings"]["min_face_size"] == 20.0 and len(detector["settings"]["thresholds"]) == 3
    assert set(detector["weights_sha256"]) == {"pnet", "rnet", "onet"}
    assert detected_landmarks_key(tmp_path, names, providers="cuda")["detector"] != detector


@pytest.mark.shared_data
def test_detect_mode_crops_are_our_mtcnn_alignment_and_cached_per_key(lfw_dir, tmp_path, monkeypatch):
    """``aligned_lfw_crops(landmarks="detect")``: the crops of aligning with
    detect_central_landmarks directly; a second call is served from the cache without a detector;
    another pairs subset or a cache file with another key is detected again, never served stale."""
    import training.evaluation.cache as cache_module
    import training.evaluation.lfw as lfw
    from models.align import SPHEREFACE_TEMPLATE_112x96, align_face
    from models.image import read_image
    from models.mtcnn import MTCNNDetector

    made: list[object] = []
    make_detector = cache_module.make_detector

    def counting(providers):
        made.append(providers)
        return make_detector(providers)

    monkeypatch.setattr(cache_module, "make_detector", counting)
    cache = tmp_path / "cache"
    detector = MTCNNDetector(intra_op_threads=1)

    def direct(names, shift=0.0):
        crops = []
        for name in names:
            image = read_image(lfw_dir / "images" / name)
            points, _ = cache_module.detect_central_landmarks(detector, image)
            crops.append(align_face(image, points + shift, SPHEREFACE_TEMPLATE_112x96))
        return np.stack(crops)

    crops, names, pairs = lfw.aligned_lfw_crops(lfw_dir, 2, landmarks="detect", cache_dir=cache)
    assert len(made) == 1
    assert names == pairs.images() and len(pairs) == 20 and crops.shape == (len(names), 112, 96, 3)
    np.testing.assert_array_equal(crops, direct(names))
    file_crops, file_names, _ = lfw.aligned_lfw_crops(lfw_dir, 2, landmarks="file")
    assert file_names == names and not np.array_equal(file_crops, crops)  # the ~1 px apart source
    (cached,) = cache.glob("*.npz")

    again, again_names, _ = lfw.aligned_lfw_crops(lfw_dir, 2, landmarks="detect", cache_dir=cache)
    assert len(made) == 1 and again_names == names
    np.testing.assert_array_equal(again, crops)
    # What is served is the file's content: landmarks moved 3 px right in the cache move the crops.
    with np.load(cached) as data:
        content = {k: data[k] for k in data.files}
    np.savez(cached, **{**content, "landmarks": content["landmarks"] + [3.0, 0.0]})
    shifted, _, _ = lfw.aligned_lfw_crops(lfw_dir, 2, landmarks="detect", cache_dir=cache)
    assert len(made) == 1
    np.testing.assert_array_equal(shifted, direct(names, np.array([3.0, 0.0])))

    # Another image list is another key: detected again, in a second file.
    wider, wider_names, _ = lfw.aligned_lfw_crops(lfw_dir, 4, landmarks="detect", cache_dir=cache)
    assert len(made) == 2 and len(set(wider_names) - set(names)) > 0
    assert len(list(cache.glob("*.npz"))) == 2
    np.testing.assert_array_equal(wider, direct(wider_names))
    # A file under the right name whose stored key differs (e.g. written by other detector
    # settings) is not trusted: detected again and rewritten.
    np.savez(cached, **{**content, "key": np.array('{"detector": "another"}')})
    fresh, _, _ = lfw.aligned_lfw_crops(lfw_dir, 2, landmarks="detect", cache_dir=cache)
    assert len(made) == 3
    np.testing.assert_array_equal(fresh, crops)
    with np.load(cached) as data:
        assert str(data["key"]) == str(content["key"])
