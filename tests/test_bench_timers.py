"""The benchmarks' timers count work done in several threads at once."""

from __future__ import annotations

import threading
import time
import types

import pytest

pytest.importorskip("torch")  # bench.detector_profile imports it


def test_the_stage_timer_counts_calls_made_in_two_threads_at_once():
    from bench.stage_timer import StageTimer

    timer = StageTimer()
    both_inside = threading.Barrier(2)
    owner = types.SimpleNamespace()

    def detect():
        both_inside.wait(timeout=5)  # each call is inside the stage while the other one is
        time.sleep(0.05)

    def align():
        owner.detect()  # a timed stage inside another one: counted once, as align

    owner.detect, owner.align = detect, align
    timer.patch(owner, "detect", "detect")
    timer.patch(owner, "align", "align")
    threads = [threading.Thread(target=owner.detect) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert timer.calls["detect"] == 2
    assert timer.seconds["detect"] >= 0.1  # added up over the two threads
    # the wall time in a stage: the two calls overlapped, so less than their sum
    assert 0.05 <= timer.busy_seconds < timer.seconds["detect"] - 0.02
    both_inside = threading.Barrier(1)
    owner.align()
    assert timer.calls == {"detect": 2, "align": 1}
    timer.restore()
    assert owner.detect is detect and owner.align is align


@pytest.mark.shared_data
def test_the_detector_profile_counts_the_networks_run_in_the_detectors_threads(photos_dir):
    from bench.detector_profile import profile_ours
    from models.image import read_image

    photos = sorted(p for p in photos_dir.rglob("*.jpg"))[:4]
    images = [read_image(p, max_pixels=50_000_000) for p in photos]
    assert min(i.shape[0] * i.shape[1] for i in images) > 250_000
    serial, threaded = profile_ours(images, 1), profile_ours(images, 2)
    assert serial["outside_ort_ms_per_image"] > 0 and not serial["ort_overlaps_the_rest"]
    assert threaded["outside_ort_ms_per_image"] is None and threaded["ort_overlaps_the_rest"]
    for name in ("pnet", "rnet", "onet"):
        # the same calls on the same pixels: the time inside ORT is of the same order both ways
        ratio = threaded["ort_run_ms_per_image"][name] / serial["ort_run_ms_per_image"][name]
        assert 0.3 < ratio < 3, (name, ratio)
    small = [image[:300, :300] for image in images]  # under 250,000 pixels: one thread does it all
    assert profile_ours(small, 2)["outside_ort_ms_per_image"] > 0
