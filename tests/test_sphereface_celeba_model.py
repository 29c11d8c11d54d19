"""The default model that ships in models/default: complete, small, calibrated, and what it claims."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.manifest import load_manifest
from service.settings import DEFAULT_MODEL_DIR, Settings

DEFAULT = Path(__file__).resolve().parent.parent / "models" / "default"


def test_serve_uses_the_shipped_default_model():
    assert DEFAULT_MODEL_DIR == DEFAULT
    assert Settings().model_dir == DEFAULT


def test_default_model_folder_is_complete_and_under_10_mb():
    manifest = load_manifest(DEFAULT)
    total = sum(p.stat().st_size for p in DEFAULT.iterdir() if p.is_file())
    assert (DEFAULT / "model.onnx").stat().st_size <= 10 * 2**20
    assert total <= 10 * 2**20, f"models/default holds {total / 2**20:.1f} MB"
    assert (DEFAULT / "MODEL_CARD.md").is_file()
    assert "research" in manifest.licence.lower()
    assert "celeba" in manifest.training_data.lower()


def test_default_model_carries_thresholds_calibrated_at_stated_false_accept_rates():
    manifest = load_manifest(DEFAULT)
    verification, identification = manifest.thresholds["verification"], manifest.thresholds["identification"]
    assert verification.far == pytest.approx(1e-3) and identification.far == pytest.approx(1e-4)
    # A lower false-accept rate needs a stricter (higher) cosine threshold.
    assert -1.0 < verification.value < identification.value < 1.0
    calibration = json.loads((DEFAULT / "calibration.json").read_text())
    assert calibration["far_1e-03"]["threshold"] == pytest.approx(verification.value)
    assert calibration["n_impostor"] > 1_000_000


@pytest.mark.shared_data
@pytest.mark.slow
def test_default_model_reproduces_its_recorded_lfw_accuracy(lfw_dir):
    from training.lfw import run_lfw_evaluation

    recorded = json.loads((DEFAULT / "lfw.json").read_text())
    result = run_lfw_evaluation(DEFAULT, lfw_dir, landmarks=recorded["landmarks"], progress=False)
    assert result.accuracy == pytest.approx(recorded["accuracy"], abs=5e-4)
    assert load_manifest(DEFAULT).lfw["accuracy"] == pytest.approx(recorded["accuracy"])
    # The fused embeddings the service stores are unit vectors of twice the network's width.
    assert result.features.shape[1] == 2 * load_manifest(DEFAULT).embedding_size
    assert np.isfinite(result.features).all()
