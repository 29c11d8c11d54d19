"""The trainer, its config files, its data loaders and the export, on real faces on CPU."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import ConfigError, load_config, parse_override
from training.data import DeviceResidentLoader, StreamingLoader, to_network_input
from training.trainer import lr_factor

CONFIGS = Path(__file__).resolve().parent.parent / "training" / "configs"


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def test_every_shipped_config_loads_and_validates():
    from training.cifar import is_cifar_config

    paths = [p for p in sorted(CONFIGS.rglob("*.toml")) if not is_cifar_config(p)]  # test_hyperspherical
    assert len(paths) >= 10
    for path in paths:
        config = load_config(path)
        assert config.steps > 0, path
    sphereconv = load_config(CONFIGS / "hyperspherical" / "sf4_sphereconv_asoftmax_m4.toml")
    baseline = load_config(CONFIGS / "celeba_more" / "sf4_asoftmax_m4.toml")
    differences = {k for k, v in vars(sphereconv).items() if v != vars(baseline)[k]}
    # the face comparison differs from the loss table's A-Softmax row in the operator and its lr only
    assert differences == {"name", "out_dir", "operator", "operator_options", "orthogonality_weight", "lr"}
    # the OPT and CoMHE face runs differ from it in the method only, at the same learning rate
    for path, changed in [
        ("opt/sf4_opt_cp_asoftmax_m4.toml", {"opt", "opt_options"}),
        ("opt/sf4_rp_comhe_asoftmax_m4.toml", {"hidden_mhe_weight", "hidden_mhe_half_space",
                                               "hidden_mhe_projection", "hidden_mhe_options"}),
    ]:  # fmt: skip
        config = load_config(CONFIGS / path)
        assert {k for k, v in vars(config).items() if v != vars(baseline)[k]} == {"name", "out_dir", *changed}


def test_face_and_cifar_configs_share_one_part_and_write_every_field():
    from dataclasses import fields

    from training.cifar import CifarConfig
    from training.config import RunConfig, TrainConfig

    shared = {f.name for f in fields(RunConfig)}
    for cls in (TrainConfig, CifarConfig):
        names = [f.name for f in fields(cls)]
        assert sorted(cls.FIELD_ORDER) == sorted(names) and shared <= set(names)
        assert list(cls().as_dict()) == list(cls.FIELD_ORDER)
    # the shared fields are checked once, for both kinds of run
    for cls in (TrainConfig, CifarConfig):
        with pytest.raises(ConfigError, match="orthogonality_weight must be >= 0"):
            cls.from_dict({"operator": "sphereconv", "orthogonality_weight": -1.0})
        with pytest.raises(ConfigError, match="hidden_mhe_projection needs hidden_mhe_weight"):
            cls.from_dict({"hidden_mhe_projection": "random"})
    with pytest.raises(ConfigError, match="unknown CIFAR config fields \\['network'\\]"):
        CifarConfig.from_dict({"network": "sphereface4"})
    assert load_config(None, ["steps=10"]).to_toml().splitlines()[:2] == [
        'name = "sphereface20_asoftmax_m4"',
        'data = ".cache/data/casia_webface"',
    ]


def test_operator_options_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="unknown operator 'sphere'"):
        load_config(None, ["operator=sphere"])
    with pytest.raises(ConfigError, match="unknown operator options"):
        load_config(None, ["operator=sphereconv", "operator_options={ kk = 1 }"])
    with pytest.raises(ConfigError, match="need operator = sphereconv"):
        load_config(None, ["orthogonality_weight=0.1"])


def test_child_config_overrides_its_base_and_replaces_tables():
    softmax = load_config(CONFIGS / "celeba" / "sf4_softmax.toml")
    assert softmax.network == "sphereface4"  # from celeba/base.toml
    assert softmax.momentum == 0.9  # from base.toml
    assert softmax.head == "softmax" and softmax.head_options == {}  # table replaced, not merged
    m2 = load_config(CONFIGS / "celeba" / "sf4_asoftmax_m2.toml")
    assert m2.head_options == {"m": 2}


def test_command_line_overrides_are_parsed_as_toml():
    config = load_config(
        CONFIGS / "celeba" / "sf4_asoftmax_m4.toml",
        ["steps=7", "lr=0.05", "head_options.m=3", "name=x y"],
    )
    assert (config.steps, config.lr, config.head_options["m"], config.name) == (7, 0.05, 3, "x y")
    assert parse_override("flip=false") == ("flip", False)


def test_bad_configs_get_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config fields"):
        load_config(None, ["stepz=3"])
    with pytest.raises(ConfigError, match="network must be one of"):
        load_config(None, ["network=resnet50"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="log_every must be positive"):
        load_config(None, ["log_every=0"])
    with pytest.raises(ConfigError, match="checkpoint_every must be >= 0"):
        load_config(None, ["checkpoint_every=-1"])
    loop = tmp_path / "a.toml"
    loop.write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="loops"):
        load_config(loop)


def test_learning_rate_drops_tenfold_at_the_papers_fractions_of_the_run():
    config = load_config(None, ["steps=28000"])
    assert config.lr_milestones() == [16000, 24000]
    assert lr_factor(15999, config) == 1.0
    assert lr_factor(16000, config) == pytest.approx(0.1)
    assert lr_factor(24000, config) == pytest.approx(0.01)
    short = load_config(None, ["steps=700"])
    assert short.lr_milestones() == [400, 600]


def test_a_resume_may_change_only_the_allow_list_and_names_every_other_key(tmp_path):
    from training.resume import resumed_config

    original = load_config(None, ["steps=28000"])
    allowed = load_config(None, [
        "steps=28000", "log_every=7", "checkpoint_every=3", "lfw_every=0", 'lfw=""', "threads=1",
        "out_dir=elsewhere", "lfw_pairs_per_fold=50", "feature_norm_collapse=0",
    ])  # fmt: skip
    assert resumed_config(original, allowed, 5000, tmp_path) == allowed
    changed = load_config(None, ["steps=28000", "lr=0.5", "head_options.m=2", "log_every=7"])
    with pytest.raises(ConfigError) as refused:
        resumed_config(original, changed, 5000, tmp_path)
    message = str(refused.value)
    assert "head_options, lr differ" in message and "lr 0.1 -> 0.5" in message
    assert "log_every" not in message.split("differ")[0]  # an allowed change is not among the refused
    for override in ("network=sphereface4", "batch_size=128", "seed=1", "data=other", "loader=stream"):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=f": {key} differ"):
            resumed_config(original, load_config(None, ["steps=28000", override]), 5000, tmp_path)


def test_steps_may_grow_only_after_the_last_lr_drop_which_stays_where_it_was(tmp_path):
    from training.resume import resumed_config
    from training.trainer import lr_factor

    original = load_config(None, ["steps=28000"])  # drops at 16000 and 24000
    longer = load_config(None, ["steps=32000"])
    effective = resumed_config(original, longer, 24000, tmp_path)
    assert effective.steps == 32000 and effective.lr_milestones() == [16000, 24000]
    assert effective.lr_drops == [0.5, 0.75]
    steps = (15999, 16000, 23999, 24000)
    expected = [lr_factor(s, original) for s in (*steps, 27999)]
    assert [lr_factor(s, effective) for s in (*steps, 31999)] == expected
    # before the last drop the new length would move it (to 27429 here): refused, naming steps
    with pytest.raises(ConfigError, match=r": steps differ .*after its last learning-rate drop \(step 24000"):
        resumed_config(original, longer, 23999, tmp_path)
    with pytest.raises(ConfigError, match="never shorten"):
        resumed_config(original, load_config(None, ["steps=27000"]), 26000, tmp_path)
    # a run already lengthened to 32000 cannot be resumed as the original 28000 from step 30000
    with pytest.raises(ConfigError, match="ends before the checkpoint's step 30000"):
        resumed_config(original, original, 30000, tmp_path)


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------


def _toy_faces(n: int = 40, classes: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 112, 96, 3), dtype=np.uint8)
    labels = np.arange(n) % classes
    return images, labels


def test_network_input_is_normalised_nchw_and_flip_mirrors_only_chosen_images():
    images, _ = _toy_faces(4)
    batch = torch.from_numpy(images)
    plain = to_network_input(batch)
    assert plain.shape == (4, 3, 112, 96) and plain.dtype == torch.float32
    expected = (images[1].astype(np.float32).transpose(2, 0, 1) - 127.5) / 128
    np.testing.assert_allclose(plain[1].numpy(), expected, atol=1e-6)
    mask = torch.tensor([True, False, True, False])
    flipped = to_network_input(batch, mask)
    torch.testing.assert_close(flipped[0], plain[0].flip(2))
    torch.testing.assert_close(flipped[1], plain[1])


def test_device_resident_loader_covers_each_epoch_once_and_splits_ranks():
    images, labels = _toy_faces(40)
    seen = []
    for rank in (0, 1):
        loader = DeviceResidentLoader(images, labels, 4, "cpu", flip=False, seed=3, rank=rank, world_size=2)
        batches = iter(loader)
        for _ in range(loader.batches_per_epoch):
            x, _ = next(batches)
            seen.append(x)
    # 40 faces, 2 ranks x 5 batches of 4: every face exactly once per epoch over both ranks.
    flat = torch.cat(seen).reshape(40, -1)
    originals = to_network_input(torch.from_numpy(images)).reshape(40, -1)
    matches = (flat[:, None, :] == originals[None]).all(-1)
    assert matches.sum(0).tolist() == [1] * 40


def test_device_resident_loader_rejects_a_dataset_smaller_than_a_batch():
    images, labels = _toy_faces(6)
    with pytest.raises(ValueError, match="fewer than one batch"):
        DeviceResidentLoader(images, labels, 8, "cpu")


def _identity_ordered_shards(
    classes: int, per_class: int, shard_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A CASIA-like set in miniature: faces of one identity together, shards cut in that order
    (what ``sphereface prepare`` writes); 4x4 images keep it small."""
    labels = np.repeat(np.arange(classes), per_class)
    images = (np.arange(len(labels))[:, None, None, None] % 251).astype(np.uint8) * np.ones(
        (1, 4, 4, 3), np.uint8
    )
    return [
        (images[a : a + shard_size], labels[a : a + shard_size]) for a in range(0, len(labels), shard_size)
    ]


