"""Video in: a clip made in the test from real photos (two enrolled people and a stranger) through
``POST /v1/identify/video`` and ``sphereface watch``, signed track events to a webhook, and clear
errors for broken, truncated, oversized and overlong clips and for a silent stream."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bench.video_clip import actor_photo, two_people_and_a_stranger, write_clip
from models.pipeline import FacePipeline
from models.video import UnreadableVideoError, VideoLimits, VideoTooLongError, sample_frames
from service.app import create_app
from service.redis_server import LocalRedis
from service.settings import Settings
from tests.conftest import REPO_ROOT, short_temp_dir
from tests.test_events import SECRET, Receiver

pytestmark = pytest.mark.shared_data
pytest.importorskip("av", reason="video needs PyAV: pip install '.[video]'")

ENROLLED = {"obama": "Barack Obama", "biden": "Joe Biden"}
STRANGER = "lennon"


@pytest.fixture(scope="module")
def clip(default_model_dir: Path, photos_dir: Path, tmp_path_factory) -> Path:
    """An 8 s clip at 640x360, 25 fps: obama and biden (photos not enrolled) cross the frame,
    growing and blurred for a second each; lennon (never enrolled) walks in as they leave."""
    pipeline = FacePipeline(default_model_dir)
    people = photos_dir / "people"
    photos = {
        "a": actor_photo(pipeline, people / "obama" / "2.jpg", "obama"),
        "b": actor_photo(pipeline, people / "biden" / "2.jpg", "biden"),
        "stranger": actor_photo(pipeline, people / STRANGER / "1.jpg", STRANGER),
    }
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    write_clip(path, two_people_and_a_stranger(photos), width=640, height=360, seconds=8.0)
    return path


@pytest.fixture(scope="module")
def redis_url(redis_binary: str):
    folder = short_temp_dir()
    with LocalRedis(folder / "redis", binary=redis_binary) as server:
        yield server.url
    shutil.rmtree(folder, ignore_errors=True)


def make_client(default_model_dir: Path, redis_url: str, **settings) -> TestClient:
    values = {"model": str(default_model_dir), "redis_url": redis_url, "auth": "off", **settings}
    return TestClient(create_app(Settings(**values)))


def enroll_people(client: TestClient, photos_dir: Path) -> None:
    for subject, name in ENROLLED.items():
        client.post("/v1/subjects", json={"id": subject, "name": name})
        with open(photos_dir / "people" / subject / "1.jpg", "rb") as f:
            answer = client.post(
                f"/v1/subjects/{subject}/faces", files={"photos": ("1.jpg", f, "image/jpeg")}
            )
        assert answer.status_code == 200, answer.text


def verify_signature(headers: dict[str, str], body: bytes) -> bool:
    """The receiver's check of a delivery (docs/guides/events.md): HMAC-SHA256 of "<ts>.<body>"."""
    stamp = headers["X-SphereFace-Timestamp"]
    expected = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-SphereFace-Signature"], f"sha256={expected}")


def post_clip(client: TestClient, data: bytes, name: str = "clip.mp4", **params):
    return client.post("/v1/identify/video", params=params, files={"video": (name, data, "video/mp4")})


