"""`sphereface quantize`: an int8 copy of the default model, calibrated on real faces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.embedder import Embedder
from models.manifest import load_manifest
from models.quantize import calibration_crops, quantize_model

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


def test_int8_copy_embeds_like_the_float_model_under_a_new_name(default_model_dir, photos_dir, tmp_path):
    pytest.importorskip("onnx")
    photos = sorted((photos_dir / "people").glob("*/*.jpg"))
    calibration = calibration_crops(default_model_dir, photos[::2], 12)
    held_out = calibration_crops(default_model_dir, photos[1::2], 12)
    out = quantize_model(default_model_dir, tmp_path / "int8", calibration)
    float_manifest, int8_manifest = load_manifest(default_model_dir), load_manifest(out)
    assert int8_manifest.model_id == f"{float_manifest.name}_int8@{float_manifest.version}"
    assert int8_manifest.thresholds == {} and int8_manifest.lfw == {}  # measured, not copied
    assert "quantised to int8" in int8_manifest.source
    assert int8_manifest.embedding_config() == float_manifest.embedding_config()  # same crops and pixels
    # int8 weights: a quarter of the float file, give or take the graph
    assert (out / "model.onnx").stat().st_size < 0.4 * (default_model_dir / "model.onnx").stat().st_size
    a = Embedder(default_model_dir, intra_op_threads=1).embed(held_out)
    b = Embedder(out, intra_op_threads=1).embed(held_out)
    cosines = np.sum(a * b, axis=1)
    assert cosines.min() > 0.98, cosines
    assert cosines.max() < 1 - 1e-7  # really another network
    assert json.loads((out / "manifest.json").read_text())["name"].endswith("_int8")