def _take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = iter(loader)
    out = [next(batches) for _ in range(n)]
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    return out


def test_streaming_loader_gives_the_same_batches_as_the_device_loader():
    shards = _identity_ordered_shards(classes=30, per_class=8, shard_size=64)
    images = np.concatenate([x for x, _ in shards])
    labels = np.concatenate([y for _, y in shards])
    options = {"flip": True, "seed": 5, "rank": 1, "world_size": 2}
    streamed = _take(StreamingLoader(shards, 16, "cpu", prefetch=2, **options), 17)  # past an epoch
    resident = _take(DeviceResidentLoader(images, labels, 16, "cpu", **options), 17)
    for (xs, ys), (xd, yd) in zip(streamed, resident, strict=True):
        assert torch.equal(ys, yd) and torch.equal(xs, xd)


@pytest.mark.parametrize("kind", ["stream", "device"])
def test_batches_cover_identities_like_uniform_sampling_on_identity_ordered_shards(kind):
    # 3,000 identities x 8 faces in identity order, 3 shards: 64 batches of 64 should meet as many
    # identities as 4,096 faces drawn uniformly without replacement (expected 2,329), not the
    # identities of one or two shards.
    classes, per_class, draws = 3000, 8, 64 * 64
    shards = _identity_ordered_shards(classes, per_class, shard_size=8192)
    if kind == "stream":
        loader = StreamingLoader(shards, 64, "cpu", flip=False, seed=0)
    else:
        loader = DeviceResidentLoader.from_shards(shards, 64, "cpu", flip=False, seed=0)
    seen = torch.cat([y for _, y in _take(loader, 64)]).unique().numel()
    n = classes * per_class
    expected = classes * (1 - math.comb(n - per_class, draws) / math.comb(n, draws))
    assert seen == pytest.approx(expected, rel=0.03)


