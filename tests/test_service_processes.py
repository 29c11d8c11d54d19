"""The service as people run it: `sphereface serve` processes, a real redis-server, real photos.

The gallery survives a restart of the service (with its own local Redis, append-only file with
fsync always) and a crash (SIGKILL) and restart of Redis; two service processes on one Redis see
each other's enrollments and deletions.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from service.redis_server import LocalRedis
from service.serve_process import Service

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


def photo(path: Path, field: str):
    return (field, (path.name, path.read_bytes(), "image/jpeg"))


def enroll(service: Service, name: str, path: Path) -> str:
    assert service.client.post("/v1/subjects", json={"id": name}).status_code == 201
    r = service.client.post(f"/v1/subjects/{name}/faces", files=[photo(path, "photos")])
    assert r.status_code == 200 and r.json()["enrolled"] == 1, r.text
    return r.json()["items"][0]["face"]["id"]


def best(service: Service, path: Path) -> str | None:
    r = service.client.post("/v1/identify", files=[photo(path, "photo")], params={"faces": "largest"})
    assert r.status_code == 200, r.text
    return r.json()["faces"][0]["subject_id"]


def test_gallery_survives_restarts_of_the_service_and_its_local_redis(default_model_dir, photos_dir, workdir):
    people = photos_dir / "people"
    data = workdir / "data"
    service = Service(default_model_dir, data)
    try:
        face_id = enroll(service, "obama", people / "obama" / "1.jpg")
        enroll(service, "biden", people / "biden" / "1.jpg")
        assert best(service, people / "obama" / "2.jpg") == "obama"
        redis_pid = int((data / "redis" / "redis.pid").read_text())
    finally:
        service.stop()
    with pytest.raises(ProcessLookupError):  # serve stopped its redis-server on the way out
        os.kill(redis_pid, 0)

    service = Service(default_model_dir, data)
    try:
        faces = service.client.get("/v1/subjects/obama/faces").json()["faces"]
        assert [f["id"] for f in faces] == [face_id]
        assert service.client.get("/v1/subjects").json()["total"] == 2
        assert best(service, people / "obama" / "2.jpg") == "obama"
        assert best(service, people / "biden" / "2.jpg") == "biden"
        # a crash of the local redis-server (SIGKILL) loses nothing written (fsync always)
        enroll(service, "lennon", people / "lennon" / "1.jpg")
        os.kill(int((data / "redis" / "redis.pid").read_text()), signal.SIGKILL)
    finally:
        service.stop()
    service = Service(default_model_dir, data)
    try:
        assert service.client.get("/v1/subjects").json()["total"] == 3
        assert best(service, people / "lennon" / "2.jpg") == "lennon"
    finally:
        service.stop()


def test_running_service_rides_out_a_redis_crash_and_restart(
    default_model_dir, photos_dir, redis_binary, workdir
):
    people = photos_dir / "people"
    redis = LocalRedis(workdir / "redis", binary=redis_binary).start()
    service = Service(default_model_dir, workdir / "data", redis.url)
    try:
        enroll(service, "clapton", people / "clapton" / "1.jpg")
        redis.kill()
        down = service.client.get("/readyz")
        assert down.status_code == 503 and down.json()["status"] == "redis_unavailable"
        r = service.client.get("/v1/subjects")
        assert r.status_code == 503 and r.json()["code"] == "redis_unavailable"
        redis.start()
        assert service.client.get("/readyz").status_code == 200
        assert service.client.get("/v1/subjects/clapton").json()["face_count"] == 1
        assert best(service, people / "clapton" / "2.jpg") == "clapton"
    finally:
        service.stop()
        redis.stop()


def test_two_service_processes_see_each_others_enrollments(
    default_model_dir, photos_dir, redis_binary, workdir
):
    people = photos_dir / "people"
    redis = LocalRedis(workdir / "redis", binary=redis_binary).start()
    a = Service(default_model_dir, workdir / "a", redis.url)
    b = Service(default_model_dir, workdir / "b", redis.url)
    try:
        assert best(b, people / "kit_harington" / "2.jpg") is None  # empty gallery
        face_id = enroll(a, "kit_harington", people / "kit_harington" / "1.jpg")
        assert best(b, people / "kit_harington" / "2.jpg") == "kit_harington"
        enroll(b, "rose_leslie", people / "rose_leslie" / "1.jpg")
        assert best(a, people / "rose_leslie" / "2.jpg") == "rose_leslie"
        assert b.client.delete(f"/v1/faces/{face_id}").status_code == 200
        assert best(a, people / "kit_harington" / "2.jpg") != "kit_harington"
        assert a.client.get("/readyz").json()["gallery_faces"] == 1
    finally:
        a.stop()
        b.stop()
        redis.stop()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_the_service_and_its_redis_with_status_0(default_model_dir, workdir, signum):
    """Before: `make serve` ended with `Error 143` on Ctrl-C."""
    data = workdir / "data"
    service = Service(default_model_dir, data)
    redis_pid = int((data / "redis" / "redis.pid").read_text())
    assert service.stop(signum) == 0, service.log.read_text()[-2000:]
    with pytest.raises(ProcessLookupError):
        os.kill(redis_pid, 0)
    assert "Traceback" not in service.log.read_text()


def test_a_key_in_the_address_is_not_written_to_the_log(default_model_dir, workdir):
    service = Service(default_model_dir, workdir / "data")
    secret = "Zm9vYmFyYmF6cXV4cXV1eHF1dXhxdXV4cXV1eA"
    try:
        r = httpx.get(f"{service.url}/v1/subjects?api_key=sfk_0123456789ab_{secret}&limit=5")
        assert r.status_code == 401  # only the header is read
        httpx.get(f"{service.url}/healthz?token=hunter2")
    finally:
        service.stop()
    log = service.log.read_text()
    assert "/v1/subjects?api_key=***&limit=5" in log and "/healthz?token=***" in log
    assert secret not in log and "hunter2" not in log


def worker_processes(parent: int) -> list[int]:
    """The Python processes whose parent is ``parent`` (not redis-server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"python" in command:
            found.append(int(entry.name))
    return found


def workers_mapping_the_snapshot(parent: int, root: Path, timeout: float = 60):
    """The snapshot files under ``root``, the workers of ``parent`` and those that map the snapshot.

    /readyz answers from whichever worker is up first, so the other one may still be loading its
    model when the service counts as ready: wait (up to ``timeout``) until two workers map it.
    """
    deadline = time.monotonic() + timeout
    while True:
        vectors = sorted(root.rglob("rev-*.vectors.npy"))
        children = worker_processes(parent)  # the workers and multiprocessing's helper
        mapping = []
        for pid in children:
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            if any(str(v) in maps for v in vectors):
                mapping.append(pid)
        if len(mapping) >= 2 or time.monotonic() > deadline:
            return vectors, children, mapping
        time.sleep(0.2)


def test_workers_share_one_mapped_gallery_and_serve_removes_it(
    default_model_dir, photos_dir, redis_binary, workdir
):
    """`sphereface serve --workers 2`: one snapshot of the vectors in /dev/shm that both workers
    map (not a copy each), and it is gone when the service stops."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm: the workers keep their own copies")
    people = photos_dir / "people"
    redis = LocalRedis(workdir / "redis", binary=redis_binary).start()
    try:
        one = Service(default_model_dir, workdir / "one", redis.url)
        try:
            enroll(one, "obama", people / "obama" / "1.jpg")
            enroll(one, "biden", people / "biden" / "1.jpg")
        finally:
            one.stop()
        two = Service(default_model_dir, workdir / "two", redis.url, extra_env={"SPHEREFACE_WORKERS": "2"})
        root = Path(f"/dev/shm/sphereface-gallery-{two.process.pid}")
        try:
            vectors, children, mapping = workers_mapping_the_snapshot(two.process.pid, root)
            assert len(vectors) == 1, vectors  # written once, by the worker that loaded Redis first
            assert len(mapping) == 2, (children, mapping)
            for _ in range(4):
                assert best(two, people / "biden" / "2.jpg") == "biden"
        finally:
            two.stop()
        assert not root.exists()
    finally:
        redis.stop()