def test_a_clip_of_two_enrolled_people_and_a_stranger_gives_three_decided_tracks(
    clip, default_model_dir, redis_url, photos_dir
):
    receiver = Receiver([500, 200])  # the first delivery fails: the retry must bring it
    hooks = json.dumps([{"url": receiver.url, "secret": SECRET, "name": "door",
                         "events": ["face.enrolled", "track.ended"]}])  # fmt: skip
    try:
        with make_client(
            default_model_dir, redis_url, webhooks=hooks, events_identification=True,
            webhook_retry_initial=0.2, webhook_retry_max=0.4, redis_prefix="vid1:",
        ) as client:  # fmt: skip
            enroll_people(client, photos_dir)
            answer = post_clip(client, clip.read_bytes())
            assert answer.status_code == 200, answer.text
            receiver.wait_for(lambda: len(receiver.events("track.ended")) == 3, timeout=20)
    finally:
        receiver.server.shutdown()
    body = answer.json()
    decided = [(t["status"], t["subject_id"]) for t in body["tracks"]]
    assert decided == [("known", "obama"), ("known", "biden"), ("unknown", None)], body["tracks"]
    first = body["tracks"][0]
    assert first["name"] == "Barack Obama" and first["score"] >= body["threshold"]
    assert 0.0 <= first["start_s"] < 0.3 and 4.0 < first["end_s"] < 4.6
    assert first["faces"] == len(first["path"]) >= 15 and first["decided_on"] == 5
    assert body["frames"] == 40 and body["embedded"] < body["faces"]  # tracking skipped some faces
    ended = receiver.events("track.ended")
    assert sorted((e["data"]["status"], e["data"]["subject_id"]) for e in ended) == sorted(decided)
    assert receiver.events("face.enrolled")
    for _, headers, raw in receiver.received:
        assert verify_signature(headers, raw), headers


def test_an_unknown_track_is_kept_clustered_and_once_named_is_known(
    clip, default_model_dir, redis_url, photos_dir
):
    """With unknown faces kept, the stranger's track becomes one kept face (with the region of its
    best face); naming its cluster makes the stranger known in the same clip sent again."""
    with make_client(default_model_dir, redis_url, keep_unknown=True, redis_prefix="vid5:") as client:
        enroll_people(client, photos_dir)
        first = post_clip(client, clip.read_bytes(), source="door-camera").json()["tracks"]
        stranger = first[2]
        assert stranger["status"] == "unknown" and stranger["unknown_face_id"] and stranger["cluster_id"]
        assert first[0]["unknown_face_id"] is None  # known tracks are not kept
        page = client.get("/v1/unknowns/clusters").json()
        assert [c["id"] for c in page["clusters"]] == [stranger["cluster_id"]]
        kept = page["clusters"][0]["representatives"][0]
        assert kept["id"] == stranger["unknown_face_id"] and kept["source"] == "door-camera"
        image = client.get(f"/v1/unknowns/faces/{kept['id']}/image")
        assert image.status_code == 200 and image.content[:2] == b"\xff\xd8"  # the best face's region
        named = client.post(
            f"/v1/unknowns/clusters/{stranger['cluster_id']}/enroll",
            json={"subject_id": STRANGER, "create_subject": True, "name": "John Lennon"},
        )
        assert named.status_code == 200, named.text
        again = post_clip(client, clip.read_bytes()).json()["tracks"]
        with open(photos_dir / "people" / STRANGER / "2.jpg", "rb") as f:  # a photo the clip does not show
            photo = client.post("/v1/identify", files={"photo": ("2.jpg", f, "image/jpeg")}).json()
    assert [(f["status"], f["subject_id"]) for f in photo["faces"]] == [("known", STRANGER)], photo
    assert [(t["status"], t["subject_id"]) for t in again] == [
        ("known", "obama"),
        ("known", "biden"),
        ("known", STRANGER),
    ]


class CountingDetector:
    """The real detector, counting the images it is given by their shape."""

    def __init__(self, detector) -> None:
        self.detector, self.shapes = detector, []

    def detect(self, image):
        self.shapes.append(image.shape[:2])
        return self.detector.detect(image)


