"""Where a detector spends its time: one pass under cProfile, with the time inside each ORT
session added up over the threads that ran it."""

from __future__ import annotations

import cProfile
import pstats
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.face_path_settings import DETECT_WARMUP, FACTOR, MIN_FACE, THRESHOLDS
from bench.paths import REPO
from models.mtcnn import MTCNNDetector


class _Tally:
    """Seconds and calls added up from any thread, and the threads they came from."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1
            self.threads.add(threading.get_ident())


class _TimedSession:
    """Wraps an ORT session to add up the time spent in ``run`` (for the profile pass); wrappers
    given the same ``tally`` add into one total."""

    def __init__(self, session, tally: _Tally | None = None) -> None:
        self._session = session
        self.tally = tally if tally is not None else _Tally()

    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._session.run(*args, **kwargs)
        finally:
            self.tally.add(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._session, name)


def _top_functions(profile: cProfile.Profile, count: int, per: int) -> list[dict[str, Any]]:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        if filename == "~":
            where = func
        else:
            path = Path(filename)
            try:
                path = path.relative_to(REPO)
            except ValueError:
                path = Path(path.name)
            where = f"{path}:{line}({func})"
        rows.append((tottime, where, calls, cumtime))
    rows.sort(reverse=True)
    return [
        {
            "function": w,
            "calls_per_image": c / per,
            "self_ms_per_image": t / per * 1e3,
            "cum_ms_per_image": ct / per * 1e3,
        }
        for t, w, c, ct in rows[:count]
    ]


def profile_ours(images: list[np.ndarray], threads: int) -> dict[str, Any]:
    """One pass of our detector under cProfile, with time inside each ORT session measured.

    With more than one thread the detector runs pyramid levels and network chunks in threads of
    its own, on one-thread copies of the networks: a network's time is then added up over the
    threads (it overlaps the rest, so there is no "outside ORT" remainder), and cProfile sees the
    calling thread only."""
    det = MTCNNDetector(
        "cpu", min_face_size=MIN_FACE, thresholds=THRESHOLDS, scale_factor=FACTOR, intra_op_threads=threads
    )
    for img in images[:DETECT_WARMUP]:
        det.detect(img)
    tallies = {name: _Tally() for name in ("pnet", "rnet", "onet")}
    for name, tally in tallies.items():
        setattr(det, name, _TimedSession(getattr(det, name), tally))
        det._one_thread[name] = _TimedSession(det._one_thread[name], tally)
    t0 = time.perf_counter()
    plain = [det.detect(img) for img in images]
    wall = time.perf_counter() - t0
    del plain
    ort_s = {name: tally.seconds for name, tally in tallies.items()}
    overlapped = any(tally.threads - {threading.get_ident()} for tally in tallies.values())
    prof = cProfile.Profile()
    prof.enable()
    for img in images:
        det.detect(img)
    prof.disable()
    n = len(images)
    ort_total = sum(ort_s.values())
    return {
        "ort_intra_op_threads": threads,
        "ms_per_image_unprofiled": wall / n * 1e3,
        "ort_run_ms_per_image": {k: v / n * 1e3 for k, v in ort_s.items()},
        "ort_overlaps_the_rest": overlapped,
        "outside_ort_ms_per_image": None if overlapped else (wall - ort_total) / n * 1e3,
        "top_functions": _top_functions(prof, 12, n),
    }


def profile_facenet(fnp, images: list[np.ndarray], threads: int) -> dict[str, Any]:
    """One cProfile'd pass of facenet-pytorch (at ``threads`` torch threads) over ``images``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prof = cProfile.Profile()
        prof.enable()
        for img in images:
            fnp.detect(img, landmarks=True)
        prof.disable()
    finally:
        torch.set_num_threads(before)
    return {
        "torch_threads": threads,
        "images": len(images),
        "top_functions": _top_functions(prof, 8, len(images)),
    }
