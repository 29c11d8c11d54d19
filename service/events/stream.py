"""The event stream: one capped Redis stream that every service process appends events to.

Keys (``P`` is the prefix, ``sf:`` by default), all under the hash tag ``{events}`` so that on a
Redis Cluster they live in one slot, whichever node the cluster client reaches:

* ``P{events}:stream``: the events, trimmed to about ``events_stream_maxlen`` entries (``MAXLEN ~``);
  an entry has the fields ``id``, ``type``, ``created_at``, ``data`` (JSON) and, for a dead letter
  sent again to one webhook, ``only`` (that webhook's name);
* ``P{events}:dead:<webhook>``: the webhook's dead letters (:mod:`service.events.delivery`);
* ``P{events}:attempts:<webhook>``: delivery attempts so far per stream entry still pending.

Appending never fails a request: a Redis that refuses the ``XADD`` is logged and counted
(``sphereface_events_dropped_total``), and the request's answer goes out as if it had worked.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

log = logging.getLogger(__name__)

SUBJECT_CREATED = "subject.created"
SUBJECT_DELETED = "subject.deleted"
FACE_ENROLLED = "face.enrolled"
FACE_DELETED = "face.deleted"
IDENTIFICATION = "identification"
TRACK_STARTED = "track.started"
TRACK_ENDED = "track.ended"
#: Every event type, in the order the docs list them.
EVENT_TYPES = (
    SUBJECT_CREATED, SUBJECT_DELETED, FACE_ENROLLED, FACE_DELETED, IDENTIFICATION, TRACK_STARTED, TRACK_ENDED
)  # fmt: skip


def events_key(prefix: str, name: str) -> str:
    """Key ``name`` of the events, under the hash tag ``{events}`` (one cluster slot)."""
    return f"{prefix}{{events}}:{name}"


def utc_now_rfc3339() -> str:
    """Now as RFC 3339 in UTC with milliseconds, e.g. ``2026-11-27T00:14:11.123Z``."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Event:
    """One event: ``id`` is unique (receivers use it as the idempotency key), ``created_at``
    RFC 3339 UTC, ``data`` the JSON object of its type."""

    type: str
    data: dict[str, Any]
    id: str = field(default_factory=lambda: f"evt_{uuid.uuid4().hex}")
    created_at: str = field(default_factory=utc_now_rfc3339)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "created_at": self.created_at, "data": self.data}

    def body(self) -> bytes:
        """The JSON body a webhook receives (compact, UTF-8): the bytes that are signed."""
        return json.dumps(self.as_dict(), separators=(",", ":"), ensure_ascii=False).encode()

    def stream_fields(self) -> dict[str, str]:
        return {
            "id": self.id,
            "type": self.type,
            "created_at": self.created_at,
            "data": json.dumps(self.data),
        }

    @classmethod
    def from_stream(cls, fields: Mapping[bytes | str, bytes | str]) -> Event:
        """The event of a stream entry's fields (as Redis returns them)."""
        text = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            type=text["type"], data=json.loads(text["data"]), id=text["id"], created_at=text["created_at"]
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class EventStream:
    """Appends events to ``P{events}:stream`` (capped at about ``maxlen`` entries).

    ``identification``: whether identification answers are events too (opt-in).
    ``count_published(type)`` and ``count_dropped(n)`` record them in the metrics."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        prefix: str = "sf:",
        *,
        maxlen: int = 100_000,
        identification: bool = False,
        metrics: Any = None,
    ) -> None:
        self.client = client
        self.key = events_key(prefix, "stream")
        self.maxlen = maxlen
        self.identification = identification
        self.metrics = metrics

    def publish(self, events: Sequence[Event]) -> bool:
        """XADD every event in one round trip; False (logged and counted) when Redis refused."""
        if not events:
            return True
        try:
            pipe = self.client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(self.key, event.stream_fields(), maxlen=self.maxlen, approximate=True)
            pipe.execute()
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            log.warning("%d events not added to %s: %s: %s", len(events), self.key, type(exc).__name__, exc)
            if self.metrics is not None:
                self.metrics.events_dropped.inc(len(events))
            return False
        if self.metrics is not None:
            for event in events:
                self.metrics.events_published.labels(type=event.type).inc()
        return True

    def emit(self, event_type: str, data: dict[str, Any]) -> bool:
        """Publish one event of ``event_type`` with ``data``."""
        return self.publish([Event(event_type, data)])

    def publish_many(self, event_type: str, data: Sequence[dict[str, Any]]) -> bool:
        """Publish one event of ``event_type`` per item of ``data``, in one round trip."""
        return self.publish([Event(event_type, d) for d in data])
