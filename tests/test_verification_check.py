"""The verification sets a training config names (``verification_sets``), checked during training."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from training.callbacks import Interval
from training.config import ConfigError, load_config
from training.evaluation.bin_sets import encode_face, read_bin, write_bin
from training.evaluation.errors import VerificationSetError
from training.verification_check import VerificationSetsCheck, set_features


def _tiny_set(path: Path, pairs: int = 20, seed: int = 0) -> Path:
    """Random 112x112 faces; each same pair is one face twice, so a working check scores it
    perfectly on any network."""
    rng = np.random.default_rng(seed)
    images, same = [], []
    for i in range(pairs):
        first = encode_face(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8))
        is_same = i % 2 == 0
        second = first if is_same else encode_face(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8))
        images += [first, second]
        same.append(is_same)
    return write_bin(path, images, same)


@pytest.fixture(scope="module")
def net() -> torch.nn.Module:
    from models.nets import build_network

    torch.manual_seed(0)
    return build_network("sphereface4", 32)


def test_features_are_the_sphereface_crop_of_each_face_and_its_mirror(tmp_path: Path, net):
    from models.image import decode_image
    from training.lfw_check import embed_crops

    verification_set = read_bin(_tiny_set(tmp_path / "tiny.bin", pairs=10))
    fused, summed = set_features(net, verification_set, torch.device("cpu"), bf16=False)
    faces = np.stack([decode_image(b) for b in verification_set.images])
    expected = embed_crops(net, np.ascontiguousarray(faces[:, :, 8:104]), torch.device("cpu"))
    np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(summed, expected[:, :32] + expected[:, 32:], rtol=1e-5, atol=1e-5)


def test_the_check_logs_each_set_at_its_steps_and_keeps_earlier_lines_on_resume(tmp_path: Path, net):
    paths = [_tiny_set(tmp_path / "a.bin", pairs=10), _tiny_set(tmp_path / "b.bin", pairs=10, seed=1)]
    log = tmp_path / "verification.csv"
    check = VerificationSetsCheck(paths, net, torch.device("cpu"), False, 2, log, resume_step=0)
    for done in (1, 2, 3):
        row: dict = {}
        check.on_interval(Interval(done, done == 3, row))
        assert set(row) == (set() if done == 1 else {"a_accuracy", "b_accuracy"})
    assert check.last is not None and check.last["a"]["pairs"] == 10
    # identical faces make every same pair a perfect match: the cosine check separates them
    assert check.last["a"]["accuracy_cosine"] == 1.0 and check.last["a"]["accuracy"] == 1.0
    with log.open() as handle:
        lines = list(csv.DictReader(handle))
    assert [(r["step"], r["set"]) for r in lines] == [("2", "a"), ("2", "b"), ("3", "a"), ("3", "b")]
    assert float(lines[0]["accuracy"]) == 1.0
    # a resume from step 2 keeps the lines up to step 2 only
    VerificationSetsCheck(paths, net, torch.device("cpu"), False, 2, log, resume_step=2)
    with log.open() as handle:
        assert [r["step"] for r in csv.DictReader(handle)] == ["2", "2"]


def test_two_sets_of_one_name_are_refused(tmp_path: Path, net):
    (tmp_path / "x").mkdir()
    paths = [_tiny_set(tmp_path / "lfw.bin"), _tiny_set(tmp_path / "x" / "lfw.bin")]
    with pytest.raises(VerificationSetError, match="twice"):
        VerificationSetsCheck(paths, net, torch.device("cpu"), False, 0, tmp_path / "v.csv", 0)


def test_the_config_field_takes_a_list_of_paths():
    assert load_config(None, ['verification_sets=["a.bin", "b.bin"]']).verification_sets == ["a.bin", "b.bin"]
    assert load_config(None, []).verification_sets == []
    with pytest.raises(ConfigError, match="verification_sets"):
        load_config(None, ['verification_sets="a.bin"'])
    assert 'verification_sets = ["a.bin"]' in load_config(None, ['verification_sets=["a.bin"]']).to_toml()


@pytest.mark.shared_data
def test_a_training_run_checks_its_sets_and_reports_them(tiny_prepared, tmp_path: Path):
    from training.trainer import train

    path = _tiny_set(tmp_path / "tiny.bin")
    overrides = [
        f"data={tiny_prepared.path}", f"out_dir={tmp_path}", "name=run", "network=sphereface4",
        "batch_size=8", "steps=2", "log_every=1", "checkpoint_every=0", 'lfw=""', "threads=1", "lfw_every=0",
        f'verification_sets=["{path}"]',
    ]  # fmt: skip
    result = train(load_config(None, overrides), progress=False)
    assert result.summary["verification_sets"]["tiny"]["pairs"] == 20
    with (tmp_path / "run" / "verification.csv").open() as handle:
        assert [(r["step"], r["set"]) for r in csv.DictReader(handle)] == [("2", "tiny")]