def test_between_keyframes_only_the_tracked_faces_are_searched(clip, default_model_dir):
    from models.tracking import TrackerSettings
    from models.video_faces import VideoFaces

    pipeline = FacePipeline(default_model_dir)
    counted = CountingDetector(pipeline.detector)
    pipeline.detector = counted
    runs = {}
    for keyframes in (1, 5):
        counted.shapes.clear()
        faces = VideoFaces(
            pipeline, TrackerSettings(join_cosine=0.93, split_cosine=0.73), keyframe_every=keyframes
        )
        for frame in sample_frames(str(clip), VideoLimits(sample_fps=5)):
            faces.frame(frame)
        whole = sum(shape == (360, 640) for shape in counted.shapes)
        runs[keyframes] = (whole, len(counted.shapes), [(t.start_s, t.end_s) for t in faces.finish()])
    assert runs[1][:2] == (40, 40)
    assert runs[5][0] == 8 and runs[5][1] > 8  # frames 0, 5, ..., 35 whole; regions in between
    assert len(runs[5][2]) == len(runs[1][2]) == 3
    for (s1, e1), (s5, e5) in zip(runs[1][2], runs[5][2], strict=True):
        assert s5 - s1 < 1.0 + 1e-6 and abs(e5 - e1) < 0.5  # a new face waits at most one second


