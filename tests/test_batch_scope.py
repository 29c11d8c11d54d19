"""``batch_scope``: whether ``batch_size`` is the global batch of a step or each process's batch.

The authors' released run (``sphereface_train.sh 0,1``) runs the prototxt's 256 on each of two
GPUs, 512 per iteration; ``base.toml`` keeps 256 in all. Both are configs, and the trainer, the
loaders and ``summary.json`` split and count the batch as the config says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from training.config import ConfigError, load_config
from training.data import DeviceResidentLoader

CONFIGS = Path(__file__).resolve().parent.parent / "training" / "configs"


def test_base_config_counts_the_global_batch_and_the_2gpu_variant_each_processs():
    base = load_config(CONFIGS / "base.toml")
    assert base.batch_scope == "global"
    assert [base.global_batch(n) for n in (1, 2, 4)] == [256, 256, 256]
    assert [base.batch_per_process(n) for n in (1, 2, 4)] == [256, 128, 64]
    authors = load_config(CONFIGS / "casia_sphereface20_2gpu.toml")
    assert authors.batch_scope == "process"
    assert authors.global_batch(2) == 512 and authors.batch_per_process(2) == 256
    # the variant differs from base.toml in its name and in what batch_size counts only
    changed = {k for k, v in vars(authors).items() if v != vars(base)[k]}
    assert changed == {"name", "batch_scope"}


def test_batch_scope_is_checked_and_an_uneven_global_batch_is_refused():
    with pytest.raises(ConfigError, match="batch_scope must be global or process"):
        load_config(None, ["batch_scope=gpu"])
    config = load_config(None, ["batch_size=10"])
    with pytest.raises(ConfigError, match="batch_size 10 is not divisible by 3 processes"):
        config.batch_per_process(3)
    assert load_config(None, ["batch_size=10", "batch_scope=process"]).batch_per_process(3) == 10


def test_the_written_config_names_the_scope():
    text = load_config(None, ["batch_scope=process"]).to_toml()
    assert 'batch_scope = "process"' in text.splitlines()


def test_lambda_floor_in_epochs_counts_the_global_batch_of_all_processes():
    from training.trainer import build_model

    overrides = ["network=sphereface4", "head=asoftmax", "lambda_floor_epochs=1.0", "batch_size=64",
                 "batch_scope=process"]  # fmt: skip
    config = load_config(None, overrides)
    # 2 processes x 64 = 128 per step: one epoch of 6,237 faces is 48.7 steps
    head = build_model(config, num_classes=5, num_images=6237, processes=2).head
    assert head.lambda_schedule(48) > 5.0 and head.lambda_schedule(49) == 5.0
    # one process: 64 per step, 97.5 steps
    head = build_model(config, num_classes=5, num_images=6237, processes=1).head
    assert head.lambda_schedule(97) > 5.0 and head.lambda_schedule(98) == 5.0


def _rank_batches(config_overrides: list[str], world_size: int, steps: int = 3) -> list[list[np.ndarray]]:
    """Each rank's first ``steps`` batches (face indices) with the batch the config gives a rank."""
    config = load_config(None, config_overrides)
    per_process = config.batch_per_process(world_size)
    images = np.arange(48, dtype=np.uint8).reshape(48, 1, 1, 1).repeat(112, 1).repeat(96, 2).repeat(3, 3)
    labels = np.arange(48) % 6
    out = []
    for rank in range(world_size):
        loader = DeviceResidentLoader(images, labels, per_process, "cpu", flip=False, seed=1, rank=rank,
                                      world_size=world_size)  # fmt: skip
        batches = iter(loader)
        taken = []
        for _ in range(steps):
            x, _ = next(batches)
            # every pixel of face i holds i: recover the face index from the normalised input
            taken.append(np.unique(x[:, 0, 0, 0].numpy()))
        out.append(taken)
    return out


@pytest.mark.parametrize(("overrides", "per_rank"), [
    (["batch_size=8"], 4),
    (["batch_size=8", "batch_scope=process"], 8),
])  # fmt: skip
def test_each_rank_draws_its_own_batch_and_the_ranks_never_share_a_face(overrides, per_rank):
    ranks = _rank_batches(overrides, world_size=2)
    for step in range(3):
        first, second = ranks[0][step], ranks[1][step]
        assert len(first) == len(second) == per_rank
        assert not set(first.tolist()) & set(second.tolist())


@pytest.mark.shared_data
@pytest.mark.slow
def test_two_processes_with_a_per_process_batch_train_twice_the_images_per_step(tiny_prepared, tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "models.cli", "train",
        "--no-progress", "--set", f"data={tiny_prepared.path}", "--set", f"out_dir={tmp_path}",
        "--set", "name=ddp", "--set", "network=sphereface4", "--set", "batch_size=4",
        "--set", "batch_scope=process", "--set", "steps=2", "--set", "log_every=1", "--set", 'lfw=""',
        "--set", "threads=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes x batch 4" in done.stderr
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["batch_size"] == 8
    assert summary["epochs"] == pytest.approx(2 * 8 / summary["num_images"])
    checksums = summary["rank_weight_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]

