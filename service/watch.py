"""``sphereface watch SOURCE``: identify the people in a video file, a stream or a camera until it
ends or is stopped, one decision per track, as lines of JSON and as ``track.started`` /
``track.ended`` events on the event stream (which ``sphereface serve`` delivers to the webhooks).

A file is read once. A stream or device that breaks off or goes silent is opened again after a
wait that doubles from 1 s up to ``--reconnect-max`` seconds (its tracks end at the break), until
``--max-reconnects`` tries in a row failed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from models.errors import SphereFaceError
from models.tracking import Track
from models.video import UnreadableVideoError, VideoLimits, is_network_source, sample_frames
from models.video_faces import VideoFaces, decide_tracks
from service.events.stream import TRACK_ENDED, TRACK_STARTED, EventStream
from service.video import (
    keep_unknown_tracks,
    track_ended_data,
    track_schema,
    track_started_data,
    tracker_settings,
    video_faces,
    video_limits,
)

log = logging.getLogger(__name__)


@dataclass
class WatchOptions:
    """What ``watch`` was asked: the source, its sampling, the decision rule and the reconnects."""

    source: str
    sample_fps: float | None = None
    min_faces: int | None = None
    threshold: float | None = None
    k: int = 1
    reconnect_max_s: float = 60.0
    max_reconnects: int = 10
    progress: bool = True


def is_live(source: str) -> bool:
    """A stream or a device (read until stopped, reconnected), not a file."""
    return is_network_source(source) or source.startswith("/dev/")


class Watcher:
    """One source watched with one model against the gallery; tracks out as they end.

    Args:
        pipeline: the face pipeline.
        search: the gallery search (``search(vectors, k)``) and ``names(ids)``.
        events: the event stream (None: no events).
        settings: the service settings (limits, tracker rule).
        out: where each decided track goes as a line of JSON.
    """

    def __init__(self, pipeline, search, names, events: EventStream | None, settings, options: WatchOptions,
                 out: IO[str], unknowns=None) -> None:  # fmt: skip
        self.pipeline, self.search, self.names, self.events = pipeline, search, names, events
        self.unknowns = unknowns
        self.settings = settings
        self.options, self.out = options, out
        manifest = pipeline.manifest
        self.rule = tracker_settings(settings, manifest, options.min_faces)
        self.threshold = options.threshold if options.threshold is not None else _model_threshold(manifest)
        live = is_live(options.source)
        self.limits: VideoLimits = video_limits(settings, options.sample_fps, live=live)
        self.decided = 0
        self.known = 0

    def run(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Watch until the source ends (a file), ``stop()`` says so, or reconnecting gave up;
        returns the tracks decided."""
        failures, wait = 0, 1.0
        while not stop():
            try:
                for _ in self._session(stop):
                    failures, wait = 0, 1.0
                if not is_live(self.options.source):
                    break
                raise UnreadableVideoError(f"{self.options.source} ended")
            except UnreadableVideoError as exc:
                if not is_live(self.options.source) or failures >= self.options.max_reconnects:
                    raise
                failures += 1
                log.warning("%s; opening it again in %.0f s (try %d)", exc.message, wait, failures)
                _sleep(wait, stop)
                wait = min(2 * wait, self.options.reconnect_max_s)
        return self.decided

    def _session(self, stop: Callable[[], bool]) -> Iterator[None]:
        """One opening of the source: frames through the tracker until it ends or breaks."""
        faces = video_faces(self.pipeline, self.settings, self.rule, keep_regions=self.unknowns is not None)
        try:
            for frame in sample_frames(self.options.source, self.limits):
                started, ended = faces.frame(frame)
                self._started(started)
                self._ended(ended)
                self._progress(frame.time_s, faces)
                yield
                if stop():
                    break
        finally:
            self._ended(faces.tracker.finish())
            if self.options.progress:
                print(file=sys.stderr)

    def _started(self, tracks: list[Track]) -> None:
        if self.events is not None and tracks:
            self.events.publish_many(
                TRACK_STARTED, [track_started_data(t, self.options.source) for t in tracks]
            )

    def _ended(self, tracks: list[Track]) -> None:
        """Decide the tracks that ended, print them and send their events."""
        decisions, _ = decide_tracks(tracks, self.search, self.threshold, self.rule, self.options.k)
        if not decisions:
            return
        names = self.names(sorted({h.subject_id for d in decisions for h in d.candidates}))
        answers = [track_schema(d, names, self.rule.best_n) for d in decisions]
        if self.unknowns is not None:
            keep_unknown_tracks(self.unknowns, decisions, answers, self.options.source, "", self.rule.best_n)
        for track in answers:
            self.decided += 1
            self.known += track.status == "known"
            self.out.write(json.dumps(track.model_dump(exclude={"path"})) + "\n")
            self.out.flush()
        if self.events is not None:
            model = self.pipeline.manifest.model_id
            self.events.publish_many(
                TRACK_ENDED, [track_ended_data(t, self.options.source, model) for t in answers]
            )

    def _progress(self, time_s: float, faces: VideoFaces) -> None:
        if not self.options.progress:
            return
        times = faces.times
        print(
            f"\r{self.options.source}: {time_s:7.1f} s, {times.frames} frames, {times.faces} faces, "
            f"{len(faces.tracker.live)} live tracks, {self.decided} decided ({self.known} known)",
            end="", file=sys.stderr, flush=True,
        )  # fmt: skip


def _model_threshold(manifest) -> float:
    known = manifest.thresholds.get("identification") or manifest.thresholds.get("verification")
    if known is None:
        raise SphereFaceError(f"model {manifest.model_id} has no calibrated threshold: pass --threshold")
    return known.value


def _sleep(seconds: float, stop: Callable[[], bool]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop():
        time.sleep(min(0.2, end - time.monotonic()))


@contextmanager
def gallery_search(settings, manifest) -> Iterator[tuple]:
    """The gallery's search, names, event stream and unknown-face pool (None unless
    ``SPHEREFACE_KEEP_UNKNOWN``) for ``watch`` (the Redis of the settings)."""
    from service.app import make_search
    from service.gallery.store import GalleryStore
    from service.main import gallery_client_of
    from service.unknowns.pool import pool_for

    with gallery_client_of(settings) as client:
        store = GalleryStore(client, settings.redis_prefix)
        search = make_search(settings, store, manifest.model_id, manifest.output_size)
        events = EventStream(client, settings.redis_prefix, maxlen=settings.events_stream_maxlen)
        yield search.search, store.subject_names, events, pool_for(settings, manifest, client)