def test_ranks_get_disjoint_equal_shares_of_every_epoch():
    from training.data import epoch_order

    shares = [epoch_order(1001, seed=3, epoch=2, rank=r, world_size=3) for r in range(3)]
    assert [len(s) for s in shares] == [333, 333, 333]  # equal: ranks' epochs stay in step
    together = np.concatenate(shares)
    assert len(np.unique(together)) == 999  # disjoint
    assert not np.array_equal(epoch_order(1001, 3, 2), epoch_order(1001, 3, 3))  # new order per epoch


@pytest.mark.parametrize("kind", ["stream", "device"])
@pytest.mark.parametrize("augment", [None, {"shift": 0.1, "rotate": 10, "contrast": 0.3, "erase": 0.5}])
def test_loader_state_continues_exactly_where_it_was_saved(kind, augment):
    from training.data import AugmentOptions

    shards = _identity_ordered_shards(classes=10, per_class=5, shard_size=20)
    options = {"flip": True, "seed": 1, "augment": AugmentOptions.from_options(augment)}

    def make():
        if kind == "stream":
            return StreamingLoader(shards, 8, "cpu", prefetch=3, **options)
        return DeviceResidentLoader.from_shards(shards, 8, "cpu", **options)

    reference = _take(make(), 13)  # 6 batches per epoch: crosses two epoch boundaries
    first = make()
    _take(first, 8)
    # The streaming loader's producer has read ahead; its position is what was handed out.
    assert (first.epoch, first.position) == (1, 2)
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    for (x, y), (x_ref, y_ref) in zip(_take(second, 5), reference[8:], strict=True):
        assert torch.equal(y, y_ref) and torch.equal(x, x_ref)  # same faces, same flips and moves
    with pytest.raises(ValueError, match="cannot continue"):
        other = (
            StreamingLoader(shards, 4, "cpu")
            if kind == "stream"
            else DeviceResidentLoader.from_shards(shards, 4, "cpu")
        )
        other.load_state_dict(state)


def test_streaming_loader_reports_a_dataset_smaller_than_a_batch():
    images, labels = _toy_faces(6)
    with pytest.raises(ValueError, match="fewer than one batch"):
        StreamingLoader([(images, labels)], 8, "cpu")


# --------------------------------------------------------------------------------------------
# Training on real faces (two identities of celeba_faces)
# --------------------------------------------------------------------------------------------


def _smoke_overrides(prepared, out_dir, name: str, *extra: str) -> list[str]:
    return [
        f"data={prepared.path}", f"out_dir={out_dir}", f"name={name}", "network=sphereface4",
        "batch_size=8", "log_every=1", "checkpoint_every=1", 'lfw=""', "threads=1", *extra,
    ]  # fmt: skip


@pytest.mark.shared_data
def test_two_step_training_run_logs_checkpoints_resumes_and_exports(tiny_prepared, tmp_path):
    from models.embedder import Embedder
    from training.export import export_checkpoint
    from training.trainer import train

    overrides = _smoke_overrides(
        tiny_prepared, tmp_path, "smoke", "head=sphereface_plus", "head_options={ m = 4, mhe_weight = 1.0 }",
        "steps=2",
    )  # fmt: skip
    result = train(load_config(None, overrides), progress=False)
    run = tmp_path / "smoke"
    assert result.run_dir == run
    with (run / "log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(np.isfinite(float(r["loss"])) for r in rows)
    # The authors' schedule per Caffe iteration, whatever the run's length: 1000/1.12, 1000/1.24.
    assert [float(r["lambda"]) for r in rows] == pytest.approx([892.857, 806.452], abs=1e-3)
    # The lr each step used: 0.1, then 0.01 after the first drop (2 steps: drops at steps 1 and 2).
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.1, 0.01])
    assert float(rows[0]["mhe"]) > 0
    assert all(float(r["feature_norm"]) > 0 for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_classes"] == 2 and summary["classifier_energy_s2"] > 0
    assert (run / "curves.png").stat().st_size > 0
    # The classifier rows stay on the unit sphere (renormalised after every step, as in Caffe).
    head = torch.load(run / "checkpoint.pt", weights_only=True)["head"]["weight"]
    torch.testing.assert_close(head.norm(dim=1), torch.ones(2), atol=1e-6, rtol=0)

    # A second session continues from the checkpoint instead of starting over.
    with pytest.raises(ConfigError, match="--resume"):
        train(load_config(None, overrides), progress=False)
    resumed = train(load_config(None, [*overrides, "steps=3"]), resume=True, progress=False)
    assert resumed.summary["final"]["step"] == 3
    with (run / "log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    # lengthened after its last drop: the third step runs at the last lr, 0.001
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.1, 0.01, 0.001])

    # Export: ONNX with a dynamic batch, same embedding as PyTorch on real crops.
    model_dir = tmp_path / "model"
    manifest, report = export_checkpoint(run / "checkpoint.pt", model_dir, progress=False)
    assert manifest.architecture == "sphereface4" and manifest.embedding_size == 512
    assert report["onnx_parity_max_abs_diff"] < 1e-3
    crops = tiny_prepared.concatenate()[0][:3]
    fused = Embedder(model_dir, "cpu").embed(crops)
    assert fused.shape == (3, 1024)
    np.testing.assert_allclose(np.linalg.norm(fused, axis=1), 1.0, atol=1e-5)


