"""The trainer, its config files, its data loaders and the export, on real faces on CPU."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import ConfigError, load_config, parse_override
from training.data import DeviceResidentLoader, StreamingLoader, to_network_input
from training.trainer import lr_factor

CONFIGS = Path(__file__).resolve().parent.parent / "training" / "configs"


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def test_every_shipped_config_loads_and_validates():
    paths = sorted(CONFIGS.rglob("*.toml"))
    assert len(paths) >= 10
    for path in paths:
        config = load_config(path)
        assert config.steps > 0, path


def test_child_config_overrides_its_base_and_replaces_tables():
    softmax = load_config(CONFIGS / "celeba" / "sf4_softmax.toml")
    assert softmax.network == "sphereface4"  # from celeba/base.toml
    assert softmax.momentum == 0.9  # from base.toml
    assert softmax.head == "softmax" and softmax.head_options == {}  # table replaced, not merged
    m2 = load_config(CONFIGS / "celeba" / "sf4_asoftmax_m2.toml")
    assert m2.head_options == {"m": 2}


def test_command_line_overrides_are_parsed_as_toml():
    config = load_config(
        CONFIGS / "celeba" / "sf4_asoftmax_m4.toml",
        ["steps=7", "lr=0.05", "head_options.m=3", "name=x y"],
    )
    assert (config.steps, config.lr, config.head_options["m"], config.name) == (7, 0.05, 3, "x y")
    assert parse_override("flip=false") == ("flip", False)


def test_bad_configs_get_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config fields"):
        load_config(None, ["stepz=3"])
    with pytest.raises(ConfigError, match="network must be one of"):
        load_config(None, ["network=resnet50"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    loop = tmp_path / "a.toml"
    loop.write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="loops"):
        load_config(loop)


def test_learning_rate_drops_tenfold_at_the_papers_fractions_of_the_run():
    config = load_config(None, ["steps=28000"])
    assert config.lr_milestones() == [16000, 24000]
    assert lr_factor(15999, config) == 1.0
    assert lr_factor(16000, config) == pytest.approx(0.1)
    assert lr_factor(24000, config) == pytest.approx(0.01)
    short = load_config(None, ["steps=700"])
    assert short.lr_milestones() == [400, 600]


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------


def _toy_faces(n: int = 40, classes: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 112, 96, 3), dtype=np.uint8)
    labels = np.arange(n) % classes
    return images, labels


def test_network_input_is_normalised_nchw_and_flip_mirrors_only_chosen_images():
    images, _ = _toy_faces(4)
    batch = torch.from_numpy(images)
    plain = to_network_input(batch)
    assert plain.shape == (4, 3, 112, 96) and plain.dtype == torch.float32
    expected = (images[1].astype(np.float32).transpose(2, 0, 1) - 127.5) / 128
    np.testing.assert_allclose(plain[1].numpy(), expected, atol=1e-6)
    mask = torch.tensor([True, False, True, False])
    flipped = to_network_input(batch, mask)
    torch.testing.assert_close(flipped[0], plain[0].flip(2))
    torch.testing.assert_close(flipped[1], plain[1])


def test_device_resident_loader_covers_each_epoch_once_and_splits_ranks():
    images, labels = _toy_faces(40)
    seen = []
    for rank in (0, 1):
        loader = DeviceResidentLoader(images, labels, 4, "cpu", flip=False, seed=3, rank=rank, world_size=2)
        batches = iter(loader)
        for _ in range(loader.batches_per_epoch):
            x, _ = next(batches)
            seen.append(x)
    # 40 faces, 2 ranks x 5 batches of 4: every face exactly once per epoch over both ranks.
    flat = torch.cat(seen).reshape(40, -1)
    originals = to_network_input(torch.from_numpy(images)).reshape(40, -1)
    matches = (flat[:, None, :] == originals[None]).all(-1)
    assert matches.sum(0).tolist() == [1] * 40


def test_device_resident_loader_rejects_a_dataset_smaller_than_a_batch():
    images, labels = _toy_faces(6)
    with pytest.raises(ValueError, match="fewer than one batch"):
        DeviceResidentLoader(images, labels, 8, "cpu")


def test_streaming_loader_yields_every_label_of_its_shards():
    images, labels = _toy_faces(48)
    shards = [(images[:24], labels[:24]), (images[24:], labels[24:])]
    loader = StreamingLoader(shards, 8, "cpu", flip=True, window=1, prefetch=2)
    batches = iter(loader)
    got = [next(batches) for _ in range(6)]  # one epoch: 2 shards x 3 batches
    all_labels = torch.cat([y for _, y in got]).numpy()
    assert sorted(all_labels.tolist()) == sorted(labels.tolist())
    assert all(x.shape == (8, 3, 112, 96) for x, _ in got)
    batches.close()


def test_streaming_loader_reports_shards_too_small_for_a_batch():
    images, labels = _toy_faces(6)
    loader = StreamingLoader([(images, labels)], 8, "cpu", window=1)
    with pytest.raises(ValueError, match="full batch"):
        next(iter(loader))


# --------------------------------------------------------------------------------------------
# Training on real faces (two identities of celeba_faces)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory):
    from tests.conftest import require_shared
    from training.prepare import prepare_dataset

    source = require_shared("celeba_faces")
    out = tmp_path_factory.mktemp("prepared") / "celeba2"
    return prepare_dataset(source, out, limit_identities=2, workers=2, progress=False)


@pytest.mark.shared_data
def test_two_step_training_run_logs_checkpoints_resumes_and_exports(tiny_prepared, tmp_path):
    from models.embedder import Embedder
    from training.export import export_checkpoint
    from training.trainer import train

    overrides = [
        f"data={tiny_prepared.path}", f"out_dir={tmp_path}", "name=smoke", "network=sphereface4",
        "head=sphereface_plus", "head_options={ m = 4, mhe_weight = 1.0 }", "batch_size=8", "steps=2",
        "log_every=1", "checkpoint_every=1", 'lfw=""', "threads=1",
    ]  # fmt: skip
    result = train(load_config(None, overrides), progress=False)
    run = tmp_path / "smoke"
    assert result.run_dir == run
    with (run / "log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(np.isfinite(float(r["loss"])) for r in rows)
    # lambda's decay is scaled to the 2-step run: 1000 at step 0, at its floor of 5 by step 1.
    assert [float(r["lambda"]) for r in rows] == [1000.0, 5.0]
    assert float(rows[0]["mhe"]) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_classes"] == 2 and summary["classifier_energy_s2"] > 0
    assert (run / "curves.png").stat().st_size > 0

    # A second session continues from the checkpoint instead of starting over.
    with pytest.raises(ConfigError, match="--resume"):
        train(load_config(None, overrides), progress=False)
    resumed = train(load_config(None, [*overrides, "steps=3"]), resume=True, progress=False)
    assert resumed.summary["final"]["step"] == 3
    with (run / "log.csv").open() as handle:
        assert [int(r["step"]) for r in csv.DictReader(handle)] == [1, 2, 3]

    # Export: ONNX with a dynamic batch, same embedding as PyTorch on real crops.
    model_dir = tmp_path / "model"
    manifest, report = export_checkpoint(run / "checkpoint.pt", model_dir, progress=False)
    assert manifest.architecture == "sphereface4" and manifest.embedding_size == 512
    assert report["onnx_parity_max_abs_diff"] < 1e-3
    crops = tiny_prepared.concatenate()[0][:3]
    fused = Embedder(model_dir, "cpu").embed(crops)
    assert fused.shape == (3, 1024)
    np.testing.assert_allclose(np.linalg.norm(fused, axis=1), 1.0, atol=1e-5)


@pytest.mark.shared_data
@pytest.mark.slow
def test_two_processes_under_torchrun_train_one_model(tiny_prepared, tmp_path):
    import os
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "service.cli", "train",
        "--no-progress", "--set", f"data={tiny_prepared.path}", "--set", f"out_dir={tmp_path}",
        "--set", "name=ddp", "--set", "network=sphereface4", "--set", "batch_size=8", "--set", "steps=2",
        "--set", "log_every=1", "--set", 'lfw=""', "--set", "threads=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes x batch 4" in done.stderr
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["final"]["step"] == 2


def test_lambda_floor_in_epochs_sets_the_warm_phase_by_dataset_size():
    from training.trainer import build_model

    overrides = ["network=sphereface4", "head=asoftmax", "lambda_floor_epochs=1.0", "batch_size=128"]
    config = load_config(None, overrides)
    head = build_model(config, num_classes=5, num_images=6237).head
    # One epoch of 6,237 faces at batch 128 is 48.7 steps: lambda is above 5 at step 48, 5 at 49.
    assert head.lambda_schedule(48) > 5.0 and head.lambda_schedule(49) == 5.0
    with pytest.raises(ConfigError, match="number of training images"):
        build_model(config, num_classes=5)
