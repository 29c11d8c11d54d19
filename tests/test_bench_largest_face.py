"""bench/largest_face.py: its agreement and timing tables say what the two searches did."""

from __future__ import annotations

import numpy as np
import pytest

from models.image import read_image
from models.mtcnn import MTCNNDetector


@pytest.mark.shared_data
def test_the_largest_face_bench_reports_agreement_and_speed(photos_dir):
    from bench.largest_face import WAYS, agreement, box_iou, time_rounds

    paths = sorted((photos_dir / "people").rglob("*.jpg"))[:4]
    images = [read_image(p) for p in paths]
    detector = MTCNNDetector(max_image_side=1024, intra_op_threads=1)
    report = agreement(detector, [p.name for p in paths], images)
    assert report["photos"] == report["found_by_both"] == report["identical_landmarks"] == 4
    assert report["min_box_iou"] == 1.0 and report["max_landmark_shift_of_side"] == 0.0
    blank = np.full((200, 200, 3), 128, np.uint8)
    assert agreement(detector, ["blank"], [blank])["found_by_both"] == 0

    speed = time_rounds(detector, images, rounds=1)
    for kind in ("one_photo", "two_photos_side_by_side"):
        assert set(speed[kind]) == set(WAYS) and all(speed[kind][w]["median_ms"] > 0 for w in WAYS)
        ratio = speed[kind]["full"]["median_ms"] / speed[kind]["coarse-to-fine"]["median_ms"]
        assert speed["speedup_median"][kind] == pytest.approx(ratio)
    assert box_iou(np.array([0, 0, 9, 9]), np.array([5, 0, 14, 9])) == pytest.approx(50 / 150)
