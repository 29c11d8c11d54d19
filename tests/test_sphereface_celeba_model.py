"""The project-trained model that ships in models/sphereface_celeba: complete, small, calibrated, and
what it claims; and the model names (`--model default`, `sphereface models`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.errors import ModelFolderError
from models.manifest import load_manifest
from models.registry import DEFAULT_MODEL_NAME, PACKAGE_MODELS_DIR, describe_model, list_models, resolve_model
from service.settings import Settings
from tests.conftest import REPO_ROOT

CELEBA = PACKAGE_MODELS_DIR / "sphereface_celeba"
#: The runs `make sphereface-celeba-model` trains and combines, each with its config in
#: training/configs/celeba_more/.
PARTS = ("mobilefacenet_m4", "mobilefacenet_m4_colour")


def test_default_resolves_to_the_dlib_model_everywhere(default_model_dir):
    assert DEFAULT_MODEL_NAME == "dlib_resnet_v1"
    assert (
        resolve_model("default")
        == resolve_model(None)
        == resolve_model("dlib_resnet_v1")
        == default_model_dir
    )
    assert Settings().model_dir == default_model_dir
    assert Settings(model="sphereface_celeba").model_dir == CELEBA
    assert resolve_model(str(CELEBA)) == CELEBA  # a folder is taken as it is


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelFolderError, match="known names: default, .*sphereface_celeba"):
        resolve_model("no_such_model")
    with pytest.raises(ModelFolderError, match="not found"):
        resolve_model("./no/such/folder")


def test_a_named_model_without_weights_says_how_to_get_them(tmp_path, monkeypatch):
    folder = tmp_path / "dlib_resnet_v1"
    folder.mkdir()
    (folder / "manifest.json").write_text(
        (PACKAGE_MODELS_DIR / "dlib_resnet_v1" / "manifest.json").read_text()
    )
    monkeypatch.setenv("SPHEREFACE_MODEL_PATH", str(tmp_path))
    with pytest.raises(ModelFolderError, match="has no weights yet: run `make install`"):
        resolve_model("default")
    (entry,) = [e for e in list_models() if e.name == "dlib_resnet_v1"]
    assert not entry.has_weights and "make install" in describe_model(entry)["status"]


def test_sphereface_models_lists_licence_data_lfw_and_thresholds(default_model_dir):
    described = {e.name: describe_model(e) for e in list_models()}
    assert {"dlib_resnet_v1", "sphereface_celeba"} <= set(described)
    dlib = described["dlib_resnet_v1"]
    assert dlib["status"] == "ready" and "CC0" in dlib["licence"]
    assert "verification" in dlib["thresholds"] and "identification" in dlib["thresholds"]
    assert "lfw-all-pairs" in dlib["calibrated_on"] and "%" in dlib["lfw"]
    assert "research" in described["sphereface_celeba"]["licence"].lower()


def test_sphereface_celeba_folder_is_complete_and_under_10_mb():
    manifest = load_manifest(CELEBA)
    total = sum(p.stat().st_size for p in CELEBA.rglob("*") if p.is_file())
    assert (CELEBA / "model.onnx").stat().st_size <= 10 * 2**20
    assert total <= 10 * 2**20, f"models/sphereface_celeba holds {total / 2**20:.1f} MB"
    assert (CELEBA / "MODEL_CARD.md").is_file()
    assert "research" in manifest.licence.lower()
    assert "celeba" in manifest.training_data.lower()
    # Version 4 is two networks in one graph: the card and the manifest say so, and each part's
    # training record ships beside it.
    assert manifest.architecture == "ensemble of mobilefacenet + mobilefacenet"
    assert manifest.embedding_size == 256
    for part in PARTS:
        assert {"config.toml", "log.csv", "curves.png", "summary.json"} <= {
            p.name for p in (CELEBA / "parts" / part).iterdir()
        }, part


@pytest.mark.parametrize("folder", [CELEBA, PACKAGE_MODELS_DIR / "dlib_resnet_v1"])
def test_models_carry_both_thresholds_calibrated_on_every_pair_of_lfw(folder):
    from models.manifest import load_manifest_data

    manifest = load_manifest_data(folder)
    verification, identification = manifest.thresholds["verification"], manifest.thresholds["identification"]
    assert verification.far == pytest.approx(1e-3) and identification.far == pytest.approx(1e-4)
    # A lower false-accept rate needs a stricter (higher) cosine threshold.
    assert -1.0 < verification.value < identification.value < 1.0
    calibration = json.loads((folder / "calibration.json").read_text())
    assert calibration["set"] == manifest.calibration["set"] == "lfw-all-pairs"
    assert calibration["fars"]["1e-03"]["threshold"] == pytest.approx(verification.value)
    assert calibration["fars"]["1e-04"]["threshold"] == pytest.approx(identification.value)
    assert (
        calibration["n_impostor"] > 80_000_000
        and manifest.calibration["n_impostor"] == calibration["n_impostor"]
    )
    # The threshold held on people it was not chosen on: the held-out FAR is within 2x of the target.
    assert 0.5e-3 < calibration["fars"]["1e-03"]["heldout_far"] < 2e-3


@pytest.mark.shared_data
@pytest.mark.slow
def test_sphereface_celeba_reproduces_its_recorded_lfw_accuracy(lfw_dir):
    from training.evaluation.lfw import run_lfw_evaluation

    recorded = json.loads((CELEBA / "lfw.json").read_text())
    result = run_lfw_evaluation(CELEBA, lfw_dir, landmarks=recorded["landmarks"], progress=False)
    assert result.accuracy == pytest.approx(recorded["accuracy"], abs=5e-4)
    assert load_manifest(CELEBA).lfw["accuracy"] == pytest.approx(recorded["accuracy"])
    # The fused embeddings the service stores are unit vectors of twice the network's width.
    assert result.features.shape[1] == 2 * load_manifest(CELEBA).embedding_size
    assert np.isfinite(result.features).all()


@pytest.mark.parametrize("part", PARTS)
def test_the_make_target_trains_exactly_the_shipped_models_configs(part):
    from dataclasses import asdict

    from training.config import load_config

    # `make sphereface-celeba-model` trains these configs (one thread each, side by side); the
    # shipped config.toml is the resolved config each part was trained with. Version 2 was trained
    # at lr 0.1 while the file inherited 0.025: a field that differs here is a model the make
    # target does not reproduce. Only the thread count may differ.
    shipped = asdict(load_config(CELEBA / "parts" / part / "config.toml"))
    recipe = asdict(load_config(REPO_ROOT / "training" / "configs" / "celeba_more" / f"{part}.toml"))
    differing = {
        k: (shipped.get(k), recipe[k])
        for k in recipe
        if k != "threads" and shipped.get(k, recipe[k]) != recipe[k]
    }
    assert not differing, f"shipped config vs {part}.toml: {differing}"
    assert f"train: {part}," in load_manifest(CELEBA).source
    makefile = (REPO_ROOT / "Makefile").read_text()
    (listed,) = [
        line.split(":=")[1].split() for line in makefile.splitlines() if line.startswith("CELEBA_PARTS")
    ]
    assert tuple(listed) == PARTS
