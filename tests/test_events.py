"""Events out end to end: a real redis-server, the real app (with a stand-in for the face model:
these tests enroll and identify embeddings) and a real HTTP receiver on a free port.

Enrollments arrive as signed ``face.enrolled`` events; a failed delivery comes again after its
back-off with the same event id; a dead webhook ends in the dead letters (and can be sent again);
a webhook that hangs does not slow the gallery; two consumers of one group deliver each event
once, and a dead consumer's events are taken over.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import redis
from fastapi.testclient import TestClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.app import create_app
from service.events.delivery import RetryPolicy, WebhookWorker, post_event
from service.events.stream import Event, EventStream, events_key
from service.events.webhooks import WebhookConfigError, WebhookEndpoint, parse_webhooks
from service.metrics import Metrics
from service.settings import Settings
from tests.conftest import REPO_ROOT

ADMIN = {"X-API-Key": "events-test-admin-key"}
SECRET = "a-secret-of-at-least-16-chars"
DIM = 4


class Receiver:
    """A webhook receiver: answers each POST with the next of ``script`` (a status, or ``"hang"``
    to wait ``hang_seconds``; the last one repeats) and keeps what it got."""

    def __init__(self, script: list[int | str], hang_seconds: float = 3.0) -> None:
        self.script, self.hang_seconds = list(script), hang_seconds
        self.received: list[tuple[float, dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.received.append((time.monotonic(), dict(self.headers), body))
                    answer = receiver.script.pop(0) if len(receiver.script) > 1 else receiver.script[0]
                if answer == "hang":
                    time.sleep(receiver.hang_seconds)
                    answer = 200
                self.send_response(int(answer))
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, event_type: str | None = None) -> list[dict]:
        with self.lock:
            bodies = [json.loads(body) for _, _, body in self.received]
        return [e for e in bodies if event_type is None or e["type"] == event_type]

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out; received {self.events()}"
            time.sleep(0.02)


@pytest.fixture
def receiver_factory() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(script: list[int | str], hang_seconds: float = 3.0) -> Receiver:
        made.append(Receiver(script, hang_seconds))
        return made[-1]

    yield make
    for receiver in made:
        receiver.server.shutdown()
        receiver.server.server_close()


def stand_in_pipeline() -> SimpleNamespace:
    """What the app needs of a face pipeline to enroll and identify embeddings of size DIM."""
    manifest = SimpleNamespace(model_id="stand-in@1", output_size=DIM, thresholds={})
    return SimpleNamespace(manifest=manifest, embedder=SimpleNamespace(provider="CPUExecutionProvider"))


def service(redis_url: str | None, webhooks: list[dict], **settings) -> TestClient:
    """The app with its own key prefix (a fresh gallery and stream) and fast retries."""
    values = {
        "redis_url": redis_url,
        "redis_prefix": f"t{uuid.uuid4().hex[:8]}:",
        "api_key": ADMIN["X-API-Key"],
        "webhooks": json.dumps(webhooks),
        "webhook_timeout": 1.0,
        "webhook_retry_initial": 0.2,
        "webhook_retry_max": 0.4,
        "webhook_max_attempts": 3,
        **settings,
    }
    return TestClient(create_app(Settings(**values), pipeline=stand_in_pipeline()))


def hook(receiver: Receiver, **fields) -> dict:
    return {"url": receiver.url, "secret": SECRET, "name": "crm", **fields}


def enroll(client: TestClient, subject_id: str, vector: list[float]) -> dict:
    answer = client.post(f"/v1/subjects/{subject_id}/faces", json={"embeddings": [vector]}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    return answer.json()["items"][0]["face"]


def test_an_enrollment_arrives_as_a_signed_face_enrolled_event(module_redis, receiver_factory):
    receiver = receiver_factory([200])
    with service(module_redis.url, [hook(receiver)]) as client:
        assert client.post("/v1/subjects", json={"id": "ada"}, headers=ADMIN).status_code == 201
        face = enroll(client, "ada", [1.0, 0.0, 0.0, 0.0])
        receiver.wait_for(lambda: receiver.events("face.enrolled"))
    assert [e["type"] for e in receiver.events()] == ["subject.created", "face.enrolled"]
    _, headers, body = next(r for r in receiver.received if json.loads(r[2])["type"] == "face.enrolled")
    event = json.loads(body)
    assert event["data"] == {
        "subject_id": "ada",
        "face_id": face["id"],
        "model": "stand-in@1",
        "source": "embedding",
    }
    assert event["created_at"].endswith("Z") and event["id"].startswith("evt_")
    assert headers["X-SphereFace-Event-Id"] == event["id"]
    assert headers["X-SphereFace-Event-Type"] == "face.enrolled"
    timestamp = headers["X-SphereFace-Timestamp"]
    assert abs(int(timestamp) - time.time()) < 60
    expected = hmac.new(SECRET.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert headers["X-SphereFace-Signature"] == f"sha256={expected}"
    wrong = hmac.new(b"another secret!!", f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert headers["X-SphereFace-Signature"] != f"sha256={wrong}"


def test_a_failed_delivery_comes_again_after_its_back_off_with_the_same_id(module_redis, receiver_factory):
    receiver = receiver_factory([500, 200])
    with service(module_redis.url, [hook(receiver, events=["subject.created"])]) as client:
        assert client.post("/v1/subjects", json={"id": "bob"}, headers=ADMIN).status_code == 201
        receiver.wait_for(lambda: len(receiver.received) >= 2)
        time.sleep(0.3)  # a third delivery would come by now
    (first, _, _), (second, _, _) = receiver.received
    ids = [headers["X-SphereFace-Event-Id"] for _, headers, _ in receiver.received]
    assert len(ids) == 2 and ids[0] == ids[1]
    assert second - first >= 0.18  # webhook_retry_initial


def test_a_dead_webhook_ends_in_the_dead_letters_and_can_be_sent_again(module_redis, receiver_factory):
    receiver = receiver_factory([500])
    with service(module_redis.url, [hook(receiver, events=["subject.created"])]) as client:
        assert client.post("/v1/subjects", json={"id": "cy"}, headers=ADMIN).status_code == 201
        receiver.wait_for(lambda: len(receiver.received) >= 3)

        def letters() -> list[dict]:
            return client.get("/v1/events/dead-letters", headers=ADMIN).json()["dead_letters"]

        receiver.wait_for(lambda: bool(letters()))
        (letter,) = letters()
        assert letter["webhook"] == "crm" and letter["attempts"] == 3 and letter["last_error"] == "HTTP 500"
        assert letter["event"]["id"] == receiver.events()[0]["id"]
        assert len(receiver.received) == 3  # max attempts, then no more
        assert (
            client.get("/v1/events/dead-letters?webhook=nope", headers=ADMIN).json()["code"]
            == "webhook_not_found"
        )
        assert client.get("/v1/events/dead-letters", headers={"X-API-Key": "wrong"}).status_code == 401

        receiver.script = [200]
        answer = client.post(f"/v1/events/dead-letters/crm/{letter['id']}/redeliver", headers=ADMIN)
        assert answer.status_code == 202 and answer.json()["event_id"] == letter["event"]["id"]
        receiver.wait_for(lambda: len(receiver.received) == 4)
        assert receiver.events()[3]["id"] == letter["event"]["id"]
        assert letters() == []
        gone = client.delete(f"/v1/events/dead-letters/crm/{letter['id']}", headers=ADMIN)
        assert gone.status_code == 404 and gone.json()["code"] == "dead_letter_not_found"


def test_a_webhook_that_hangs_does_not_slow_the_gallery(module_redis, receiver_factory):
    receiver = receiver_factory(["hang"], hang_seconds=2.0)
    with service(module_redis.url, [hook(receiver)], webhook_timeout=1.5) as client:
        client.post("/v1/subjects", json={"id": "dee"}, headers=ADMIN)
        receiver.wait_for(lambda: len(receiver.received) >= 1)  # the webhook now hangs
        started = time.monotonic()
        for i in range(5):
            enroll(client, "dee", [1.0, float(i), 0.5, 0.0])
        took = time.monotonic() - started
    assert took < 0.75, f"5 enrollments took {took:.2f} s while the webhook hangs (timeout 1.5 s)"


def test_identification_events_are_opt_in_and_carry_no_embeddings(module_redis, receiver_factory):
    receiver = receiver_factory([200])
    hooks = [hook(receiver, events=["identification"])]
    for opted_in in (False, True):
        with service(module_redis.url, hooks, events_identification=opted_in) as client:
            client.post("/v1/subjects", json={"id": "eve"}, headers=ADMIN)
            enroll(client, "eve", [0.0, 1.0, 0.0, 0.0])
            answer = client.post(
                "/v1/identify?threshold=0.5", json={"embeddings": [[0.0, 0.9, 0.1, 0.0]]}, headers=ADMIN
            )
            assert answer.status_code == 200, answer.text
            if opted_in:
                receiver.wait_for(lambda: receiver.events("identification"))
            else:
                time.sleep(0.5)
                assert receiver.events() == []
    (event,) = receiver.events()
    (face,) = event["data"]["faces"]
    assert face["status"] == "known" and face["subject_id"] == "eve"
    assert [c["subject_id"] for c in face["candidates"]] == ["eve"]
    assert "embedding" not in json.dumps(event)


def test_the_stream_is_readable_and_a_refused_xadd_is_counted_not_raised(module_redis):
    client = module_redis.client()
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    stream = EventStream(client, prefix, maxlen=1000)
    assert stream.emit("face.deleted", {"face_id": "f1"})
    ((_, fields),) = client.xrange(events_key(prefix, "stream"))
    assert Event.from_stream(fields).data == {"face_id": "f1"}
    assert events_key(prefix, "stream") == f"{prefix}{{events}}:stream"  # one cluster slot

    metrics = Metrics()
    down = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    assert EventStream(down, prefix, metrics=metrics).emit("face.deleted", {"face_id": "f2"}) is False
    assert metrics.registry.get_sample_value("sphereface_events_dropped_total") == 1.0


async def run_workers(workers: list[WebhookWorker], until: Callable[[], bool], timeout: float = 10.0) -> None:
    tasks = [asyncio.create_task(w.run()) for w in workers]
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # repeats, were there any, would come by now
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_two_consumers_of_one_group_deliver_each_event_once(module_redis, receiver_factory):
    receiver = receiver_factory([200])
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    endpoint = WebhookEndpoint("crm", receiver.url, SECRET)
    clients = [module_redis.client(socket_timeout=3) for _ in range(2)]
    workers = [
        WebhookWorker(c, prefix, endpoint, RetryPolicy(timeout=1.0), consumer=f"w{i}")
        for i, c in enumerate(clients)
    ]
    workers[0].ensure_group()
    stream = EventStream(clients[0], prefix)
    stream.publish([Event("face.deleted", {"face_id": f"f{i}"}) for i in range(40)])
    asyncio.run(run_workers(workers, lambda: len(receiver.received) >= 40))
    ids = [e["id"] for e in receiver.events()]
    assert len(ids) == 40 and len(set(ids)) == 40
    assert clients[0].xpending(events_key(prefix, "stream"), "webhook:crm")["pending"] == 0


def test_the_events_of_a_consumer_that_died_are_taken_over(module_redis, receiver_factory):
    receiver = receiver_factory([200])
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    client = module_redis.client(socket_timeout=3)
    endpoint = WebhookEndpoint("crm", receiver.url, SECRET)
    worker = WebhookWorker(
        client, prefix, endpoint, RetryPolicy(timeout=1.0), claim_idle=0.3, consumer="alive"
    )
    worker.ensure_group()
    EventStream(client, prefix).emit("face.deleted", {"face_id": "orphan"})
    key = events_key(prefix, "stream")
    assert client.xreadgroup("webhook:crm", "died", {key: ">"}, count=1)  # read, never acknowledged
    asyncio.run(run_workers([worker], lambda: bool(receiver.received)))
    assert [e["data"]["face_id"] for e in receiver.events()] == ["orphan"]


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('[{"url": "ftp://x.org/h", "secret": "' + SECRET + '"}]', "entry 0: url"),
        (
            '[{"url": "http://a.org/h", "secret": "'
            + SECRET
            + '"}, {"url": "http://b.org/h", "secret": "short"}]',
            "entry 1 (http://b.org/h): secret",
        ),
        (
            '[{"url": "http://a.org/h", "secret": "' + SECRET + '", "events": ["face.added"]}]',
            "entry 0 (http://a.org/h): events",
        ),
        ('{"url": "http://a.org/h"}', "JSON list"),
        ("/no/such/webhooks.json", "cannot read the file"),
    ],
)
def test_a_bad_webhook_setting_refuses_the_start_naming_the_entry(value: str, named: str):
    with pytest.raises(WebhookConfigError) as refused:
        create_app(Settings(webhooks=value), pipeline=stand_in_pipeline())
    assert refused.value.code == "invalid_webhooks" and named in refused.value.message


def test_webhooks_come_from_a_file_with_their_filter_and_a_default_name(tmp_path):
    path = tmp_path / "hooks.json"
    path.write_text(json.dumps([{"url": "https://x.org/h", "secret": SECRET, "events": ["face.deleted"]}]))
    (endpoint,) = parse_webhooks(str(path))
    assert endpoint.wants("face.deleted") and not endpoint.wants("face.enrolled")
    assert len(endpoint.name) == 12
    (default,) = parse_webhooks(json.dumps([{"url": "https://x.org/h", "secret": SECRET}]))
    assert not default.wants("identification") and default.wants("subject.deleted")


def test_the_receiver_example_of_the_events_guide_verifies_real_deliveries():
    guide = (REPO_ROOT / "docs" / "guides" / "events.md").read_text()
    example = re.search(r"```python\n(.*?)```", guide, re.DOTALL)[1]
    assert len(example.strip().splitlines()) <= 10
    setup, _, serve_line = example.strip().rpartition("\n")
    assert serve_line.startswith("HTTPServer(")
    namespace: dict = {}
    exec(setup.replace('b"a long random secret"', repr(SECRET.encode())), namespace)
    server = namespace["HTTPServer"](("127.0.0.1", 0), namespace["Hook"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        event = Event("face.deleted", {"face_id": "f1"})
        assert post_event(WebhookEndpoint("good", url, SECRET), event, 2.0) is None
        assert post_event(WebhookEndpoint("bad", url, "not-the-secret-at-all"), event, 2.0) == "HTTP 401"
    finally:
        server.shutdown()
        server.server_close()


def test_on_a_redis_cluster_events_are_made_and_delivered_through_the_cluster_client(
    redis_cluster, receiver_factory
):
    receiver = receiver_factory([200])
    with service(None, [hook(receiver)], redis_cluster=redis_cluster.startup_nodes) as client:
        assert client.post("/v1/subjects", json={"id": "fay"}, headers=ADMIN).status_code == 201
        face = enroll(client, "fay", [0.0, 0.0, 1.0, 0.0])
        receiver.wait_for(lambda: receiver.events("face.enrolled"))
        prefix = client.app.state.settings.redis_prefix
    assert receiver.events("face.enrolled")[0]["data"]["face_id"] == face["id"]
    cluster = redis_cluster.client()
    try:
        assert cluster.xlen(events_key(prefix, "stream")) == 2  # subject.created, face.enrolled
    finally:
        cluster.close()
