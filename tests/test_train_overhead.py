"""bench/train_overhead.py: the trainer's own step against a bare loop, on a tiny prepared set."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


@pytest.mark.shared_data
@pytest.mark.slow
def test_overhead_bench_times_the_three_loops_interleaved_and_writes_its_command(tiny_prepared, tmp_path):
    from bench.train_overhead import VARIANTS, main

    out = tmp_path / "overhead.json"
    argv = ["--set", f"data={tiny_prepared.path}", "--set", "batch_size=4", "--set", "network=sphereface4",
            "--rounds", "3", "--steps", "1", "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].endswith(" ".join(argv))
    assert report["network"] == "sphereface4" and report["batch_size"] == 4
    assert list(report["results"]) == list(VARIANTS)
    bare = report["results"]["bare"]
    assert bare["ratio_to_bare"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    for result in report["results"].values():
        rates = result["per_round_images_per_s"]
        assert len(rates) == 3 and all(rate > 0 for rate in rates)
        spread = result["images_per_s"]
        assert spread["min"] <= spread["median"] <= spread["max"]
