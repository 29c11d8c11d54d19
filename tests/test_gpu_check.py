"""The GPU check (bench/gpu_check.py) on the CPU, tiny: its pack, its FLOP count, its budget, and one
whole run, so that the one command a lent GPU machine gets cannot rot between loans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from bench import gpu_check
from bench.gpu_common import TINY, Check, Row
from bench.gpu_pack import decode, read_pack, synthetic_faces, unpack, write_pack
from bench.gpu_speed import hooked_macs, sphereface_macs
from tests.conftest import REPO_ROOT
from training.export import export_checkpoint


def test_the_flop_count_of_sphereface20_is_counted_by_hand_and_matches_the_built_network():
    from models.nets import build_network

    # 112x96 -> 56x48 -> 28x24 -> 14x12 -> 7x6; per stage: the 3x3/2 opening conv, then 2 convs per unit.
    by_hand = (
        56 * 48 * 64 * (3 * 9) + 1 * 2 * 56 * 48 * 64 * (64 * 9)
        + 28 * 24 * 128 * (64 * 9) + 2 * 2 * 28 * 24 * 128 * (128 * 9)
        + 14 * 12 * 256 * (128 * 9) + 4 * 2 * 14 * 12 * 256 * (256 * 9)
        + 7 * 6 * 512 * (256 * 9) + 1 * 2 * 7 * 6 * 512 * (512 * 9)
        + 512 * 7 * 6 * 512
    )  # fmt: skip
    assert sphereface_macs(20)["total"] == by_hand == 1_749_737_472  # 3.50 GFLOP a forward pass
    for depth in (4, 20):
        assert hooked_macs(build_network(f"sphereface{depth}")) == sphereface_macs(depth)["total"]
    assert hooked_macs(build_network("sphereface4", 64)) == sphereface_macs(4, 64)["total"]


def test_a_pack_keeps_whole_identities_within_its_size_and_unpacks_into_a_prepared_folder(tmp_path):
    from training.prepare import load_prepared

    images, labels, identities = synthetic_faces(120, 6)
    full = write_pack(
        tmp_path / "full", images, labels, identities, source="test", template="sphereface_112x96"
    )
    assert full["faces"] == 120 and full["faces_left_out"] == 0 and full["bytes"] <= 40 * 2**20
    pack = read_pack(tmp_path / "full")
    prepared = load_prepared(unpack(pack, tmp_path / "prepared", shard_size=50))
    decoded, decoded_labels = prepared.concatenate()
    assert len(prepared.shards) == 3 and prepared.identities == identities
    assert np.array_equal(decoded_labels, labels)
    assert all(np.array_equal(decoded[i], decode(pack.files[i])) for i in (0, 57, 119))
    # JPEG's loss on these noisy crops is about 18 grey levels; crops out of order would differ by about 80.
    assert np.abs(decoded.astype(float) - images).mean() < 25

    half = full["bytes"] / 2**21
    small = write_pack(
        tmp_path / "small", images, labels, identities, source="test", template="t", max_mib=half
    )
    kept = read_pack(tmp_path / "small")
    assert 0 < small["faces"] < 120 and small["bytes"] <= full["bytes"] / 2
    for label, name in enumerate(kept.identities):
        assert np.count_nonzero(kept.labels == label) == np.count_nonzero(labels == identities.index(name))


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_pack") / "pack"
    script = REPO_ROOT / "bench" / "gpu_pack.py"
    command = [
        sys.executable,
        str(script),
        "--synthetic",
        "160",
        "--identities",
        "8",
        "--pairs-per-fold",
        "4",
    ]
    subprocess.run([*command, "--out", str(out)], check=True, cwd=REPO_ROOT, timeout=120)
    return out


def test_the_whole_check_runs_tiny_on_the_cpu_and_ends_with_its_table(tiny_pack, tmp_path):
    # As the GPU machine runs it: the script by path, PYTHONPATH=. (bench/models.py must not hide models/).
    command = [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--pack", str(tiny_pack)]
    env = {**os.environ, "PYTHONPATH": "."}
    done = subprocess.run(
        [*command, "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.lstrip().startswith("| check | status | s | result |")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    default = [s for s in gpu_check.SECTIONS if s not in ("compile", *gpu_check.OPT_IN)]
    assert [s["section"] for s in report["sections"]] == default
    statuses = {row["label"]: row["status"] for s in report["sections"] for row in s["rows"]}
    assert set(statuses.values()) <= {"ok", "n/a"}, statuses
    rows = {row["label"]: row["result"] for s in report["sections"] for row in s["rows"]}
    assert rows["resume at step 1 = uninterrupted"] == "bit-exact"
    assert rows["streaming loader = GPU-resident loader"] == "bit-exact"
    for label in (
        "train SphereFace+ from the m=4 run", "export + ONNX parity", "LFW subset: device vs ONNX",
        "training img/s, batch 8", "arithmetic floor", "MegaFace search, 20,000 distractors",
    ):  # fmt: skip
        assert label in rows
    assert (tmp_path / "gpu_check.md").read_text().startswith("| check |")


def test_the_long_run_sends_its_weights_home_in_parts_that_export_reads(tiny_pack, tmp_path, monkeypatch):
    from bench import gpu_long, gpu_long_import, gpu_long_plot

    monkeypatch.setattr(gpu_long, "PART_BYTES", 100_000)  # several parts from a tiny network
    argv = ["--device", "cpu", "--pack", str(tiny_pack), "--out", str(tmp_path), "--sections", "long"]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    long = next(s for s in report["sections"] if s["section"] == "long")
    assert long["status"] == "ok" and len(long["details"]["parts"]) >= 2
    assert len(long["details"]["curve"]["loss"]) == TINY.long_steps
    assert len(long["details"]["curve"]["feature_norm"]) == TINY.long_steps
    assert gpu_long_plot.main([str(tmp_path / "gpu_check.json"), "--out", str(tmp_path / "long.png")]) == 0
    assert (tmp_path / "long.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = gpu_long_import.read_parts(tmp_path)
    checkpoint = gpu_long_import.to_checkpoint(state)
    assert checkpoint["step"] == TINY.long_steps and state["travelled_as"] == "fp16"
    assert all(v.dtype != torch.float16 for v in checkpoint["net"].values())
    saved = _saved(checkpoint, tmp_path / "run")
    _, report = export_checkpoint(saved, tmp_path / "model", progress=False)
    assert report["onnx_parity_max_abs_diff"] < 1e-3 and (tmp_path / "model" / "model.onnx").is_file()
    (tmp_path / f"{gpu_long.PART_PREFIX}1").unlink()
    with pytest.raises(SystemExit, match="are not 0.."):
        gpu_long_import.read_parts(tmp_path)


def _saved(checkpoint, folder):
    folder.mkdir()
    torch.save(checkpoint, folder / "checkpoint.pt")
    return folder / "checkpoint.pt"


def test_sections_that_do_not_fit_the_budget_are_skipped_and_the_table_still_prints(
    tiny_pack, tmp_path, capsys
):
    argv = ["--device", "cpu", "--pack", str(tiny_pack), "--out", str(tmp_path), "--budget", "3"]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {s["status"] for s in report["sections"]} == {"skipped"}
    assert "| environment | skipped |" in capsys.readouterr().out


def test_a_section_that_fails_or_overruns_keeps_what_it_found(tiny_pack, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "ALARM_GRACE_S", 0.0)
    check = Check(
        gpu_check.torch.device("cpu"), TINY, read_pack(tiny_pack), tmp_path, time.perf_counter() + 60
    )

    def slow(check, until, rows, details):
        rows.append(Row("first part", "ok", "done"))
        time.sleep(30)

    def broken(check, until, rows, details):
        rows.append(Row("first part", "ok", "done"))
        raise ValueError("the second part broke")

    started = time.perf_counter()
    status, rows, details = gpu_check._run_section("slow", slow, check, budget=1.0)
    assert time.perf_counter() - started < 10
    assert (
        status == "FAIL" and [r.status for r in rows] == ["ok", "FAIL"] and "SectionTimeout" in rows[1].result
    )
    status, rows, _ = gpu_check._run_section("broken", broken, check, budget=1.0)
    assert status == "FAIL" and rows[0].label == "first part" and "the second part broke" in rows[1].result


def test_the_dataloader_baseline_holds_at_most_half_of_dev_shm_in_flight():
    from bench.gpu_speed import loader_settings

    batch_bytes = 512 * 3 * 112 * 96 * 4
    assert loader_settings(16, 512, 64 * 2**30) == (16, 4)  # 2.1 GB in flight of 64 GiB
    assert loader_settings(16, 512, None) == (16, 4)
    workers, prefetch = loader_settings(16, 512, 2 * 2**30)
    assert (
        prefetch == 2 and workers * prefetch * batch_bytes <= 2**30 < (workers + 1) * prefetch * batch_bytes
    )


def test_a_variant_that_breaks_fails_its_row_and_keeps_the_others_numbers(tiny_pack, tmp_path):
    from bench.gpu_speed import _batch_row

    check = Check(
        gpu_check.torch.device("cpu"), TINY, read_pack(tiny_pack), tmp_path, time.perf_counter() + 60
    )
    rate = {"median": 100.0, "min": 90.0, "max": 110.0, "rounds": 3}
    result = {
        "GPU-resident loader": rate,
        "streaming loader": rate,
        "DataLoader + PIL": {"error": "Bus error"},
    }
    row = _batch_row(256, result, check)
    assert row.status == "FAIL" and "DataLoader + PIL FAILED (Bus error)" in row.result
    assert "GPU-resident loader 100 (90-110)" in row.result and check.found["best_images_per_s"] == 100.0
