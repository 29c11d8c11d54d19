"""Frames of a video at a chosen rate: a clip's bytes or file, an RTSP/HTTP stream, or a camera device.

Decoding uses PyAV (the ``video`` extra: ``pip install '.[video]'``), whose wheels bundle FFmpeg;
see docs/guides/video.md for its licence. Frames are sampled on the stream's own clock
(presentation time), so a clip's sampled frames are the same whatever its frame rate; only the
sampled frames are converted to RGB. Every bound is checked while reading, not only from the
header, since a header can lie: the clip's duration, the sampled frames, the pixels of a frame.
A network source opens and reads under timeouts, so a silent camera is an error, never a hang.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import FacePathError

#: Sources PyAV opens as network streams (they get the open and read timeouts).
NETWORK_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://", "srt://")


class UnreadableVideoError(FacePathError):
    """The bytes, file or stream is no video PyAV can decode, or it broke off while reading."""

    code = "unreadable_video"


class VideoTooLargeError(FacePathError):
    """A clip over the byte limit, or frames over the pixel limit."""

    code = "video_too_large"


class VideoTooLongError(FacePathError):
    """A clip longer than the duration limit, or with more sampled frames than allowed."""

    code = "video_too_long"


class VideoDependencyError(FacePathError):
    """PyAV is not installed (the ``video`` extra)."""

    code = "missing_dependency"


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost.

    Attributes:
        sample_fps: frames kept per second of the video's clock.
        max_seconds: longest clip (None: no bound, for live sources).
        max_frames: most sampled frames (None: no bound).
        max_pixels: most pixels in one frame.
        open_timeout_s / read_timeout_s: a network source's timeouts (seconds).
    """

    sample_fps: float = 5.0
    max_seconds: float | None = 120.0
    max_frames: int | None = 1200
    max_pixels: int = 1920 * 1088
    open_timeout_s: float = 10.0
    read_timeout_s: float = 10.0


@dataclass
class VideoFrame:
    """One sampled frame: its number among the sampled ones, its time on the video's clock
    (seconds from the first frame) and its RGB pixels (H x W x 3, uint8)."""

    index: int
    time_s: float
    image: np.ndarray


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # the video extra is optional
        raise VideoDependencyError(
            "video needs the Python package `av` (PyAV): pip install 'sphereface[video]'"
        ) from exc
    return av


def is_network_source(source: Any) -> bool:
    return isinstance(source, str) and source.lower().startswith(NETWORK_SCHEMES)


def _open(source: str | Path | bytes, limits: VideoLimits, name: str):
    """The opened container (PyAV), with timeouts for network sources and v4l2 for devices."""
    av = _av()
    options: dict[str, Any] = {}
    target: Any = source
    if isinstance(source, bytes):
        target = io.BytesIO(source)
    elif is_network_source(source):
        options["timeout"] = (limits.open_timeout_s, limits.read_timeout_s)
    elif str(source).startswith("/dev/video"):
        options["format"] = "v4l2"
    try:
        return av.open(target, mode="r", **options)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise UnreadableVideoError(f"{name} cannot be opened as a video: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """FFmpeg's words for an error (without its errno and file name), at most 200 characters."""
    text = (getattr(exc, "strerror", None) or str(exc)).strip() or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _check_header(container, stream, limits: VideoLimits, name: str) -> None:
    """Refuse from the header what is plainly over the limits (the reading checks again)."""
    seconds = None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    if limits.max_seconds is not None and seconds is not None and seconds > limits.max_seconds + 1e-3:
        raise VideoTooLongError(
            f"{name} lasts {seconds:.1f} s; at most {limits.max_seconds:g} s are accepted"
        )
    width, height = stream.codec_context.width or 0, stream.codec_context.height or 0
    if width * height > limits.max_pixels:
        raise VideoTooLargeError(
            f"{name} has {width}x{height} frames; at most {limits.max_pixels:,} pixels a frame are accepted"
        )


def sample_frames(
    source: str | Path | bytes, limits: VideoLimits = VideoLimits(), *, name: str | None = None
) -> Iterator[VideoFrame]:
    """The frames of ``source`` at ``limits.sample_fps`` on the video's clock.

    Args:
        source: a clip's bytes, a file path, an RTSP/HTTP/... URL, or a device (``/dev/video0``).
        limits: the bounds; a network source gets the timeouts.
        name: how errors name the source (default: the path or URL; ``video`` for bytes).

    Raises:
        UnreadableVideoError: no video stream, undecodable or truncated data, a stream that broke
            off or went silent past the read timeout.
        VideoTooLongError, VideoTooLargeError: over ``limits`` (header or while reading).
        VideoDependencyError: PyAV is not installed.
    """
    name = name or ("video" if isinstance(source, bytes) else str(source))
    if not limits.sample_fps > 0:
        raise ValueError(f"sample_fps must be positive, not {limits.sample_fps}")
    container = _open(source, limits, name)
    try:
        if not container.streams.video:
            raise UnreadableVideoError(f"{name} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        _check_header(container, stream, limits, name)
        yield from _decode(container, stream, limits, name)
    finally:
        container.close()


def _decode(container, stream, limits: VideoLimits, name: str) -> Iterator[VideoFrame]:
    """:func:`sample_frames`'s loop over the decoded frames."""
    av = _av()
    step, start, next_time, kept = 1.0 / limits.sample_fps, None, 0.0, 0
    frames = container.decode(stream)
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            break
        except (av.FFmpegError, OSError) as exc:
            at = f" after {next_time:.1f} s" if start is not None else ""
            raise UnreadableVideoError(f"{name} broke off{at}: {_reason(exc)}") from exc
        clock = _frame_time(frame)
        if start is None:
            start = clock
        time_s = clock - start if clock is not None and start is not None else kept * step
        if limits.max_seconds is not None and time_s > limits.max_seconds + step:
            raise VideoTooLongError(f"{name} runs past {limits.max_seconds:g} s, the longest accepted")
        if time_s + 1e-6 < next_time:
            continue
        if frame.width * frame.height > limits.max_pixels:
            raise VideoTooLargeError(
                f"{name} has {frame.width}x{frame.height} frames; at most {limits.max_pixels:,} pixels"
            )
        if limits.max_frames is not None and kept >= limits.max_frames:
            raise VideoTooLongError(
                f"{name} has more than {limits.max_frames} frames at {limits.sample_fps:g} per second"
            )
        yield VideoFrame(kept, time_s, frame.to_ndarray(format="rgb24"))
        kept += 1
        next_time = math.floor(time_s / step + 1e-6) * step + step
    if kept == 0:
        raise UnreadableVideoError(f"{name} has no decodable frame")


def _frame_time(frame) -> float | None:
    """A frame's presentation time in seconds (None when the stream gives none)."""
    if frame.time is not None:
        return float(frame.time)
    return None
