"""The benchmarks time facenet-pytorch's NMS calls again in the real torchvision
(bench/torchvision_nms.py): calls recorded per item, timed in another Python, summed per item."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from bench import torchvision_standin as standin
from bench.facenet_env import write_standin_package
from bench.torchvision_nms import load_calls, real_nms_per_item, record_per_item, save_calls


def _nms_calls(count: int, seed: int) -> None:
    """``count`` stand-in batched_nms calls on random overlapping boxes in two categories."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        corner = rng.uniform(0, 10, (40, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(20, 30, (40, 2))], axis=1)
        standin.batched_nms(
            torch.tensor(boxes, dtype=torch.float32),
            torch.tensor(rng.uniform(size=40), dtype=torch.float32),
            torch.tensor(rng.integers(0, 2, 40)),
            0.5,
        )


def test_calls_are_recorded_per_item_and_saved_whole(tmp_path):
    groups = record_per_item(standin, lambda n: _nms_calls(n, seed=n), [3, 0, 5])
    assert [len(g) for g in groups] == [3, 0, 5]
    assert standin.RECORD is None  # recording stops afterwards
    call = groups[0][0]
    assert call["boxes"].shape == (40, 4) and call["iou_threshold"] == 0.5
    assert 0 < len(call["kept"]) < 40  # random overlapping boxes: some suppressed
    save_calls(tmp_path / "calls.npz", [c for g in groups for c in g])
    loaded = load_calls(tmp_path / "calls.npz")
    assert len(loaded) == 8
    for a, b in zip(loaded, [c for g in groups for c in g], strict=True):
        for key in ("boxes", "scores", "idxs", "kept"):
            np.testing.assert_array_equal(a[key], b[key])


def test_the_other_python_times_each_call_and_checks_the_kept_boxes(tmp_path, monkeypatch):
    groups = record_per_item(standin, lambda n: _nms_calls(n, seed=10 + n), [2, 0, 3])
    # The stand-in plays torchvision in the other Python here (the benchmarks use the real one).
    write_standin_package(tmp_path / "env")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "env"))
    out = real_nms_per_item(groups, threads=1, python=Path(sys.executable), repeats=2)
    assert out["torchvision"] == "0.0+bench-standin" and out["calls"] == 5
    assert out["same_kept_as_standin"] == 5
    seconds = out["per_item_seconds"]
    assert len(seconds) == 3 and seconds[1] == 0.0 and seconds[0] > 0 and seconds[2] > 0
    assert out["mean_ms_per_item"] == np.mean(seconds) * 1e3
    # A call whose recorded answer differs is counted as a disagreement.
    groups[2][0]["kept"] = groups[2][0]["kept"][:-1]
    assert real_nms_per_item(groups, 1, python=Path(sys.executable), repeats=1)["same_kept_as_standin"] == 4
    assert real_nms_per_item(groups, 1, python=tmp_path / "no-such-python") is None
