"""The benchmarks report a ratio per interleaved pass (median, min, max), not one best figure."""

from __future__ import annotations

import numpy as np

from bench.face_path_report import _spread
from bench.timing import pass_ratio_spread


def test_every_pass_gives_one_ratio_and_the_spread_is_reported():
    ours = np.array([[1.0, 1.0], [1.0, 3.0], [2.0, 2.0], [1.0, 1.0], [0.5, 0.5]])
    theirs = np.array([[2.0, 2.0], [4.0, 4.0], [3.0, 3.0], [1.5, 1.5], [2.0, 2.0]])
    spread = pass_ratio_spread(theirs, ours, np.mean)
    assert spread["passes"] == 5
    assert spread["min"] == 1.5 and spread["max"] == 4.0 and spread["median"] == 2.0
    assert _spread({"same_threads_per_pass": spread}) == "2.00x (1.50-4.00)"
    assert _spread({}) == "-"