@pytest.mark.shared_data
def test_a_resume_with_a_changed_config_is_refused_and_the_run_folder_is_kept(tiny_prepared, tmp_path):
    from training.resume import RESUMES_FILE
    from training.trainer import train

    overrides = _smoke_overrides(tiny_prepared, tmp_path, "kept", "head=asoftmax", "steps=4")
    train(load_config(None, overrides), progress=False, until_step=2)
    run = tmp_path / "kept"
    config_toml, checkpoint = (run / "config.toml").read_bytes(), (run / "checkpoint.pt").read_bytes()
    for changed, named in [
        (["lr=0.5"], "lr"), (["head_options.m=2"], "head_options"), (["steps=25"], "steps"),
        (["lr=0.5", "steps=25", "head_options.m=2"], "head_options, lr, steps"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"with a changed config: {named} differ"):
            train(load_config(None, [*overrides, *changed]), resume=True, progress=False)
    assert (run / "config.toml").read_bytes() == config_toml
    assert (run / "checkpoint.pt").read_bytes() == checkpoint and not (run / RESUMES_FILE).exists()
    # The allow-list: logging, checkpoints, the LFW check and threads may change.
    allowed = [*overrides, "log_every=2", "checkpoint_every=3", "lfw_every=5", "threads=2"]
    assert train(load_config(None, allowed), resume=True, progress=False).steps == 4
    assert (run / "config.toml").read_bytes() == config_toml
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["original_config"]["log_every"] == 1 and state["config"]["log_every"] == 2
    (entry,) = [json.loads(line) for line in (run / RESUMES_FILE).read_text().splitlines()]
    assert entry["step"] == 2 and set(entry["changed"]) == {"log_every", "checkpoint_every", "lfw_every",
                                                            "threads"}  # fmt: skip
    assert entry["changed"]["log_every"] == {"from": 1, "to": 2}
    # A finished run resumed again trains nothing and keeps its summary.
    summary = (run / "summary.json").read_bytes()
    again = train(load_config(None, allowed), resume=True, progress=False)
    assert again.steps == 4 and again.summary["final"]["step"] == 4
    assert (run / "summary.json").read_bytes() == summary


AUGMENT = {"shift": 0.05, "rotate": 5.0, "saturation": 0.2, "grayscale": 0.3, "erase": 0.3}


@pytest.mark.shared_data
@pytest.mark.parametrize(("loader", "checkpoint_every"), [("device", 5), ("stream", 0)])
def test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one_bit_for_bit(
    tiny_prepared, tmp_path, loader, checkpoint_every
):
    from training.trainer import train

    # 6 steps of batch 8 cross an epoch boundary of the 2-identity set; flips and the other
    # augmentation, hidden MHE's random neurons and the optimizer's momentum all carry over. The
    # break (step 4) is not a multiple of checkpoint_every (0: checkpoints only at the end and at
    # the stop), so the stop itself must checkpoint.
    extra = (
        "steps=6", f"checkpoint_every={checkpoint_every}", f"loader={loader}", "hidden_mhe_weight=0.1",
        "head=asoftmax", f"augment={{ {', '.join(f'{k} = {v}' for k, v in AUGMENT.items())} }}",
    )  # fmt: skip
    whole = train(
        load_config(None, _smoke_overrides(tiny_prepared, tmp_path, "whole", *extra)), progress=False
    )
    config = load_config(None, _smoke_overrides(tiny_prepared, tmp_path, "parts", *extra))
    assert whole.summary["augment"] == AUGMENT
    first = train(config, progress=False, until_step=4)
    assert first.steps == 4 and first.summary == {}
    assert not (tmp_path / "parts" / "summary.json").exists()
    second = train(config, resume=True, progress=False)
    assert second.steps == 6
    a = torch.load(whole.run_dir / "checkpoint.pt", weights_only=True)
    b = torch.load(second.run_dir / "checkpoint.pt", weights_only=True)
    for part in ("net", "head"):
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), f"{part}.{key} differs after resuming"
    momentum_a = [s["momentum_buffer"] for s in a["optimizer"]["state"].values()]
    momentum_b = [s["momentum_buffer"] for s in b["optimizer"]["state"].values()]
    assert all(torch.equal(x, y) for x, y in zip(momentum_a, momentum_b, strict=True))
    with (tmp_path / "parts" / "log.csv").open() as handle:
        assert [int(r["step"]) for r in csv.DictReader(handle)] == [1, 2, 3, 4, 5, 6]


S_OPT = ("opt=cp", "opt_options={ stochastic_dims = 4, inner_steps = 2 }")
RP_COMHE = (
    "hidden_mhe_weight=1.0", 'hidden_mhe_projection="random"',
    "hidden_mhe_options={ dim = 5, projections = 2, redraw_every = 3 }",
)  # fmt: skip


