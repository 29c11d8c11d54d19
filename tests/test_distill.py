"""Distillation (training.distill): the loss, the teacher on ONNX Runtime, and a real training run."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from models.registry import PACKAGE_MODELS_DIR
from tests.test_training import _smoke_overrides
from training.config import ConfigError, load_config
from training.distill import TeacherEmbedder, similarity_distillation_loss

TEACHER = PACKAGE_MODELS_DIR / "sphereface_celeba"


def test_the_loss_compares_pairwise_cosines_whatever_the_feature_sizes():
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 8, generator=generator)
    # Rotated into a larger space and rescaled per row: the same cosines, so no loss.
    rotation, _ = torch.linalg.qr(torch.randn(12, 12, generator=generator))
    student = torch.cat([teacher, torch.zeros(6, 4)], dim=1) @ rotation * torch.arange(1, 7)[:, None]
    assert similarity_distillation_loss(student, teacher).item() == pytest.approx(0.0, abs=1e-10)
    # By hand for two unit vectors: one pair (twice, off the diagonal), cosines 0 and 1.
    two = similarity_distillation_loss(
        torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    )
    assert two.item() == pytest.approx(1.0)
    # The gradient reaches the student.
    moved = student.clone().requires_grad_(True)
    similarity_distillation_loss(moved, torch.randn(6, 8, generator=generator)).backward()
    assert moved.grad is not None and moved.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="6 student features but 5 teacher"):
        similarity_distillation_loss(student, teacher[:5])


def test_the_teacher_runs_the_model_folder_on_the_trainers_input(default_model_dir):
    from models.runtime import create_session

    crops = np.random.default_rng(0).uniform(-1, 1, (4, 3, 112, 96)).astype(np.float32)
    teacher = TeacherEmbedder(TEACHER, torch.device("cpu"), threads=1)
    features = teacher(torch.from_numpy(crops))
    raw = create_session(TEACHER / "model.onnx", "cpu").run(None, {"input": crops})[0]
    np.testing.assert_allclose(features.numpy(), raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="takes a different crop"):
        TeacherEmbedder(default_model_dir, torch.device("cpu"))


def test_a_config_needs_both_a_teacher_and_a_weight():
    with pytest.raises(ConfigError, match="distill_from"):
        load_config(None, ["distill_weight=10.0"])
    with pytest.raises(ConfigError, match="distill_weight > 0"):
        load_config(None, ['distill_from="sphereface_celeba"'])
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(None, ['distill_from="sphereface_celeba"', "distill_weight=-1.0"])


def _teacher_gap(run_dir, crops: torch.Tensor, teacher: TeacherEmbedder) -> float:
    from models.nets import build_network
    from training.trainer import load_checkpoint

    state = load_checkpoint(run_dir / "checkpoint.pt")
    net = build_network(state["network"], state["embedding_size"])
    net.load_state_dict(state["net"])
    with torch.no_grad():
        return similarity_distillation_loss(net.eval()(crops), teacher(crops)).item()


@pytest.mark.shared_data
def test_distillation_brings_the_students_cosines_to_the_teachers(tiny_prepared, tmp_path):
    from training.augment import to_network_input
    from training.prepare import load_training_set
    from training.trainer import train

    prepared = tiny_prepared
    common = [
        *_smoke_overrides(prepared, tmp_path, "plain"),
        "head=asoftmax",
        "steps=12",
        "lr=0.01",
        "network=mobilefacenet",
    ]
    plain = train(load_config(None, common), progress=False)
    taught = train(
        load_config(
            None, [*common, "name=taught", f"distill_from={json.dumps(str(TEACHER))}", "distill_weight=100.0"]
        ),
        progress=False,
    )
    with (taught.run_dir / "log.csv").open() as handle:
        gaps = [float(row["distill"]) for row in csv.DictReader(handle)]
    assert len(gaps) == 12 and all(np.isfinite(gaps)) and min(gaps) > 0

    images = np.concatenate(
        [np.asarray(shard) for shard, _ in load_training_set([str(prepared.path)], 1).shards]
    )
    crops = to_network_input(torch.from_numpy(images), None)
    teacher = TeacherEmbedder(TEACHER, torch.device("cpu"), threads=1)
    # The same seed, data and steps: only the distillation term differs between the two runs.
    taught_gap, plain_gap = (
        _teacher_gap(taught.run_dir, crops, teacher),
        _teacher_gap(plain.run_dir, crops, teacher),
    )
    assert taught_gap < 0.8 * plain_gap, (taught_gap, plain_gap)
