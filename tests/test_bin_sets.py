"""insightface .bin verification sets: the safe reader, the writer, insightface's scoring, and LFW as
a .bin against `evaluate lfw`."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from training.evaluation.bin_eval import score_pairs
from training.evaluation.bin_sets import decode_face, encode_face, lfw_bin, read_bin, write_bin
from training.evaluation.errors import VerificationSetError
from training.evaluation.verification import contiguous_folds, insightface_10fold_accuracy

#: A Python 2 protocol-2 pickle of (['ab', ''], [True, False]): byte strings as SHORT_BINSTRING.
PY2_PROTOCOL_2 = b"\x80\x02]q\x00(U\x02abq\x01U\x00q\x02e]q\x03(\x88\x89e\x86q\x04."
#: The same in Python 2's text protocol 0 (bools as I01 / I00).
PY2_PROTOCOL_0 = b"((lp0\nS'ab'\np1\naS''\np2\na(lp3\nI01\naI00\natp4\n."


def _faces(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [encode_face(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)) for _ in range(n)]


def _labels(n_pairs: int) -> list[bool]:
    return [i % 2 == 0 for i in range(n_pairs)]


# --- the format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_write_then_read_keeps_the_pairs_in_order(tmp_path: Path, protocol: int):
    images, same = _faces(24), _labels(12)
    path = write_bin(tmp_path / "set.bin", images, same, protocol=protocol)
    loaded = read_bin(path)
    assert loaded.name == "set" and len(loaded) == 12
    assert loaded.images == images
    np.testing.assert_array_equal(loaded.is_same, same)


@pytest.mark.parametrize("payload", [PY2_PROTOCOL_2, PY2_PROTOCOL_0])
def test_python2_pickles_read_their_byte_strings_as_bytes(tmp_path: Path, payload: bytes):
    from training.evaluation.bin_sets import _checked, _SetUnpickler

    loaded = _SetUnpickler(io.BytesIO(payload), encoding="bytes").load()
    assert loaded == ([b"ab", b""], [True, False])
    with pytest.raises(VerificationSetError, match="2 pairs need 4 images"):
        _checked(tmp_path / "tiny.bin", loaded)


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_pickle_that_names_a_callable_is_refused_before_it_runs(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([_RunsACommand()], [True]), protocol=2))
    with pytest.raises(VerificationSetError, match=r"names (posix|os|nt)\.system"):
        read_bin(path)
    assert not (tmp_path / "pwned").exists()


def test_bytes_with_an_argument_is_refused_rather_than_allocated(tmp_path: Path):
    # bytes(10**12) would ask for a terabyte
    path = tmp_path / "bomb.bin"
    path.write_bytes(b"\x80\x02c__builtin__\nbytes\nq\x00\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85R.")
    with pytest.raises(VerificationSetError, match="only without arguments"):
        read_bin(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (([b"a"] * 20,), "expected the pair"),
        (({"images": []}, [True]), "images must be a list"),
        (([b"a"] * 19 + ["text"], _labels(10)), r"images\[19\] is a str, not encoded image bytes"),
        (([b"a"] * 20, [1] * 10), r"issame\[0\] is a int, not a bool"),
        (([b"a"] * 21, _labels(10)), "10 pairs need 20 images"),
        (([b"a"] * 20, [True] * 10), "10 same and 0 different"),
    ],
)
def test_anything_but_the_expected_structure_is_refused(tmp_path: Path, content, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(pickle.dumps(content, protocol=4))
    with pytest.raises(VerificationSetError, match=message):
        read_bin(path)


def test_a_numpy_issame_list_is_refused_by_name(tmp_path: Path):
    path = tmp_path / "numpy.bin"
    path.write_bytes(pickle.dumps((_faces(20), np.array(_labels(10))), protocol=4))
    with pytest.raises(VerificationSetError, match=r"names numpy\."):
        read_bin(path)


def test_missing_and_truncated_files_are_clear_errors(tmp_path: Path):
    with pytest.raises(VerificationSetError, match="cannot read"):
        read_bin(tmp_path / "none.bin")
    whole = pickle.dumps((_faces(20), _labels(10)), protocol=4)
    (tmp_path / "cut.bin").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(VerificationSetError, match="is not an insightface verification set"):
        read_bin(tmp_path / "cut.bin")


def test_faces_must_decode_to_112x112(tmp_path: Path):
    buffer = io.BytesIO()
    Image.new("RGB", (96, 112)).save(buffer, "PNG")
    with pytest.raises(VerificationSetError, match="set.bin: image 3 is 96x112"):
        decode_face(buffer.getvalue(), 3, "set.bin")
    with pytest.raises(VerificationSetError, match="image 0 cannot be decoded"):
        decode_face(b"not an image", 0, "set.bin")
    face = decode_face(_faces(1)[0], 0, "set.bin")
    assert face.shape == (112, 112, 3) and face.dtype == np.uint8


# --- insightface's scoring ----------------------------------------------------------------------


def _literal_insightface_accuracy(left: np.ndarray, right: np.ndarray, same: np.ndarray) -> np.ndarray:
    """insightface's calculate_roc with 10 unshuffled folds, written out loop by loop."""
    left = left / np.linalg.norm(left, axis=1, keepdims=True)
    right = right / np.linalg.norm(right, axis=1, keepdims=True)
    dist = np.sum((left - right) ** 2, axis=1)
    thresholds = np.arange(0, 4, 0.01)
    bounds = np.cumsum([0] + [len(same) // 10 + (k < len(same) % 10) for k in range(10)])
    accuracies = []
    for k in range(10):
        test = np.zeros(len(same), bool)
        test[bounds[k] : bounds[k + 1]] = True

        def accuracy(t: float, mask: np.ndarray) -> float:
            predicted = dist[mask] < t
            return float(np.mean(predicted == same[mask]))

        best = int(np.argmax([accuracy(t, ~test) for t in thresholds]))
        accuracies.append(accuracy(thresholds[best], test))
    return np.array(accuracies)


def test_insightface_accuracy_matches_a_literal_implementation_of_its_loop():
    rng = np.random.default_rng(3)
    n = 437  # folds of 44 and 43 pairs
    same = rng.random(n) < 0.5
    left = rng.normal(size=(n, 16))
    right = np.where(same[:, None], left + rng.normal(scale=1.1, size=(n, 16)), rng.normal(size=(n, 16)))
    result = insightface_10fold_accuracy(left, right, same, contiguous_folds(n))
    literal = _literal_insightface_accuracy(left, right, same)
    np.testing.assert_allclose(result.fold_accuracies, literal)
    assert result.accuracy == pytest.approx(literal.mean())
    assert 0.6 < result.accuracy < 0.99  # neither trivial nor hopeless
    # thresholds are minus grid distances (multiples of 0.01 in [0, 4))
    assert all(-4 < t <= 0 and abs(t * 100 - round(t * 100)) < 1e-9 for t in result.fold_thresholds)


def test_contiguous_folds_are_scikit_learns_unshuffled_kfold():
    folds = contiguous_folds(23, 10)
    np.testing.assert_array_equal(np.bincount(folds), [3, 3, 3, 2, 2, 2, 2, 2, 2, 2])
    assert (np.diff(folds) >= 0).all()
    np.testing.assert_array_equal(contiguous_folds(6000), np.repeat(np.arange(10), 600))
    with pytest.raises(ValueError):
        contiguous_folds(5, 10)


def test_score_pairs_uses_the_fused_cosine_and_the_flip_sum():
    # pair i = rows 2i, 2i+1. The fused features (what the service compares) separate the pairs
    # perfectly; the flip-summed ones (insightface's) are noise. Each score must read its own.
    rng = np.random.default_rng(5)
    n = 200
    same = np.arange(n) % 2 == 0
    fused = rng.normal(size=(2 * n, 8))
    fused[1::2][same] = fused[0::2][same] + 0.01 * rng.normal(size=(same.sum(), 8))
    summed = rng.normal(size=(2 * n, 8))
    scores = score_pairs(fused, summed, same)
    assert scores.cosine.accuracy == 1.0 and scores.sphereface.accuracy == 1.0
    assert scores.insightface.accuracy < 0.8
    assert scores.roc_cosine.auc == 1.0 and scores.roc_insightface.auc < 0.8
    assert scores.roc_cosine.tar_at_far["1e-02"] == 1.0
    assert scores.roc_cosine.tar_at_far["1e-03"] is None  # 100 different pairs cannot measure 1e-3


# --- LFW as a .bin against `evaluate lfw` -------------------------------------------------------


@pytest.mark.shared_data
def test_lfw_as_a_bin_scores_as_evaluate_lfw_on_the_same_model(lfw_dir, reference_model_dir, tmp_path):
    """LFW's first 10 pairs of each fold (100 pairs), aligned onto the ArcFace template with
    landmarks.txt and JPEG-encoded, against `evaluate lfw --landmarks file` on the same pairs: the
    same folds, nearly the same scores (the crops differ by the JPEG coding alone)."""
    from models.cli import main
    from training.evaluation.lfw import run_lfw_evaluation
    from training.evaluation.lfw_files import pair_features, read_pairs

    lfw_set = lfw_bin(lfw_dir, 10)
    path = write_bin(tmp_path / "lfw.bin", lfw_set.images, lfw_set.is_same, protocol=2)
    pairs = read_pairs(lfw_dir / "pairs.txt").subset(10)
    np.testing.assert_array_equal(lfw_set.is_same, pairs.is_same)
    np.testing.assert_array_equal(contiguous_folds(len(pairs)), pairs.fold)

    assert main(["evaluate", "bin", str(path), "--model", str(reference_model_dir), "--json",
                 str(tmp_path / "bin.json"), "--no-progress"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "bin.json").read_text())
    assert report["template"] == "sphereface_112x96" and report["padding_share"] == 0.0
    (entry,) = report["sets"]
    assert entry["name"] == "lfw" and entry["n_pairs"] == 100
    lfw = run_lfw_evaluation(reference_model_dir, lfw_dir, "file", pairs_per_fold=10, progress=False)
    assert entry["cosine_protocol"]["accuracy"] == pytest.approx(lfw.cosine.accuracy, abs=0.021)
    assert entry["sphereface_protocol"]["accuracy"] == pytest.approx(lfw.accuracy, abs=0.021)
    assert entry["insightface_protocol"]["accuracy"] > 0.9

    # the pair scores themselves: the .bin's cosines against evaluate lfw's
    from models.embedder import Embedder
    from training.evaluation.bin_eval import embed_bin

    features = embed_bin(Embedder(reference_model_dir), read_bin(path), workers=1)
    left, right = pair_features(lfw.features, lfw.names, pairs)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    expected = np.sum(unit(left) * unit(right), axis=1)
    got = np.sum(unit(features.fused[0::2]) * unit(features.fused[1::2]), axis=1)
    assert np.abs(got - expected).max() < 0.05 and np.abs(got - expected).mean() < 0.01