@pytest.mark.shared_data
@pytest.mark.parametrize(
    ("options", "hooks"),
    [
        (S_OPT, ["OPTRefinement", "OPTTraining", "HeadRenormalisation"]),
        (RP_COMHE, ["HiddenMHEHook", "HeadRenormalisation"]),
    ],
    ids=["s_opt", "rp_comhe"],
)
def test_a_resumed_run_draws_what_an_uninterrupted_one_draws(tiny_prepared, tmp_path, options, hooks):
    """S-OPT's generator picks the dimensions to rotate every ``inner_steps`` steps; CoMHE's draws
    projections every ``redraw_every`` calls and uses them in between. Both are carried over in the
    checkpoint, so the run interrupted at step 4 (between two draws) ends with the same weights as
    the one that was not."""
    from training.trainer import train

    extra = ("steps=6", "checkpoint_every=0", "head=asoftmax", *options)
    whole_config = load_config(None, _smoke_overrides(tiny_prepared, tmp_path, "whole", *extra))
    whole = train(whole_config, progress=False)
    config = load_config(None, _smoke_overrides(tiny_prepared, tmp_path, "parts", *extra))
    train(config, progress=False, until_step=4)
    second = train(config, resume=True, progress=False)
    a = torch.load(whole.run_dir / "checkpoint.pt", weights_only=True)
    b = torch.load(second.run_dir / "checkpoint.pt", weights_only=True)
    assert [entry["hook"] for entry in a["hooks"]] == hooks
    for key, value in a["net"].items():
        assert torch.equal(value, b["net"][key]), f"net.{key} differs after resuming"


@pytest.mark.shared_data
def test_fine_tuning_starts_from_another_runs_network_and_classifier(tiny_prepared, tmp_path):
    from training.trainer import train

    base = train(
        load_config(None, _smoke_overrides(tiny_prepared, tmp_path, "base", "head=asoftmax", "steps=2")),
        progress=False,
    )
    source = torch.load(base.run_dir / "checkpoint.pt", weights_only=True)
    # SphereFace+ the papers' way: the trained A-Softmax run, then A-Softmax + MHE. One step at
    # lr 1e-9 leaves every weight within 1e-6 of where the source run left it.
    source_path = json.dumps(str(base.run_dir / "checkpoint.pt"))
    overrides = _smoke_overrides(
        tiny_prepared, tmp_path, "tuned", "head=sphereface_plus", "head_options={ m = 4, mhe_weight = 10.0 }",
        "steps=1", "lr=1e-9", "lambda_base=5.0", f"init_from={source_path}",
    )  # fmt: skip
    tuned = train(load_config(None, overrides), progress=False)
    state = torch.load(tuned.run_dir / "checkpoint.pt", weights_only=True)
    for part in ("net", "head"):
        for key, value in source[part].items():
            torch.testing.assert_close(state[part][key], value, atol=1e-6, rtol=0, msg=f"{part}.{key}")
    assert tuned.summary["init_from"] == str(base.run_dir / "checkpoint.pt")
    with (tuned.run_dir / "log.csv").open() as handle:
        row = next(csv.DictReader(handle))
    assert float(row["lambda"]) == 5.0 and float(row["mhe"]) > 0
    # A fresh run of the same config differs: the weights above came from the source, not the seed.
    fresh = train(load_config(None, [*overrides[:-1], "name=fresh"]), progress=False)
    fresh_state = torch.load(fresh.run_dir / "checkpoint.pt", weights_only=True)
    first = next(iter(source["net"]))
    assert (fresh_state["net"][first] - state["net"][first]).abs().max() > 1e-3

    lost = [*overrides[:-1], "name=lost", f"init_from={json.dumps(str(tmp_path / 'nowhere'))}"]
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        train(load_config(None, lost), progress=False)


@pytest.mark.shared_data
def test_a_run_whose_features_collapse_stops_with_a_clear_message(tiny_prepared, tmp_path):
    from training.health import FeatureCollapseError
    from training.trainer import train

    # Weight decay 5 at lr 0.1 without momentum halves every decayed weight per step, so ||x||
    # falls by an order of magnitude within a few steps; a collapse fraction of 0.5 must stop the
    # run there (the default, 0.01, is for the real collapse; this keeps the test short).
    overrides = _smoke_overrides(
        tiny_prepared, tmp_path, "collapse", "steps=20", "weight_decay=5.0", "momentum=0.0",
        "feature_norm_collapse=0.5",
    )  # fmt: skip
    with pytest.raises(
        FeatureCollapseError, match=r"features collapsed at step (\d+): mean \|\|x\|\| fell"
    ) as caught:
        train(load_config(None, overrides), progress=False)
    stopped = int(re.search(r"at step (\d+)", str(caught.value)).group(1))
    with (tmp_path / "collapse" / "log.csv").open() as handle:
        norms = [float(r["feature_norm"]) for r in csv.DictReader(handle)]
    # Every logged interval before it was healthy; the collapsing one is the log's last line.
    assert stopped < 20 and len(norms) == stopped
    assert all(n >= 0.5 * norms[0] for n in norms[:-1]) and norms[-1] < 0.5 * norms[0]
    record = json.loads((tmp_path / "collapse" / "stopped.json").read_text())
    assert record["step"] == stopped and record["reason"] == "FeatureCollapseError"
    assert record["message"] == str(caught.value)
    # The same run with the check off trains on.
    unchecked = [*overrides[:-1], "feature_norm_collapse=0", "name=unchecked", "steps=3"]
    assert train(load_config(None, unchecked), progress=False).steps == 3


