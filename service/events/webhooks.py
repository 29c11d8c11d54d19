"""Webhook endpoints (``SPHEREFACE_WEBHOOKS``) and the signature of what is sent to them.

The setting is a JSON list, or the path of a file that holds one; each entry an object::

    {"url": "https://example.org/hooks/faces", "secret": "...", "events": ["face.enrolled"], "name": "crm"}

``url`` (http or https) and ``secret`` (at least 16 characters) are required; ``events`` (default:
every type but ``identification``, which must be named) filters the types; ``name`` (letters,
digits, ``._-``; default: derived from the URL) names the webhook in keys, metrics and the
dead-letter API. A bad entry refuses the start with ``invalid_webhooks`` naming the entry.

Signature: ``X-SphereFace-Signature: sha256=<hex>``, the HMAC-SHA256 with the webhook's secret of
``"<X-SphereFace-Timestamp>.<raw body>"`` (the timestamp in whole Unix seconds).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from service.errors import ServiceError
from service.events.stream import EVENT_TYPES, IDENTIFICATION

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MIN_SECRET_LENGTH = 16
#: The types a webhook gets when it names none: every type but the opt-in identification.
DEFAULT_TYPES = tuple(t for t in EVENT_TYPES if t != IDENTIFICATION)


class WebhookConfigError(ServiceError):
    """``SPHEREFACE_WEBHOOKS`` cannot be read, or one of its entries is wrong."""

    code = "invalid_webhooks"


@dataclass(frozen=True)
class WebhookEndpoint:
    """One receiver of events: ``types`` are the event types it gets."""

    name: str
    url: str
    secret: str
    types: tuple[str, ...] = DEFAULT_TYPES

    def wants(self, event_type: str) -> bool:
        return event_type in self.types


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=<hex>``: HMAC-SHA256 of ``"<timestamp>.<body>"`` with ``secret``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def parse_webhooks(value: str | None) -> list[WebhookEndpoint]:
    """The endpoints of ``SPHEREFACE_WEBHOOKS`` (a JSON list or a file holding one); none when
    unset. Raises WebhookConfigError naming the entry at fault."""
    text = (value or "").strip()
    if not text:
        return []
    if text[0] not in "[{":  # not JSON: the path of a file
        path = Path(text).expanduser()
        try:
            text = path.read_text()
        except OSError as exc:
            raise WebhookConfigError(f"SPHEREFACE_WEBHOOKS: cannot read the file {path}: {exc}") from exc
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WebhookConfigError(f"SPHEREFACE_WEBHOOKS is not JSON: {exc}") from exc
    if not isinstance(entries, list):
        raise WebhookConfigError("SPHEREFACE_WEBHOOKS must be a JSON list of webhook objects")
    endpoints = [_endpoint(index, entry) for index, entry in enumerate(entries)]
    names = [e.name for e in endpoints]
    for name in names:
        if names.count(name) > 1:
            raise WebhookConfigError(f"SPHEREFACE_WEBHOOKS: two webhooks are named {name!r}")
    return endpoints


def _endpoint(index: int, entry: Any) -> WebhookEndpoint:
    """Entry ``index`` of the list as an endpoint (WebhookConfigError naming it when wrong)."""
    where = f"SPHEREFACE_WEBHOOKS entry {index}"
    if not isinstance(entry, dict):
        raise WebhookConfigError(f"{where} is not an object with url and secret")
    unknown = sorted(set(entry) - {"url", "secret", "events", "name"})
    if unknown:
        raise WebhookConfigError(f"{where} has unknown fields: {', '.join(unknown)}")
    url = entry.get("url")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookConfigError(f"{where}: url must be an http:// or https:// URL, not {url!r}")
    where = f"{where} ({url})"
    secret = entry.get("secret")
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_LENGTH:
        raise WebhookConfigError(
            f"{where}: secret must be a string of at least {MIN_SECRET_LENGTH} characters"
        )
    types = entry.get("events", list(DEFAULT_TYPES))
    if not isinstance(types, list) or not types or any(t not in EVENT_TYPES for t in types):
        raise WebhookConfigError(f"{where}: events must be a non-empty list of {', '.join(EVENT_TYPES)}")
    name = entry.get("name", hashlib.sha256(url.encode()).hexdigest()[:12])
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise WebhookConfigError(f"{where}: name must be 1 to 64 letters, digits or ._- , not {name!r}")
    return WebhookEndpoint(name=name, url=url, secret=secret, types=tuple(dict.fromkeys(types)))
