"""`sphereface combine`: several real models as one ONNX graph on ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models.registry import PACKAGE_MODELS_DIR

PROJECT_MODEL = PACKAGE_MODELS_DIR / "sphereface_celeba"


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _run(model_dir: Path, crops: np.ndarray) -> np.ndarray:
    from models.runtime import create_session

    return create_session(model_dir / "model.onnx", "cpu").run(None, {"input": crops})[0]


@pytest.fixture(scope="module")
def aligned_crops(photos_dir: Path) -> np.ndarray:
    """Real faces, detected and aligned as the service does, in the 112x96 models' input form."""
    from models.align import align_face, get_template
    from models.image import read_image
    from models.mtcnn import MTCNNDetector

    detector = MTCNNDetector()
    template = get_template("sphereface_112x96")
    crops = []
    for path in sorted((photos_dir / "people").glob("*/1.jpg"))[:6]:
        image = read_image(path)
        faces = detector.detect(image)
        if faces:
            crops.append(align_face(image, faces[0].landmarks, template))
    assert len(crops) >= 4, f"too few faces found in {photos_dir}"
    pixels = np.stack(crops).astype(np.float32).transpose(0, 3, 1, 2)
    return (pixels - 127.5) / 128.0


def test_ensemble_cosine_is_the_mean_of_its_parts_cosines(
    aligned_crops: np.ndarray, reference_model_dir: Path, tmp_path: Path
) -> None:
    from models.ensemble import EnsembleError, combine_models
    from models.manifest import load_manifest

    parts = [PROJECT_MODEL, reference_model_dir]
    with pytest.raises(EnsembleError, match="different licences"):
        combine_models(parts, tmp_path / "pair", name="pair", version="1")
    manifest, diff = combine_models(
        parts, tmp_path / "pair", name="pair", version="1", licence="research only"
    )
    assert manifest.licence == "research only"
    assert diff < 1e-5
    first, second = load_manifest(PROJECT_MODEL), load_manifest(reference_model_dir)
    assert manifest.embedding_size == first.embedding_size + second.embedding_size
    assert load_manifest(tmp_path / "pair").model_id == "pair@1"

    combined = _run(tmp_path / "pair", aligned_crops)
    np.testing.assert_allclose(np.linalg.norm(combined, axis=1), 1.0, atol=1e-5)
    cos_first = _unit(_run(PROJECT_MODEL, aligned_crops)) @ _unit(_run(PROJECT_MODEL, aligned_crops)).T
    reference = _unit(_run(reference_model_dir, aligned_crops))
    cos_second = reference @ reference.T
    assert np.abs(cos_first - cos_second).max() > 0.05, "the two networks should disagree somewhere"
    np.testing.assert_allclose(combined @ combined.T, (cos_first + cos_second) / 2, atol=1e-5)


def test_served_ensemble_scores_the_mean_cosine_over_parts_and_mirrors(
    aligned_crops: np.ndarray, tmp_path: Path
) -> None:
    """Through the service's Embedder (flip fusion "concat"), a model combined with itself scores a
    pair as the mean of the model's cosine on the crops and on their mirrors."""
    from models.embedder import Embedder
    from models.ensemble import combine_models

    combine_models([PROJECT_MODEL, PROJECT_MODEL], tmp_path / "twice", name="twice", version="1")
    crops = (aligned_crops * 128.0 + 127.5).round().clip(0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    alone = Embedder(PROJECT_MODEL, "cpu")
    crop_views, mirror_views = _unit(alone.raw(crops)), _unit(alone.raw(crops[:, :, ::-1]))
    expected = (crop_views @ crop_views.T + mirror_views @ mirror_views.T) / 2
    twice = Embedder(tmp_path / "twice", "cpu").embed(crops)
    assert twice.shape[1] == 4 * alone.manifest.embedding_size
    np.testing.assert_allclose(twice @ twice.T, expected, atol=1e-5)


def test_models_that_take_different_crops_are_refused(default_model_dir: Path, tmp_path: Path) -> None:
    from models.ensemble import EnsembleError, combine_models

    with pytest.raises(EnsembleError, match="template") as caught:
        combine_models([PROJECT_MODEL, default_model_dir], tmp_path / "bad", name="bad", version="1")
    assert caught.value.code == "ensemble_mismatch"
    assert not (tmp_path / "bad" / "model.onnx").exists()
    with pytest.raises(EnsembleError, match="at least 2"):
        combine_models([PROJECT_MODEL], tmp_path / "one", name="one", version="1")


def test_combine_command_writes_a_model_the_registry_serves(tmp_path: Path, capsys) -> None:
    from models.cli import main
    from models.registry import resolve_model

    out = tmp_path / "pair"
    assert (
        main(
            [
                "combine",
                "sphereface_celeba",
                str(PROJECT_MODEL),
                "--out",
                str(out),
                "--name",
                "p",
                "--version",
                "2",
            ]
        )
        == 0
    )
    assert "p@2, 512-d" in capsys.readouterr().out
    assert resolve_model(str(out)) == out
    assert (
        main(["combine", "sphereface_celeba", str(out), "--out", str(out), "--name", "p", "--version", "3"])
        == 2
    )
    assert "one of the models combined" in capsys.readouterr().err