@pytest.mark.shared_data
def test_training_on_two_prepared_folders_with_a_minimum_of_photos(tiny_prepared, tmp_path_factory, tmp_path):
    from tests.conftest import require_shared
    from training.prepare import prepare_dataset
    from training.trainer import train

    source = require_shared("celeba_faces")
    out = tmp_path_factory.mktemp("prepared") / "celeba_next"
    # identities 3..4 of celeba_faces: limit_identities=4 minus the 2 of tiny_prepared's folder
    four = prepare_dataset(source, out, limit_identities=4, workers=2, progress=False)
    overrides = _smoke_overrides(tiny_prepared, tmp_path, "two", "steps=1")
    overrides[0] = f"data=[{str(tiny_prepared.path)!r}, {str(four.path)!r}]"
    counts = sorted(four.manifest["identity_counts"].values())
    result = train(load_config(None, [*overrides, f"min_photos_per_identity={counts[1]}"]), progress=False)
    # The 2 identities in both folders merge by name; those below the minimum are left out.
    kept = {n: c for n, c in four.manifest["identity_counts"].items()}
    for name in tiny_prepared.identities:
        kept[name] += tiny_prepared.manifest["identity_counts"][name]
    expected = sorted(n for n, c in kept.items() if c >= counts[1])
    assert result.summary["num_classes"] == len(expected)
    assert result.summary["num_images"] == sum(kept[n] for n in expected)
    # The exported model says what it was trained on: both folders, merged, with the minimum.
    from training.export import export_checkpoint

    manifest, _ = export_checkpoint(result.run_dir, tmp_path / "model", progress=False)
    assert f"at least {counts[1]} faces each): {result.summary['num_images']} faces" in manifest.training_data
    assert manifest.training_data.count("faces of") == 3  # each folder, then the set


