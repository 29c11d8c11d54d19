"""Where a request's time goes: stages of the app timed by wrapping its functions, and the
app's own ``/metrics`` stage and request histograms read before and after."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from models.align import align_faces


class StageTimer:
    """Wraps functions and methods to add up the time spent in named stages (outermost call only).

    Calls from several threads at once (``/v1/verify`` detects its two photos side by side) each
    add their own time, so a stage's seconds are added up over threads and can exceed wall time;
    ``busy_seconds`` is the wall time during which any thread was in a timed stage.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.busy_seconds = 0.0
        self._local = threading.local()  # per thread: how deep in timed stages it is
        self._lock = threading.Lock()
        self._inside = 0  # threads in a timed stage now
        self._busy_since = 0.0
        self._undo: list[Callable[[], None]] = []

    def _enter(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._inside == 0:
                self._busy_since = now
            self._inside += 1
        return now

    def _leave(self, stage: str, t0: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.seconds[stage] += now - t0
            self.calls[stage] += 1
            self._inside -= 1
            if self._inside == 0:
                self.busy_seconds += now - self._busy_since

    def _wrap(self, stage: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth:  # inside another timed stage of this thread: counted there
                return fn(*args, **kwargs)
            self._local.depth = 1
            t0 = self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0
                self._leave(stage, t0)

        return timed

    def patch(self, owner: Any, attr: str, stage: str) -> None:
        original = getattr(owner, attr)
        own = attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, self._wrap(stage, original))
        self._undo.append(lambda: setattr(owner, attr, original) if own else delattr(owner, attr))

    def patch_everywhere(self, function: Callable, stage: str, prefixes: Sequence[str]) -> list[str]:
        """Patch every loaded module under ``prefixes`` that imported ``function`` by name."""
        patched = []
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(tuple(prefixes)):
                continue
            if getattr(module, function.__name__, None) is function:
                self.patch(module, function.__name__, stage)
                patched.append(name)
        return patched

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.busy_seconds = 0.0


def instrument_app(app, timer: StageTimer) -> None:
    """Time decode / detect / align / embed inside the app (its pipeline and route modules)."""
    from models.image import decode_image

    pipeline = app.state.pipeline
    for attr in ("detect", "detect_batch", "detect_largest"):
        if hasattr(pipeline.detector, attr):
            timer.patch(pipeline.detector, attr, "detect")
    for attr in ("embed", "raw"):
        if hasattr(pipeline.embedder, attr):
            timer.patch(pipeline.embedder, attr, "embed")
    timer.patch_everywhere(decode_image, "decode", ("service.", "models.pipeline"))
    timer.patch_everywhere(align_faces, "align", ("service.", "models.pipeline"))


def scrape_metrics(client) -> dict[str, float] | None:
    """``/metrics`` as ``{sample name + labels: value}``, or None when the app has none."""
    response = client.get("/metrics")
    if response.status_code != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def metrics_stage_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]]:
    """Per stage of ``sphereface_stage_duration_seconds``: seconds and count added in between."""
    if not before or not after:
        return {}
    out: dict[str, dict[str, float]] = {}
    prefix = "sphereface_stage_duration_seconds_"
    for key, value in after.items():
        for part in ("sum", "count"):
            head = f"{prefix}{part}{{stage="
            if key.startswith(head):
                stage = key[len(head) : -1]
                delta = value - before.get(key, 0.0)
                out.setdefault(stage, {})["seconds" if part == "sum" else "count"] = delta
    return {k: v for k, v in out.items() if v.get("count", 0) > 0}


def metrics_request_delta(before: dict | None, after: dict | None, route: str) -> dict[str, float] | None:
    if not before or not after:
        return None
    found = {}
    for part in ("sum", "count"):
        for key, value in after.items():
            if key.startswith(f"sphereface_request_duration_seconds_{part}{{") and f"route={route}" in key:
                found[part] = value - before.get(key, 0.0)
    if found.get("count"):
        return {"seconds": found["sum"], "count": found["count"]}
    return None
