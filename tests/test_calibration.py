"""Threshold calibration on every pair of a photo set (training/evaluation/calibration.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from training.evaluation.calibration import (
    calibrate,
    identity_folds,
    score_all_pairs,
    write_calibration,
)
from training.evaluation.verification import false_accepts_allowed


def _clustered(n_people: int, per_person: int, dim: int = 16, spread: float = 0.6, seed: int = 0):
    """Unit vectors in clusters: one centre per person plus noise."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_people, dim))
    identities = [f"p{i:03d}" for i in range(n_people) for _ in range(per_person)]
    x = np.repeat(centres, per_person, axis=0) + spread * rng.standard_normal((n_people * per_person, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), identities


def _brute_force(unit: np.ndarray, identities: list[str]):
    scores = unit.astype(np.float64) @ unit.T.astype(np.float64)
    i, j = np.triu_indices(len(unit), k=1)
    ident = np.array(identities)
    same = ident[i] == ident[j]
    return scores[i, j][~same], scores[i, j][same], i, j, same


def test_thresholds_are_the_order_statistics_of_all_impostor_pairs():
    unit, identities = _clustered(60, 5)
    folds = identity_folds(identities, n_folds=5)
    scores = score_all_pairs(unit, identities, folds, keep=2000, block=37, progress=False)
    impostor, genuine, *_ = _brute_force(unit, identities)
    assert scores.n_impostor == len(impostor) and len(scores.genuine) == len(genuine)
    result = calibrate(scores, fars=(1e-2, 1e-3), n_folds=5)
    for far, label in ((1e-2, "1e-02"), (1e-3, "1e-03")):
        allowed = false_accepts_allowed(far, len(impostor))
        expected = np.sort(impostor)[::-1][allowed]
        entry = result[label]
        assert entry["threshold"] == pytest.approx(expected, abs=1e-6)
        # At most `allowed` impostor pairs score above the threshold.
        assert np.count_nonzero(impostor > entry["threshold"] + 1e-6) <= allowed
        assert entry["tar"] == pytest.approx(np.mean(genuine > entry["threshold"]), abs=1e-3)
    # 60 people x 5 photos: 44,250 impostor pairs cannot measure a FAR of 1e-5.
    assert calibrate(scores, fars=(1e-5,), n_folds=5)["1e-05"] is None


def test_heldout_rates_come_from_pairs_within_each_fold_chosen_on_the_others():
    unit, identities = _clustered(80, 4, seed=1)
    folds = identity_folds(identities, n_folds=4, seed=3)
    scores = score_all_pairs(unit, identities, folds, keep=5000, progress=False)
    impostor, genuine, i, j, same = _brute_force(unit, identities)
    fi, fj = folds[i], folds[j]
    result = calibrate(scores, fars=(1e-2,), n_folds=4)
    fars = []
    for k in range(4):
        outside = (fi != k) & (fj != k) & ~same
        train = np.sort((unit[i] * unit[j]).sum(1)[outside])[::-1]
        t = train[false_accepts_allowed(1e-2, len(train))]
        inside = (fi == k) & (fj == k) & ~same
        fars.append(np.mean((unit[i] * unit[j]).sum(1)[inside] > t))
    assert result["1e-02"]["heldout_far"] == pytest.approx(np.mean(fars), abs=1e-6)


def test_identity_folds_keep_each_person_in_one_fold_and_are_seeded():
    identities = [f"p{i % 37}" for i in range(500)]
    folds = identity_folds(identities, n_folds=10, seed=0)
    for person in set(identities):
        assert len({int(f) for f, p in zip(folds, identities, strict=True) if p == person}) == 1
    assert np.array_equal(folds, identity_folds(identities, n_folds=10, seed=0))
    assert not np.array_equal(folds, identity_folds(identities, n_folds=10, seed=1))


def test_write_calibration_sets_both_roles_and_records_the_set(tmp_path):
    from models.manifest import ModelManifest, load_manifest_data, save_manifest

    save_manifest(tmp_path, ModelManifest(name="m", version="1", architecture="x", embedding_size=4))
    report = {
        "set": "lfw-all-pairs",
        "description": "every pair",
        "landmarks": "detect",
        "photos": 100,
        "n_impostor": 4000,
        "n_genuine": 50,
        "fars": {
            "1e-03": {
                "threshold": 0.5,
                "tar": 0.9,
                "tar_per_identity": 0.8,
                "heldout_far": 1e-3,
                "heldout_tar": 0.9,
            },
            "1e-04": {
                "threshold": 0.6,
                "tar": 0.7,
                "tar_per_identity": 0.6,
                "heldout_far": 1e-4,
                "heldout_tar": 0.7,
            },
        },
    }
    write_calibration(tmp_path, report)
    manifest = load_manifest_data(tmp_path)
    verification = manifest.thresholds["verification"]
    assert verification.value == 0.5 and verification.far == 1e-3
    assert manifest.thresholds["identification"].value == 0.6
    assert manifest.calibration["n_impostor"] == 4000 and manifest.calibration["set"] == "lfw-all-pairs"
    assert json.loads((tmp_path / "manifest.json").read_text())["calibration"]["landmarks"] == "detect"
    report["fars"].pop("1e-04")
    with pytest.raises(Exception, match="FAR 0.0001 was not calibrated"):
        write_calibration(tmp_path, report)


def test_calibrate_without_lfw_reads_the_shared_lfw_folder_beside_the_repository(monkeypatch, tmp_path):
    """``sphereface calibrate`` with no ``--lfw`` calibrates on ``../shared/data/lfw``."""
    from models.cli import main
    from tests.conftest import REPO_ROOT
    from training.evaluation import calibration, commands

    assert commands.DEFAULT_LFW_DIR == REPO_ROOT.parent / "shared" / "data" / "lfw"
    seen = {}

    def fake_run(model_dir, lfw_dir, **options):
        seen["lfw"] = lfw_dir
        raise calibration.LFWDataError("stop here")

    monkeypatch.setattr(calibration, "run_calibration", fake_run)
    assert main(["calibrate", "--model", str(tmp_path), "--no-write"]) == 2
    assert seen["lfw"] == REPO_ROOT.parent / "shared" / "data" / "lfw"
