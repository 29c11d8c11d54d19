"""Importing the reference MobileFaceNet checkpoint: PyTorch definition, ONNX export, manifest.

Uses the real checkpoint and real LFW photos from ../shared/data (fixtures in conftest.py).
"""

from __future__ import annotations

from itertools import combinations, islice
from pathlib import Path

import numpy as np
import pytest

from models.align import align_faces
from models.embedder import Embedder, preprocess
from models.errors import ModelFolderError
from models.image import read_image
from models.manifest import MODEL_NAME, load_manifest

torch = pytest.importorskip("torch")

from models.importers import import_mobilefacenet  # noqa: E402  (needs torch)
from models.nets.mobilefacenet import MobileFaceNet  # noqa: E402
from models.onnx_export import OnnxParityError, check_onnx_parity, export_onnx  # noqa: E402

#: The first lines of lfw/landmarks.txt: Aaron_Peirsol (4 photos) and Aaron_Sorkin (2 photos)
#: give genuine pairs, everyone else impostors.
N_LFW_FACES = 10


def _load_state_dict(checkpoint: Path) -> dict:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["net_state_dict"]


@pytest.fixture(scope="module")
def torch_net(mobilefacenet_checkpoint: Path) -> MobileFaceNet:
    net = MobileFaceNet()
    net.load_state_dict(_load_state_dict(mobilefacenet_checkpoint), strict=True)
    return net.eval()


@pytest.fixture(scope="module")
def lfw_faces(lfw_dir: Path) -> tuple[list[str], np.ndarray]:
    """Person names and SphereFace-aligned ``(N, 112, 96, 3)`` crops of the first LFW photos."""
    names, crops = [], []
    with open(lfw_dir / "landmarks.txt") as f:
        for line in islice(f, N_LFW_FACES):
            fields = line.split()
            points = np.asarray(fields[1:], dtype=np.float64).reshape(5, 2)
            image = read_image(lfw_dir / "images" / fields[0])
            crops.append(align_faces(image, points)[0])
            names.append(fields[0].split("/")[0])
    return names, np.stack(crops)


@pytest.fixture(scope="module")
def embedder(reference_model_dir: Path) -> Embedder:
    return Embedder(reference_model_dir)


@pytest.mark.shared_data
def test_checkpoint_loads_strictly_into_our_definition(mobilefacenet_checkpoint: Path) -> None:
    net = MobileFaceNet()
    result = net.load_state_dict(_load_state_dict(mobilefacenet_checkpoint), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert sum(p.numel() for p in net.parameters()) == 999_552  # "about 1.0M parameters"
    with torch.no_grad():
        out = net.eval()(torch.zeros(2, 3, 112, 96))
    assert out.shape == (2, 128)


@pytest.mark.shared_data
@pytest.mark.parametrize("batch", [1, 5])
def test_onnx_embeddings_match_pytorch_on_aligned_lfw_crops(
    batch: int, embedder: Embedder, torch_net: MobileFaceNet, lfw_faces: tuple[list[str], np.ndarray]
) -> None:
    crops = lfw_faces[1][:batch]
    onnx_out = embedder.raw(crops)
    with torch.no_grad():
        torch_out = torch_net(torch.from_numpy(preprocess(crops, embedder.manifest))).numpy()
    assert onnx_out.shape == torch_out.shape == (batch, 128)
    assert np.max(np.abs(onnx_out - torch_out)) < 1e-4


@pytest.mark.shared_data
def test_exported_model_has_named_io_and_a_dynamic_batch(
    reference_model_dir: Path, embedder: Embedder, torch_net: MobileFaceNet
) -> None:
    (inp,), (out,) = embedder.session.get_inputs(), embedder.session.get_outputs()
    assert (inp.name, out.name) == ("input", "embedding")
    assert isinstance(inp.shape[0], str) and inp.shape[1:] == [3, 112, 96]
    diff = check_onnx_parity(torch_net, reference_model_dir / MODEL_NAME, batch_sizes=(1, 7))
    assert diff < 1e-4


@pytest.mark.shared_data
def test_written_manifest_says_128d_fused_by_concat_into_256(
    reference_model_dir: Path, embedder: Embedder, lfw_faces: tuple[list[str], np.ndarray]
) -> None:
    manifest = load_manifest(reference_model_dir)
    assert manifest.model_id == "mobilefacenet_casia@068"
    assert (manifest.architecture, manifest.embedding_size) == ("mobilefacenet", 128)
    assert (manifest.flip_fusion, manifest.output_size) == ("concat", 256)
    assert (manifest.input_height, manifest.input_width, manifest.template) == (112, 96, "sphereface_112x96")
    assert (manifest.color_order, manifest.pixel_mean, manifest.pixel_std) == ("RGB", 127.5, 128.0)
    assert "CASIA-WebFace" in manifest.training_data and "Xiaoccer" in manifest.training_data
    assert "research" in manifest.licence.lower()
    assert manifest.source.endswith("068.ckpt")
    vectors = embedder.embed(lfw_faces[1][:2])
    assert vectors.shape == (2, 256)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.shared_data
def test_genuine_lfw_pairs_score_higher_than_impostor_pairs(
    embedder: Embedder, lfw_faces: tuple[list[str], np.ndarray]
) -> None:
    names, crops = lfw_faces
    vectors = embedder.embed(crops)
    scores = vectors @ vectors.T
    peirsol = [i for i, n in enumerate(names) if n == "Aaron_Peirsol"]
    other = names.index("Aaron_Eckhart")
    assert scores[peirsol[0], peirsol[1]] > scores[peirsol[0], other]
    # Over every pair of the first photos, the least similar genuine pair still beats the most
    # similar impostor pair (measured: 0.56 vs 0.24).
    pairs = list(combinations(range(len(names)), 2))
    genuine = [scores[i, j] for i, j in pairs if names[i] == names[j]]
    impostor = [scores[i, j] for i, j in pairs if names[i] != names[j]]
    assert len(genuine) >= 2 and min(genuine) > max(impostor)


def test_missing_checkpoint_gives_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "068.ckpt"
    with pytest.raises(FileNotFoundError, match="checkpoint not found.*068.ckpt"):
        import_mobilefacenet(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_other_tensors_gives_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "other.ckpt"
    torch.save({"epoch": 1, "net_state_dict": {"fc.weight": torch.zeros(2, 2)}}, path)
    with pytest.raises(ModelFolderError, match="does not match the MobileFaceNet layout: 333 missing"):
        import_mobilefacenet(path, tmp_path / "out")
    torch.save({"epoch": 1}, path)
    with pytest.raises(ModelFolderError, match="no 'net_state_dict'"):
        import_mobilefacenet(path, tmp_path / "out")
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelFolderError, match="not a readable PyTorch checkpoint"):
        import_mobilefacenet(path, tmp_path / "out")


def test_parity_check_rejects_a_model_that_drifted_from_its_export(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 4, 8))
    path = export_onnx(net, tmp_path / "tiny.onnx", input_shape=(3, 8, 6))
    assert check_onnx_parity(net, path, batch_sizes=(1, 4)) < 1e-5
    with torch.no_grad():
        net[2].bias.add_(0.01)
    with pytest.raises(OnnxParityError, match="differ by"):
        check_onnx_parity(net, path)
