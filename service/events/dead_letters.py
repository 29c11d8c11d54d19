"""A webhook's dead letters: events that failed ``webhook_max_attempts`` times, kept in the
stream ``P{events}:dead:<webhook>`` (about 10,000 per webhook) for an admin to read, send again
or delete (``/v1/events/dead-letters``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from service.events.delivery import WebhookKeys
from service.events.stream import Event


@dataclass(frozen=True)
class DeadLetter:
    """``id``: the dead letter's own id (a stream entry id); ``event`` as the webhook got it."""

    id: str
    webhook: str
    event: dict[str, Any]
    attempts: int
    last_error: str
    failed_at: str


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _dead_letter(webhook: str, entry_id: bytes | str, fields: dict) -> DeadLetter:
    text = {_text(k): _text(v) for k, v in fields.items()}
    return DeadLetter(
        id=_text(entry_id),
        webhook=webhook,
        event=json.loads(text["event"]),
        attempts=int(text["attempts"]),
        last_error=text["last_error"],
        failed_at=text["failed_at"],
    )


def list_dead_letters(
    client: redis.Redis | RedisCluster, prefix: str, webhook: str, limit: int = 100
) -> list[DeadLetter]:
    """The webhook's newest dead letters first, at most ``limit``."""
    entries = client.xrevrange(WebhookKeys(prefix, webhook).dead, count=limit)
    return [_dead_letter(webhook, entry_id, fields) for entry_id, fields in entries]


def delete_dead_letter(client: redis.Redis | RedisCluster, prefix: str, webhook: str, letter_id: str) -> bool:
    """Delete one dead letter; False when there is none of that id."""
    return bool(client.xdel(WebhookKeys(prefix, webhook).dead, letter_id))


def redeliver_dead_letter(
    client: redis.Redis | RedisCluster, prefix: str, webhook: str, letter_id: str, maxlen: int
) -> Event | None:
    """Put a dead letter's event back on the event stream for this webhook only (same event id,
    attempts counted from 1 again) and delete the dead letter; None when there is none."""
    keys = WebhookKeys(prefix, webhook)
    found = client.xrange(keys.dead, min=letter_id, max=letter_id)
    if not found:
        return None
    letter = _dead_letter(webhook, *found[0])
    event = Event(
        type=letter.event["type"],
        data=letter.event["data"],
        id=letter.event["id"],
        created_at=letter.event["created_at"],
    )
    client.xadd(keys.stream, {**event.stream_fields(), "only": webhook}, maxlen=maxlen, approximate=True)
    client.xdel(keys.dead, letter_id)
    return event