def test_broken_and_over_limit_clips_get_clear_errors(clip, default_model_dir, redis_url):
    data = clip.read_bytes()
    with make_client(
        default_model_dir, redis_url, max_video_bytes=len(data) - 1, redis_prefix="vid2:"
    ) as client:  # fmt: skip
        too_big = post_clip(client, data)
        assert (too_big.status_code, too_big.json()["code"]) == (413, "video_too_large")
    with make_client(default_model_dir, redis_url, max_video_seconds=3.0, redis_prefix="vid3:") as client:
        too_long = post_clip(client, data)
        assert (too_long.status_code, too_long.json()["code"]) == (422, "video_too_long")
        assert "3 s" in too_long.json()["message"]
        truncated = post_clip(client, data[: len(data) // 2], name="cut.mp4")
        assert (truncated.status_code, truncated.json()["code"]) == (422, "unreadable_video")
        assert truncated.json()["message"].startswith("cut.mp4")
        garbage = post_clip(client, os.urandom(50_000), name="noise.mp4")
        assert (garbage.status_code, garbage.json()["code"]) == (422, "unreadable_video")
        as_json = client.post("/v1/identify/video", json={"embeddings": [[0.0] * 128]})
        assert (as_json.status_code, as_json.json()["code"]) == (415, "unsupported_media_type")
        too_fast = post_clip(client, data, sample_fps=60)
        assert (too_fast.status_code, too_fast.json()["code"]) == (422, "invalid_request")


@pytest.fixture(scope="module")
def clip_ts(clip, tmp_path_factory) -> Path:
    """The clip remuxed as MPEG-TS: a stream format, whose header states no duration."""
    import av

    ts = tmp_path_factory.mktemp("ts") / "clip.ts"
    with av.open(str(clip)) as source, av.open(str(ts), "w", format="mpegts") as target:
        out = target.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:
                packet.stream = out
                target.mux(packet)
    return ts


def test_a_clip_without_a_duration_in_its_header_is_still_bounded(clip_ts):
    with pytest.raises(VideoTooLongError):
        list(sample_frames(str(clip_ts), VideoLimits(sample_fps=2, max_seconds=3.0)))
    frames = list(sample_frames(str(clip_ts), VideoLimits(sample_fps=2, max_seconds=None)))
    assert [round(f.time_s, 1) for f in frames[:4]] == [0.0, 0.5, 1.0, 1.5] and len(frames) == 16


class BreakingStream:
    """An HTTP camera: the first connection sends the first ``cut`` of the clip's bytes and drops,
    the second sends it all, later ones get 503 (the camera went away)."""

    def __init__(self, data: bytes, cut: float = 0.5) -> None:
        self.connections = 0
        stream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stream.connections += 1
                if stream.connections > 2:
                    self.send_error(503)
                    return
                body = data[: int(len(data) * cut)] if stream.connections == 1 else data
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/door.ts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_watch_reconnects_a_stream_that_breaks_off_and_decides_each_part(
    clip_ts, default_model_dir, redis_url, photos_dir
):
    with make_client(default_model_dir, redis_url, redis_prefix="vid6:") as client:
        enroll_people(client, photos_dir)
    camera = BreakingStream(clip_ts.read_bytes())
    env = {"SPHEREFACE_REDIS_URL": redis_url, "SPHEREFACE_REDIS_PREFIX": "vid6:",
           "SPHEREFACE_MODEL": str(default_model_dir), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    try:
        done = run_watch([camera.url, "--max-reconnects", "1", "--reconnect-max", "1", "--no-events"], env)
    finally:
        camera.server.shutdown()
    assert camera.connections == 3  # cut, whole, refused: then watch gives up
    assert done.returncode == 2 and "error [unreadable_video]" in done.stderr, done.stderr
    assert done.stderr.count("opening it again") == 2
    tracks = [json.loads(line) for line in done.stdout.splitlines()]
    named = [t["subject_id"] for t in tracks if t["status"] == "known"]
    # the first connection's half shows obama (ended at the break) and biden; the second, all three
    assert named.count("obama") == 2 and "biden" in named, tracks
    assert sum(t["status"] == "unknown" for t in tracks) >= 1


def silent_server() -> tuple[socket.socket, int]:
    """A TCP server that accepts connections and never answers (a camera gone silent)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    threading.Thread(target=lambda: [server.accept() for _ in range(8)], daemon=True).start()
    return server, server.getsockname()[1]


def test_a_silent_stream_is_an_error_within_its_timeout_not_a_hang():
    server, port = silent_server()
    limits = VideoLimits(open_timeout_s=1.0, read_timeout_s=1.0, max_seconds=None, max_frames=None)
    started = time.monotonic()
    with pytest.raises(UnreadableVideoError, match="cannot be opened"):
        list(sample_frames(f"http://127.0.0.1:{port}/cam.mjpeg", limits))
    assert time.monotonic() - started < 10
    server.close()


def run_watch(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "models.cli", "watch", *args], cwd=REPO_ROOT, env={**os.environ, **env},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_watch_names_the_two_people_of_the_clip_and_sends_track_events(
    clip, default_model_dir, redis_url, photos_dir
):
    with make_client(default_model_dir, redis_url, redis_prefix="vid4:") as client:
        enroll_people(client, photos_dir)
    env = {"SPHEREFACE_REDIS_URL": redis_url, "SPHEREFACE_REDIS_PREFIX": "vid4:",
           "SPHEREFACE_MODEL": str(default_model_dir), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    done = run_watch([str(clip)], env)
    assert done.returncode == 0, done.stderr
    tracks = [json.loads(line) for line in done.stdout.splitlines()]
    decided = sorted((t["status"], t["subject_id"] or "") for t in tracks)
    assert decided == [("known", "biden"), ("known", "obama"), ("unknown", "")], tracks
    assert "40 frames" in done.stderr and "3 tracks decided, 2 known" in done.stderr
    import redis

    with redis.Redis.from_url(redis_url) as r:
        entries = r.xrange("vid4:{events}:stream")
    types = [fields[b"type"].decode() for _, fields in entries]
    assert types.count("track.started") == 3 and types.count("track.ended") == 3


def test_watch_gives_up_on_a_dead_stream_after_its_reconnects(default_model_dir, redis_url):
    env = {"SPHEREFACE_REDIS_URL": redis_url, "SPHEREFACE_MODEL": str(default_model_dir),
           "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    done = run_watch([f"rtsp://127.0.0.1:{port}/door", "--max-reconnects", "2", "--reconnect-max", "1"], env)
    assert done.returncode != 0
    assert "error [unreadable_video]" in done.stderr and f"127.0.0.1:{port}" in done.stderr
    assert done.stderr.count("opening it again") == 2
    assert time.monotonic() - started < 120


def test_the_clip_helper_is_a_real_video(clip):
    """The clip is an H.264 MP4 that PyAV reads back at its frame count (the test's own footing)."""
    import av

    with av.open(io.BytesIO(clip.read_bytes())) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and (stream.width, stream.height) == (640, 360)
        assert sum(1 for _ in container.decode(stream)) == 200
