"""Jobs that fill the same cache take turns (training/locks.py): the LFW landmark cache here, the
MegaFace row caches in tests/test_megaface.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from training import locks
from training.evaluation.cache import _save_landmark_cache, detected_landmarks_key, detected_lfw_landmarks


def test_a_second_holder_waits_for_the_first(tmp_path):
    held = []

    def hold(label: str) -> None:
        with locks.exclusive(tmp_path / "x.lock", "testing"):
            held.append((label, "in", time.monotonic()))
            time.sleep(0.2)
            held.append((label, "out", time.monotonic()))

    first = threading.Thread(target=hold, args=("a",))
    first.start()
    time.sleep(0.05)
    hold("b")  # another descriptor: blocks until the thread lets go, even in the same process
    first.join()
    assert [(label, what) for label, what, _ in held] == [
        ("a", "in"),
        ("a", "out"),
        ("b", "in"),
        ("b", "out"),
    ]


@pytest.mark.shared_data
def test_lfw_landmarks_wait_for_the_job_detecting_them_and_reuse_its_file(lfw_dir, tmp_path):
    names = sorted(
        p.relative_to(lfw_dir / "images").as_posix() for p in (lfw_dir / "images").glob("A*/*_0001.jpg")
    )[:3]
    key_json = json.dumps(detected_landmarks_key(lfw_dir, names, "cpu"), sort_keys=True)
    # Stand in for another job: hold the cache's lock, then write the file it would write. The
    # call started meanwhile must wait and return that file's (made-up) landmarks, not detect.
    _, _, path = detected_lfw_landmarks(lfw_dir, names, cache_dir=tmp_path / "probe", workers=1)
    path = tmp_path / "cache" / path.name
    path.parent.mkdir()
    result = {}

    def call() -> None:
        result["points"], _, result["path"] = detected_lfw_landmarks(
            lfw_dir, names, cache_dir=path.parent, workers=1
        )

    made_up = np.full((3, 5, 2), 7.0)
    with locks.exclusive(path.with_suffix(".lock"), "testing"):
        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(1.0)
        assert caller.is_alive() and not result  # waiting, not detecting
        _save_landmark_cache(path, key_json, names, made_up, np.ones(3, dtype=bool))
    caller.join(60)
    np.testing.assert_array_equal(result["points"], made_up)
    assert result["path"] == path
