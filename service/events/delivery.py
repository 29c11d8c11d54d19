"""Delivering the event stream to webhooks: one consumer group per webhook, one consumer per
service process, so that with several workers (or pods) each event reaches each webhook once.

For each webhook a task of the process's event loop reads new entries (``XREADGROUP``), and POSTs
each event it wants (a thread per request, with the delivery timeout), several at once: a slow or
dead webhook holds back none of the others, nor its own later events. An entry is acknowledged
(``XACK``) only after a 2xx; a failed delivery is tried again after 1, 2, 4, ... seconds (at most
``webhook_retry_max``), and after ``webhook_max_attempts`` it goes to the webhook's dead letters.
Attempts are counted in Redis, so a process that takes over keeps counting. Entries a process
holds stay claimed by it (``XCLAIM`` refreshes them); those of a process that died are taken over
(``XAUTOCLAIM``) once idle for ``webhook_claim_idle`` seconds. Delivery is at least once: a
receiver drops repeats by the event's ``id``.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from service.events.stream import Event, events_key, utc_now_rfc3339
from service.events.webhooks import WebhookEndpoint, signature

log = logging.getLogger(__name__)

REDIS_ERRORS = (redis.RedisError, RedisClusterException, OSError)
#: Milliseconds one XREADGROUP waits for new entries.
READ_BLOCK_MS = 1000
#: Deliveries one process has in flight per webhook, retries waiting included.
IN_FLIGHT = 16
#: Dead letters kept per webhook (approximately: MAXLEN ~).
DEAD_LETTERS_MAXLEN = 10_000
#: Characters of a receiver's error kept with a dead letter.
ERROR_CHARS = 300


@dataclass(frozen=True)
class RetryPolicy:
    """Seconds: ``timeout`` per request (connect and each read), ``initial`` the first back-off,
    doubling up to ``maximum``; ``max_attempts`` deliveries in all before the dead letters."""

    timeout: float = 10.0
    initial: float = 1.0
    maximum: float = 300.0
    max_attempts: int = 8

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1, 2, ...)."""
        return min(self.maximum, self.initial * 2 ** (attempt - 1))


