"""IJB-B/C 1:1 template verification on a synthetic set whose answer is known by construction.

Every face is a flat colour: the stand-in network returns the crop's mean colour minus grey, so a
face's feature is the colour (R - 128, G - 128) chosen for it, an angle in the plane. Templates
are built so that each pair's cosine is known: plain pairs at chosen angles, and templates whose
direction comes out right only if the faces are weighted by faceness, averaged per media and
summed per template (in that order).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from models.align import SPHEREFACE_TEMPLATE_112x96
from training.evaluation.errors import VerificationSetError
from training.evaluation.ijb import (
    embed_ijb_faces,
    load_ijb,
    nearest_point_tar,
    pair_scores,
    score_ijb,
    template_features,
)

RADIUS = 100.0
#: Landmarks of every synthetic face: the SphereFace template at half size inside a 96x96 image,
#: so the whole crop lies on the flat colour.
POINTS = SPHEREFACE_TEMPLATE_112x96.as_array() * 0.5 + 24.0

#: Impostor pairs: 100 cosines from -0.5 to 0.85 (0.0136 apart).
IMPOSTOR = np.linspace(-0.5, 0.85, 100)
#: Genuine plain pairs; with the impostors above, by hand: 4 of these 8 and both special
#: templates' pairs (cosine 1 when aggregated right) beat the highest impostor (0.85), and
#: 7 of 8 + 2 beat the 11th highest (0.7136).
GENUINE = np.array([0.99, 0.96, 0.93, 0.90, 0.80, 0.78, 0.75, 0.30])


class FlatColourNet:
    """Stands in for :class:`models.embedder.Embedder`: a crop's feature is its mean colour minus
    grey (R, G) -- a mirror gives the same, so the flip sum is twice the colour."""

    batch_size = 16
    provider = "test"
    manifest = SimpleNamespace(template="sphereface_112x96", embedding_size=2, model_id="flat@1")

    def raw(self, crops: np.ndarray) -> np.ndarray:
        return crops.astype(np.float64).mean(axis=(1, 2))[:, :2].astype(np.float32) - 128.0


class SetBuilder:
    """Writes a synthetic IJB folder: one flat image per face line."""

    def __init__(self, root: Path, protocol: str = "IJBC") -> None:
        self.root, self.protocol = root, protocol
        self.faces: list[tuple[str, float, float, int, int, float]] = []
        self.pairs: list[tuple[int, int, int]] = []
        self.next_template = 1
        (root / "loose_crop").mkdir(parents=True)
        (root / "meta").mkdir()

    def face(self, angle: float, template: int, media: int, faceness: float = 1.0, radius: float = RADIUS):
        name = f"{len(self.faces)}.png"
        colour = (round(128 + radius * np.cos(angle)), round(128 + radius * np.sin(angle)), 128)
        Image.new("RGB", (96, 96), colour).save(self.root / "loose_crop" / name)
        self.faces.append((name, angle, radius, template, media, faceness))

    def template(self, angle: float) -> int:
        t = self.next_template
        self.next_template += 1
        self.face(angle, t, media=1000 + t)
        return t

    def pair_with_cosine(self, cosine: float, label: int) -> None:
        a = self.template(0.3)
        b = self.template(0.3 + np.arccos(cosine))
        self.pairs.append((a, b, label))

    def write(self) -> None:
        prefix = self.protocol.lower()
        points = " ".join(f"{v:.3f}" for v in POINTS.ravel())
        lines = [f"{n} {points} {s}" for n, _, _, _, _, s in self.faces]
        (self.root / "meta" / f"{prefix}_name_5pts_score.txt").write_text("\n".join(lines) + "\n")
        lines = [f"{n} {t} {m}" for n, _, _, t, m, _ in self.faces]
        (self.root / "meta" / f"{prefix}_face_tid_mid.txt").write_text("\n".join(lines) + "\n")
        lines = [f"{a} {b} {label}" for a, b, label in self.pairs]
        (self.root / "meta" / f"{prefix}_template_pair_label.txt").write_text("\n".join(lines) + "\n")


def _special_templates(builder: SetBuilder) -> None:
    """Two genuine pairs of cosine 1 only when the protocol's aggregation is followed:

    * media: template A = one still at 0 deg + a video of nine frames at 120 deg. Per media then
      summed: 60 deg. Averaging all ten faces instead: 114.2 deg. Its partner: one face at 60 deg.
    * faceness: template B = a face at 20 deg (faceness 1) and one at 140 deg with faceness 0 (in
      another media). Weighted: 20 deg; unweighted: 80 deg. Its partner: one face at 20 deg.

    Aggregated wrongly, either pair's cosine (0.59, 0.5) falls below every threshold of the test.
    """
    a = builder.next_template
    builder.next_template += 1
    builder.face(0.0, a, media=1)
    for _ in range(9):
        builder.face(np.radians(120), a, media=2)
    builder.pairs.append((a, builder.template(np.radians(60)), 1))
    b = builder.next_template
    builder.next_template += 1
    builder.face(np.radians(20), b, media=3, radius=100.0)
    builder.face(np.radians(140), b, media=4, faceness=0.0)
    builder.pairs.append((b, builder.template(np.radians(20)), 1))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ijb") / "IJBC"
    builder = SetBuilder(root)
    for cosine in GENUINE:
        builder.pair_with_cosine(cosine, 1)
    _special_templates(builder)
    for cosine in IMPOSTOR:
        builder.pair_with_cosine(cosine, 0)
    builder.write()
    return root


def test_the_protocol_gives_the_tar_at_each_far_worked_out_by_hand(synthetic: Path, tmp_path: Path):
    meta = load_ijb(synthetic.parent, "IJBC")  # the parent of IJBC/ is found too
    summed = embed_ijb_faces(meta, FlatColourNet(), tmp_path / "cache", {"test": 1})
    report = score_ijb(meta, summed)
    assert report["n_genuine"] == 10 and report["n_impostor"] == 100
    assert report["n_templates"] == 2 * 108 + 4 and report["n_faces"] == 2 * 108 + 11 + 3
    # FAR 1e-1 allows 10 impostors: the threshold is the 11th highest impostor (0.7136) -> 9 of 10
    # FAR 1e-2 allows 1: the 2nd highest (0.8364) -> the 4 plain ones above 0.85 and the 2 special
    assert report["tar_at_far"]["1e-01"] == pytest.approx(0.9)
    assert report["tar_at_far"]["1e-02"] == pytest.approx(0.6)
    assert report["threshold_at_far"]["1e-01"] == pytest.approx(IMPOSTOR[-11], abs=0.01)
    for far in ("1e-03", "1e-04", "1e-05", "1e-06"):  # 100 impostor pairs cannot measure these
        assert report["tar_at_far"][far] is None
        # insightface reads the ROC point nearest the FAR: FAR 0, where 6 genuine beat every impostor
        assert report["tar_at_far_insightface"][far] == pytest.approx(0.6)
    assert report["tar_at_far_insightface"]["1e-01"] == pytest.approx(0.9)


def test_templates_are_weighted_by_faceness_averaged_per_media_and_summed(synthetic: Path, tmp_path: Path):
    meta = load_ijb(synthetic, "IJBC")
    summed = embed_ijb_faces(meta, FlatColourNet(), tmp_path / "cache", {"test": 1})
    ids, features = template_features(summed, meta.faceness, meta.templates, meta.medias)
    for special in meta.first[meta.is_same][-2:]:  # the two special templates' pairs
        (row,) = np.flatnonzero(meta.first == special)
        a, b = np.searchsorted(ids, meta.first[row]), np.searchsorted(ids, meta.second[row])
        assert float(features[a] @ features[b]) == pytest.approx(1.0, abs=1e-3)
    # the same faces averaged over all of a template's faces (no media step): 114.2 deg, not 60
    flat = template_features(summed, meta.faceness, meta.templates, np.zeros_like(meta.medias))[1]
    a = np.searchsorted(ids, meta.first[meta.is_same][-2])
    assert np.degrees(np.arctan2(flat[a, 1], flat[a, 0])) == pytest.approx(114.2, abs=0.5)


def test_template_features_by_hand():
    features = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 4.0], [3.0, 0.0]])
    faceness = np.array([1.0, 0.5, 0.5, 1.0])
    templates = np.array([7, 7, 7, 3])
    medias = np.array([1, 2, 2, 9])
    ids, out = template_features(features, faceness, templates, medias)
    np.testing.assert_array_equal(ids, [3, 7])
    # template 7: media 1 -> (1, 0); media 2 -> mean of (0, 1) and (0, 2) = (0, 1.5); sum (1, 1.5)
    np.testing.assert_allclose(out[1], np.array([1.0, 1.5]) / np.hypot(1.0, 1.5))
    np.testing.assert_allclose(out[0], [1.0, 0.0])


def test_pair_scores_are_the_same_in_chunks():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(6, 4))
    ids = np.array([2, 3, 5, 8, 13, 21])
    first, second = rng.choice(ids, 50), rng.choice(ids, 50)
    whole = pair_scores(ids, features, first, second)
    np.testing.assert_allclose(pair_scores(ids, features, first, second, chunk=7), whole)
    i, j = np.searchsorted(ids, first[0]), np.searchsorted(ids, second[0])
    assert whole[0] == pytest.approx(features[i] @ features[j])


def test_nearest_point_reading_prefers_the_higher_tar_among_equally_near_points():
    far = np.array([0.0, 0.0, 0.01, 0.02])
    tar = np.array([0.0, 0.4, 0.6, 0.9])
    assert nearest_point_tar(far, tar, 1e-6) == 0.4
    assert nearest_point_tar(far, tar, 0.012) == 0.6


def test_features_are_cached_and_a_second_run_embeds_nothing(synthetic: Path, tmp_path: Path):
    meta = load_ijb(synthetic, "IJBC")
    first = embed_ijb_faces(meta, FlatColourNet(), tmp_path / "cache", {"test": 1})

    class Refuses(FlatColourNet):
        def raw(self, crops):
            raise AssertionError("embedded again")

    second = embed_ijb_faces(meta, Refuses(), tmp_path / "cache", {"test": 1})
    np.testing.assert_array_equal(first, second)


def _copy_meta(synthetic: Path, tmp_path: Path) -> Path:
    root = tmp_path / "IJBC"
    (root / "meta").mkdir(parents=True)
    for f in (synthetic / "meta").iterdir():
        (root / "meta" / f.name).write_text(f.read_text())
    return root


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("ijbc_template_pair_label.txt", lambda t: t.replace("\n", "\n1 x 0\n", 1), r"pair_label.txt:2: "),
        ("ijbc_template_pair_label.txt", lambda t: t + "9999 1 1\n", "have no faces.*9999"),
        ("ijbc_template_pair_label.txt", lambda t: t + "1 2 3\n", "labels must be 0 or 1"),
        ("ijbc_face_tid_mid.txt", lambda t: t.replace("1.png", "x.png", 1), r"tid_mid.txt:2 names x.png"),
        (
            "ijbc_name_5pts_score.txt",
            lambda t: t.replace(" 1.0\n", "\n", 1),
            r"5pts_score.txt:1: .*12 fields",
        ),
    ],
)
def test_malformed_meta_files_name_the_file_and_line(synthetic, tmp_path, file, edit, message):
    root = _copy_meta(synthetic, tmp_path)
    path = root / "meta" / file
    path.write_text(edit(path.read_text()))
    with pytest.raises(VerificationSetError, match=message):
        load_ijb(root, "IJBC")


def test_a_folder_without_the_protocols_meta_files_is_a_clear_error(synthetic: Path, tmp_path: Path):
    with pytest.raises(VerificationSetError, match="ijbb_name_5pts_score.txt"):
        load_ijb(synthetic, "IJBB")
    with pytest.raises(VerificationSetError, match="protocol must be one of"):
        load_ijb(synthetic, "IJBA")


@pytest.mark.shared_data
def test_evaluate_ijb_runs_a_real_model_and_writes_the_report(synthetic, reference_model_dir, tmp_path):
    from models.cli import main

    out = tmp_path / "ijb.json"
    assert main(["evaluate", "ijb", "--data", str(synthetic), "--protocol", "IJBC", "--model",
                 str(reference_model_dir), "--cache", str(tmp_path / "cache"), "--json", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert report["benchmark"] == "IJBC 1:1 template verification"
    assert report["n_pairs"] == 110 and set(report["tar_at_far"]) == {
        "1e-06", "1e-05", "1e-04", "1e-03", "1e-02", "1e-01"
    }  # fmt: skip
    assert (tmp_path / "cache" / "features").is_dir()