@pytest.mark.shared_data
@pytest.mark.slow
def test_two_processes_under_torchrun_train_one_model(tiny_prepared, tmp_path):
    import os
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "models.cli", "train",
        "--no-progress", "--set", f"data={tiny_prepared.path}", "--set", f"out_dir={tmp_path}",
        "--set", "name=ddp", "--set", "network=sphereface4", "--set", "batch_size=8", "--set", "steps=2",
        "--set", "log_every=1", "--set", 'lfw=""', "--set", "threads=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes x batch 4" in done.stderr
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["final"]["step"] == 2
    # DDP kept both ranks' weights identical (a checksum of every parameter, gathered from each).
    checksums = summary["rank_weight_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]


def test_lambda_floor_in_epochs_sets_the_warm_phase_by_dataset_size():
    from training.trainer import build_model

    overrides = ["network=sphereface4", "head=asoftmax", "lambda_floor_epochs=1.0", "batch_size=128"]
    config = load_config(None, overrides)
    head = build_model(config, num_classes=5, num_images=6237).head
    # One epoch of 6,237 faces at batch 128 is 48.7 steps: lambda is above 5 at step 48, 5 at 49.
    assert head.lambda_schedule(48) > 5.0 and head.lambda_schedule(49) == 5.0
    with pytest.raises(ConfigError, match="number of training images"):
        build_model(config, num_classes=5)


def test_loss_table_reads_finished_runs_in_paper_order_with_megaface_rank1(tmp_path):
    from training.loss_table import collect, markdown

    def run(name: str, head: str, options: dict, seed: int, lfw: float, rank1: float | None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        summary = {
            "name": name, "head": head, "head_options": options, "seed": seed, "network": "sphereface4",
            "steps": 2000, "batch_size": 64, "epochs": 9.6, "num_images": 13367, "num_classes": 3044,
            "lfw": {"accuracy": lfw, "std": 0.01, "angular_fisher_score": 0.3},
            "classifier_energy_s2": 0.5, "classifier_energy_s0": -0.3,
            "classifier_angles_deg": {"min_deg": 60.0, "nearest_mean_deg": 75.0},
            "final": {"accuracy": 0.9, "feature_norm": 21.5},
        }  # fmt: skip
        (folder / "summary.json").write_text(json.dumps(summary))
        if rank1 is not None:
            identification = {"10": {"rank1": 0.99}, "10318": {"rank1": rank1}, "1000": {"rank1": 0.5}}
            report = {"results": {"raw": {"identification": identification}}}
            (folder / "megaface_local.json").write_text(json.dumps(report))
        return folder

    rows = collect([
        run("arc", "arcface", {"scale": 30.0, "margin": 0.5}, 0, 0.81, None),
        run("m4s1", "asoftmax", {"m": 4}, 1, 0.83, 0.25),
        run("soft", "softmax", {}, 0, 0.80, 0.125),
        run("plus10", "sphereface_plus", {"m": 4, "mhe_weight": 10.0}, 0, 0.82, 0.2),
        run("caffe", "sphereface_plus", {"m": 4, "mhe_weight": 10, "mhe_form": "caffe_among"}, 0, 0.82, 0.2),
        run("plus01", "sphereface_plus", {"m": 4, "mhe_weight": 0.1}, 0, 0.82, 0.2),
        run("plus_m2", "sphereface_plus", {"m": 2, "mhe_weight": 10.0}, 0, 0.82, 0.2),
    ])  # fmt: skip
    assert [r["loss"] for r in rows] == [
        "softmax", "A-Softmax m = 4, seed 1", "SphereFace+ (m = 2, MHE weight 10.0)",
        "SphereFace+ (m = 4, MHE weight 0.1)", "SphereFace+ (m = 4, MHE weight 10.0)",
        "SphereFace+ (m = 4, MHE weight 10, the Caffe layer's update)", "ArcFace (s = 30, m = 0.5)",
    ]  # fmt: skip
    assert rows[1]["megaface_local_rank1"] == 0.25 and rows[1]["megaface_distractors"] == 10318
    table = markdown(rows).splitlines()
    assert table[3].startswith("| A-Softmax m = 4, seed 1 | 83.00 ± 1.00 | 25.00 | 0.3000 |")
    assert table[3].endswith("| 90.0 | 21.5 |")
    assert "| – |" in table[8]  # no MegaFace report for the ArcFace run
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(FileNotFoundError, match="has not finished"):
        collect([tmp_path / "unfinished"])


def test_loss_table_adds_new_runs_to_a_kept_table_in_paper_order(tmp_path):
    from training.loss_table import ORDER, main, merge_rows

    plus, arcface = ORDER.index(("sphereface_plus", 4)), ORDER.index(("arcface", None))
    kept = [
        {"run": "sf4_softmax", "loss": "softmax", "order": [0, 0.0], "lfw_accuracy": 0.83},
        {"run": "sf4_sphereface_plus", "loss": "SphereFace+ w1", "order": [plus, 1.0], "lfw_accuracy": 0.85},
        {"run": "sf4_arcface", "loss": "ArcFace", "order": [arcface, 0.0], "lfw_accuracy": 0.86},
    ]
    new = [
        {"run": "sf4_sphereface_plus_mhe10", "loss": "SphereFace+ w10", "order": [plus, 10.0]},
        {"run": "sf4_sphereface_plus_mhe0p1", "loss": "SphereFace+ w0.1", "order": [plus, 0.1]},
        {"run": "sf4_softmax", "loss": "softmax", "order": [0, 0.0], "lfw_accuracy": 0.84},
    ]
    rows = merge_rows(kept, new, "kept.json")
    assert [r["run"] for r in rows] == [
        "sf4_softmax", "sf4_sphereface_plus_mhe0p1", "sf4_sphereface_plus",
        "sf4_sphereface_plus_mhe10", "sf4_arcface",
    ]  # fmt: skip
    assert rows[0]["lfw_accuracy"] == 0.84  # the new run replaced the kept row
    with pytest.raises(ValueError, match="have no 'order'"):
        merge_rows([{"run": "old"}], new, "old.json")
    # Through the command line: a finished run folder added to a kept JSON table.
    run = tmp_path / "sf4_cosface"
    run.mkdir()
    summary = {
        "name": "sf4_cosface", "head": "cosface", "head_options": {}, "seed": 0, "network": "sphereface4",
        "steps": 2000, "batch_size": 64, "epochs": 9.6, "lfw": {"accuracy": 0.8, "std": 0.01},
        "final": {"accuracy": 0.9, "feature_norm": 21.5},
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    columns = (
        "lfw_accuracy", "lfw_std", "megaface_local_rank1", "angular_fisher_score", "classifier_energy_s2",
        "classifier_energy_s0", "classifier_min_angle_deg", "classifier_nearest_mean_deg",
        "final_train_accuracy", "final_feature_norm",
    )  # fmt: skip
    table = tmp_path / "table.json"
    table.write_text(json.dumps([{**dict.fromkeys(columns), **r} for r in kept]))
    assert main([str(run), "--keep", str(table), "--json", str(table)]) == 0
    runs = [r["run"] for r in json.loads(table.read_text())]
    assert runs == ["sf4_softmax", "sf4_sphereface_plus", "sf4_cosface", "sf4_arcface"]


def test_both_loops_build_their_step_hooks_from_the_config_in_one_place():
    from training.cifar import build_cifar_model, load_cifar_config
    from training.opt import OPTRefinement, OPTTraining
    from training.regularisers import (
        HeadRenormalisation,
        HiddenMHEHook,
        OrthogonalityHook,
        WeightProjection,
        build_step_hooks,
    )
    from training.trainer import build_model

    face = load_config(None, ["network=sphereface4", "hidden_mhe_weight=0.5", 'opt="or"',
                              'opt_options={ skip = ["fc1"] }'])  # fmt: skip
    hooks = build_step_hooks(face, build_model(face, num_classes=3))
    assert [type(h) for h in hooks] == [HiddenMHEHook, OPTRefinement, OPTTraining, HeadRenormalisation]
    sphere = load_config(None, ["network=sphereface4", "operator=sphereconv", "orthogonality_weight=0.1",
                                "weight_projection_every=2", "head=softmax"])  # fmt: skip
    hooks = build_step_hooks(sphere, build_model(sphere, num_classes=3))
    assert [type(h) for h in hooks] == [OrthogonalityHook, WeightProjection]  # softmax: no renormalisation
    # the CIFAR loop adds hidden MHE after the other penalties (its order, kept bit for bit)
    cifar = load_cifar_config(CONFIGS / "opt" / "cifar" / "cnn6_or.toml", ["hidden_mhe_weight=1.0"])
    hooks = build_step_hooks(cifar, build_cifar_model(cifar), hidden_mhe_last=True)
    assert [type(h) for h in hooks] == [OPTRefinement, OPTTraining, HiddenMHEHook]


def test_step_hooks_add_their_penalties_in_order_and_run_their_updates():
    from training.step_hooks import StepHook, StepHooks, StepInputs

    calls: list[str] = []

    class Recorder(StepHook):
        def __init__(self, name: str, term: float | None) -> None:
            self.name, self.term = name, term

        def penalty(self, inputs: StepInputs) -> torch.Tensor | None:
            calls.append(f"{self.name}.penalty")
            return None if self.term is None else torch.tensor(self.term)

        def logged(self) -> dict[str, torch.Tensor]:
            return {} if self.term is None else {self.name: torch.tensor(2 * self.term)}

        def after_backward(self, optimizer) -> None:
            calls.append(f"{self.name}.after_backward")

        def after_step(self, optimizer, step: int) -> None:
            calls.append(f"{self.name}.after_step({step})")

    hooks = StepHooks([Recorder("a", 1.0), Recorder("b", None), Recorder("c", 0.25)])
    inputs = StepInputs(torch.nn.Identity(), torch.zeros(1), torch.zeros(1))
    total, logged = hooks.add_penalties(torch.tensor(10.0), inputs)
    assert float(total) == 11.25 and {k: float(v) for k, v in logged.items()} == {"a": 2.0, "c": 0.5}
    hooks.after_backward(None)
    hooks.after_step(None, 7)
    assert calls == ["a.penalty", "b.penalty", "c.penalty", "a.after_backward", "b.after_backward",
                     "c.after_backward", "a.after_step(7)", "b.after_step(7)", "c.after_step(7)"]  # fmt: skip


def test_a_stopping_callback_lets_every_callback_record_the_stop():
    from training.callbacks import Callback, Callbacks, Checkpointer, History, Interval, RunStopped

    seen: list[tuple[str, int]] = []

    class Stop(Callback):
        def on_interval(self, interval: Interval) -> None:
            if interval.row["loss"] > 1:
                raise RunStopped("diverged")

    class Record(Callback):
        def on_interval(self, interval: Interval) -> None:
            seen.append(("interval", interval.done))

        def on_stop(self, interval: Interval, error: BaseException) -> None:
            seen.append((f"stop: {error}", interval.done))

    saved: list[tuple[int, float]] = []
    history = History()
    callbacks = Callbacks(
        [Stop(), None, Record(), history, Checkpointer(lambda d, r: saved.append((d, r["loss"])), 2, 3)]
    )
    for done, loss in [(1, 0.5), (2, 0.4), (3, 0.3)]:
        callbacks.on_interval(Interval(done, done == 3, {"loss": loss}))
        callbacks.on_step(done)
    assert saved == [(2, 0.4), (3, 0.3)] and [r["loss"] for r in history.rows] == [0.5, 0.4, 0.3]
    with pytest.raises(RunStopped, match="diverged"):
        callbacks.on_interval(Interval(4, False, {"loss": 5.0}))
    assert seen == [("interval", 1), ("interval", 2), ("interval", 3), ("stop: diverged", 4)]
    assert history.latest == {"loss": 0.3}  # the stopping interval never reached the later callbacks


def test_optimiser_groups_follow_the_authors_prototxt():
    from models.nets import build_network
    from training.trainer import _param_groups

    net = build_network("sphereface4")
    decayed, biases, norms = _param_groups(net, lr=0.1, weight_decay=5e-4)
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    prelu_slopes = [m.weight for m in net.modules() if isinstance(m, torch.nn.PReLU)]
    conv_biases = [m.bias for m in net.modules() if isinstance(m, torch.nn.Conv2d) and m.bias is not None]
    # PReLU slopes are decayed (Caffe's default decay_mult 1); biases get lr_mult 2, decay_mult 0.
    assert ids(prelu_slopes) <= ids(decayed["params"]) and decayed["weight_decay"] == 5e-4
    assert ids(conv_biases) | {id(net.fc1.bias)} == ids(biases["params"])
    assert biases["lr"] == pytest.approx(0.2) and biases["weight_decay"] == 0.0
    assert norms["params"] == []  # SphereFace nets have no BatchNorm


def test_sphereconv_kernels_are_not_decayed_under_the_orthogonality_regulariser():
    from models.nets import build_network
    from models.nets.hyperspherical import HypersphericalSettings, hyperspherical_layers
    from training.trainer import _param_groups

    settings = HypersphericalSettings("sphereconv", {"angular": "sigmoid", "learnable_k": True})
    net = build_network("sphereface4", operator=settings)
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    kernels = ids(layer.weight for layer in hyperspherical_layers(net))
    curvatures = ids(layer.k for layer in hyperspherical_layers(net))
    decayed, _, undecayed = _param_groups(net, lr=0.1, weight_decay=5e-4)
    assert kernels <= ids(decayed["params"]) and curvatures <= ids(undecayed["params"])
    decayed, _, undecayed = _param_groups(net, lr=0.1, weight_decay=5e-4, orthogonality=True)
    assert kernels | curvatures <= ids(undecayed["params"]) and not kernels & ids(decayed["params"])
    assert id(net.fc1.weight) in ids(decayed["params"])  # fc1 stays an ordinary decayed layer


def test_auto_precision_is_bf16_only_on_gpus_that_compute_in_bf16(monkeypatch):
    from training.trainer import _bf16_for

    config = load_config(None, [])
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # V100
    assert _bf16_for(config, cuda) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    assert _bf16_for(config, cuda) is True
    assert _bf16_for(config, torch.device("cpu")) is False
    assert _bf16_for(load_config(None, ["precision=bf16"]), torch.device("cpu")) is True


def test_loss_curves_continue_a_fine_tuned_run_after_its_source_and_leave_out_the_mhe_term(tmp_path):
    from training.loss_table import curve_series

    source = tmp_path / "base"
    source.mkdir()
    (source / "summary.json").write_text(json.dumps({"steps": 2000}))
    cols = {
        "step": np.array([50.0, 100.0]), "loss": np.array([7.0, 6.5]), "mhe": np.array([0.5, 0.49]),
        "accuracy": np.array([0.5, 0.6]), "feature_norm": np.array([20.0, 21.0]),
    }  # fmt: skip
    tuned = {"head": "sphereface_plus", "head_options": {"m": 4, "mhe_weight": 10.0},
             "init_from": str(source / "checkpoint.pt")}  # fmt: skip
    steps, loss, accuracy, norm = curve_series(tuned, cols)
    np.testing.assert_allclose(steps, [2050, 2100])
    np.testing.assert_allclose(loss, [2.0, 1.6])
    np.testing.assert_allclose(accuracy, [50, 60])
    np.testing.assert_allclose(norm, [20, 21])
    scratch = {"head": "asoftmax", "head_options": {"m": 4}}
    steps, loss, *_ = curve_series(scratch, {**cols, "mhe": np.array([np.nan, np.nan])})
    np.testing.assert_allclose(steps, [50, 100])
    np.testing.assert_allclose(loss, [7.0, 6.5])
