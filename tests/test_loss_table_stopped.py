"""training/loss_table.py on a run the trainer stopped: a row that says where and why, its curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.loss_table import collect, main, markdown, merge_rows
from training.run_log import LOG_COLUMNS

LOG_HEADER = ",".join(LOG_COLUMNS)


def _finished(tmp_path: Path) -> Path:
    folder = tmp_path / "m4"
    folder.mkdir()
    summary = {
        "name": "m4", "head": "asoftmax", "head_options": {"m": 4}, "seed": 0, "network": "sphereface4",
        "steps": 2000, "batch_size": 64, "epochs": 9.6, "lfw": {"accuracy": 0.85, "std": 0.015},
        "final": {"accuracy": 0.95, "feature_norm": 24.3},
    }  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "log.csv").write_text(f"{LOG_HEADER}\n50,0,8.0,0.01,315.9,,,5.8,0.025,40,,,70\n")
    return folder


def _stopped(tmp_path: Path) -> Path:
    folder = tmp_path / "m4_caffe_seed1"
    folder.mkdir()
    (folder / "config.toml").write_text(
        'name = "m4_caffe_seed1"\nnetwork = "sphereface4"\nhead = "asoftmax"\n'
        'head_options = { m = 4, backward = "caffe" }\nbatch_size = 64\nsteps = 2000\nseed = 1\n'
    )
    (folder / "stopped.json").write_text(json.dumps({
        "step": 1700, "reason": "FloatingPointError",
        "message": "loss became nan at step 1700; lower lr or the MHE weight (the last good checkpoint is x)",
    }))  # fmt: skip
    rows = ["50,0,8.0,0.01,315.9,,,5.8,0.025,40,,,70", "1700,8,nan,0.6,5.0,,,nan,0.0025,72,,,3380"]
    (folder / "log.csv").write_text(LOG_HEADER + "\n" + "\n".join(rows) + "\n")
    return folder


def test_a_stopped_run_gets_a_row_that_says_where_and_why_after_the_finished_one(tmp_path):
    rows = collect([_stopped(tmp_path), _finished(tmp_path)])
    assert [r["run"] for r in rows] == ["m4", "m4_caffe_seed1"]
    stopped = rows[1]
    assert stopped["loss"] == (
        "A-Softmax m = 4, the Caffe layer's backward, seed 1, stopped: loss became nan at step 1700"
    )
    assert stopped["stopped_at"] == 1700 and stopped["stop_reason"] == "FloatingPointError"
    assert stopped["lfw_accuracy"] is None and stopped["final_train_accuracy"] is None
    line = markdown(rows).splitlines()[3]
    assert line.startswith("| A-Softmax m = 4, the Caffe layer's backward, seed 1, stopped:")
    assert line.endswith("| – | – | – | – | – | – / – | – | – |")
    # a kept table (rows of runs that are gone) takes the stopped row beside its own
    kept = merge_rows([rows[0]], [stopped], "kept.json")
    assert [r["run"] for r in kept] == ["m4", "m4_caffe_seed1"]


def test_the_curves_include_the_stopped_run_and_an_unfinished_run_is_still_refused(tmp_path):
    out = tmp_path / "curves.png"
    assert main([str(_finished(tmp_path)), str(_stopped(tmp_path)), "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    (tmp_path / "running").mkdir()
    with pytest.raises(FileNotFoundError, match="has not finished"):
        collect([tmp_path / "running"])


def test_a_row_trained_at_another_lr_says_so_and_sorts_after_the_table_lr(tmp_path):
    (tmp_path / "half").mkdir()
    table_lr, lower_lr = _finished(tmp_path), _finished(tmp_path / "half")
    (table_lr / "config.toml").write_text('name = "m4"\nlr = 0.025\n')
    (lower_lr / "config.toml").write_text('name = "m4"\nlr = 0.0125\n')
    summary = json.loads((lower_lr / "summary.json").read_text())
    (lower_lr / "summary.json").write_text(json.dumps({**summary, "name": "m4_lr0p0125"}))
    rows = collect([lower_lr, table_lr])
    assert [r["loss"] for r in rows] == ["A-Softmax m = 4", "A-Softmax m = 4, lr 0.0125"]