def post_event(endpoint: WebhookEndpoint, event: Event, timeout: float) -> str | None:
    """POST ``event`` to ``endpoint``, signed; None on a 2xx answer, else what went wrong (a
    redirect is a failure too). Blocking: call it in a thread."""
    body = event.body()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "sphereface-webhooks/1",
        "X-SphereFace-Event-Id": event.id,
        "X-SphereFace-Event-Type": event.type,
        "X-SphereFace-Timestamp": timestamp,
        "X-SphereFace-Signature": signature(endpoint.secret, timestamp, body),
    }
    url = urlsplit(endpoint.url)
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    connection = kind(url.hostname, url.port, timeout=timeout)
    try:
        target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        connection.request("POST", target, body, headers)
        answer = connection.getresponse()
        answer.read(65536)
    except (http.client.HTTPException, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    finally:
        connection.close()
    return None if 200 <= answer.status < 300 else f"HTTP {answer.status}"


class WebhookKeys:
    """The Redis keys and consumer group of one webhook (see :mod:`service.events.stream`)."""

    def __init__(self, prefix: str, name: str) -> None:
        self.stream = events_key(prefix, "stream")
        self.dead = events_key(prefix, f"dead:{name}")
        self.attempts = events_key(prefix, f"attempts:{name}")
        self.group = f"webhook:{name}"


def consumer_name() -> str:
    """This process's consumer name: host, pid and a random part (a restart is a new consumer)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class WebhookWorker:
    """Delivers one webhook's events from this process (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        prefix: str,
        endpoint: WebhookEndpoint,
        policy: RetryPolicy,
        *,
        claim_idle: float = 60.0,
        consumer: str | None = None,
        metrics: Any = None,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.policy = policy
        self.keys = WebhookKeys(prefix, endpoint.name)
        self.claim_idle_ms = max(1, int(claim_idle * 1000))
        self.consumer = consumer or consumer_name()
        self.metrics = metrics
        #: stream entry ids this process is delivering (refreshed so no other process claims them)
        self.in_flight: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    # -- Redis (blocking: called in threads) ---------------------------------------------------
    def ensure_group(self, start: str = "$") -> None:
        """Create the webhook's consumer group (``start``: ``$`` new events only; ``0`` all)."""
        try:
            self.client.xgroup_create(self.keys.stream, self.keys.group, id=start, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read_new(self, count: int) -> list[tuple[str, dict]]:
        """Up to ``count`` entries no consumer of the group has had yet (waits up to 1 s)."""
        reply = self.client.xreadgroup(
            self.keys.group, self.consumer, {self.keys.stream: ">"}, count=count, block=READ_BLOCK_MS
        )
        return [(_text(i), f) for _, entries in reply or [] for i, f in entries if f]

    def refresh_and_claim(self) -> list[tuple[str, dict]]:
        """Keep this process's entries claimed, and take over those idle longer than
        ``claim_idle`` (a process that died holding them)."""
        if self.in_flight:
            self.client.xclaim(
                self.keys.stream, self.keys.group, self.consumer, 0, sorted(self.in_flight), justid=True
            )
        reply = self.client.xautoclaim(
            self.keys.stream, self.keys.group, self.consumer, self.claim_idle_ms, "0-0", count=IN_FLIGHT
        )
        return [(_text(i), f) for i, f in reply[1] if f]

    def count_attempt(self, entry_id: str) -> int:
        """Attempts at this entry so far, this one included (kept in Redis across processes)."""
        return int(self.client.hincrby(self.keys.attempts, entry_id, 1))

    def acknowledge(self, entry_id: str) -> None:
        self.client.xack(self.keys.stream, self.keys.group, entry_id)
        self.client.hdel(self.keys.attempts, entry_id)

    def bury(self, entry_id: str, event: Event, attempts: int, error: str) -> None:
        """Move an entry to the webhook's dead letters, then acknowledge it."""
        fields = {
            "event": event.body(),
            "attempts": attempts,
            "last_error": error[:ERROR_CHARS],
            "failed_at": utc_now_rfc3339(),
        }
        self.client.xadd(self.keys.dead, fields, maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
        self.acknowledge(entry_id)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Deliver until cancelled; a Redis that fails is logged and tried again each second."""
        next_claim, group_ready = 0.0, False
        try:
            while True:
                try:
                    if not group_ready:
                        await asyncio.to_thread(self.ensure_group)
                        group_ready = True
                    if time.monotonic() >= next_claim:
                        self._start(await asyncio.to_thread(self.refresh_and_claim))
                        next_claim = time.monotonic() + self.claim_idle_ms / 3000
                    free = IN_FLIGHT - len(self.in_flight)
                    if free <= 0:
                        await asyncio.sleep(0.05)
                        continue
                    self._start(await asyncio.to_thread(self.read_new, free))
                except redis.ResponseError as exc:
                    await self._recover(exc)
                except REDIS_ERRORS as exc:
                    log.warning("webhook %s: Redis failed: %s", self.endpoint.name, exc)
                    await asyncio.sleep(1.0)
        finally:
            for task in self._tasks:
                task.cancel()

    async def _recover(self, exc: redis.ResponseError) -> None:
        """The stream or group is gone (a flushed Redis): make it again, from the stream's start."""
        if "NOGROUP" not in str(exc):
            log.warning("webhook %s: Redis refused: %s", self.endpoint.name, exc)
            await asyncio.sleep(1.0)
            return
        self.in_flight.clear()
        await asyncio.to_thread(self.ensure_group, "0")

    def _start(self, entries: list[tuple[str, dict]]) -> None:
        for entry_id, fields in entries:
            if entry_id in self.in_flight:
                continue
            self.in_flight.add(entry_id)
            task = asyncio.create_task(self._deliver(entry_id, fields))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, entry_id: str, fields: dict) -> None:
        """Deliver one entry until a 2xx or the dead letters (or Redis fails: it stays pending,
        for this or another process to claim after ``claim_idle``)."""
        try:
            event = Event.from_stream(fields)
            only = _text(fields.get(b"only", fields.get("only", b"")))
            if not self.endpoint.wants(event.type) or only not in ("", self.endpoint.name):
                await asyncio.to_thread(self.acknowledge, entry_id)
                return
            await self._attempts(entry_id, event)
        except REDIS_ERRORS as exc:
            log.warning(
                "webhook %s: entry %s left pending, Redis failed: %s", self.endpoint.name, entry_id, exc
            )
        finally:
            self.in_flight.discard(entry_id)

    async def _attempts(self, entry_id: str, event: Event) -> None:
        while True:
            attempt = await asyncio.to_thread(self.count_attempt, entry_id)
            error = await asyncio.to_thread(post_event, self.endpoint, event, self.policy.timeout)
            if error is None:
                await asyncio.to_thread(self.acknowledge, entry_id)
                self._count("delivered")
                return
            self._count("failed")
            if attempt >= self.policy.max_attempts:
                log.warning(
                    "webhook %s: event %s dead after %d attempts: %s",
                    self.endpoint.name,
                    event.id,
                    attempt,
                    error,
                )
                await asyncio.to_thread(self.bury, entry_id, event, attempt, error)
                self._count("dead_letter")
                return
            log.info(
                "webhook %s: event %s attempt %d failed: %s", self.endpoint.name, event.id, attempt, error
            )
            await asyncio.sleep(self.policy.delay(attempt))

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.webhook_deliveries.labels(webhook=self.endpoint.name, outcome=outcome).inc()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class WebhookDelivery:
    """Every webhook's :class:`WebhookWorker` as tasks of the running event loop; ``client``, the
    Redis client they share, is closed when they stop."""

    def __init__(
        self, workers: list[WebhookWorker], client: redis.Redis | RedisCluster | None = None
    ) -> None:
        self.workers = workers
        self.client = client
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(worker.run(), name=f"webhook:{worker.endpoint.name}")
            for worker in self.workers
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            self.client.close()
