"""API keys: stored hashed in Redis, with the scopes ``read`` and ``admin``.

A key looks like ``sfk_<key_id>_<secret>``: ``key_id`` is 12 hex characters, public, used to
find and revoke the key; ``secret`` comes from :func:`secrets.token_urlsafe`. The full key is
shown once, when it is created; Redis keeps only its SHA-256:

* ``{prefix}apikey:{key_id}``: a hash with the fields ``hash``, ``scope``, ``name``, ``created_at``;
* ``{prefix}apikeys``: the set of every key id.

Scopes: ``read`` may verify, embed, identify and read the gallery; ``admin`` may do all that and
also change the gallery. Besides the stored keys, the admin key of the settings
(``SPHEREFACE_API_KEY``) is accepted as an admin key.

Routes ask for a scope with ``Depends(require_read)`` or ``Depends(require_admin)``; the key is
read from the header ``X-API-Key``. :class:`AuthGate` also takes one token from the key's rate
limit bucket (:mod:`service.rate_limit`) for every ``/v1`` request; with ``auth`` off there are
no keys and no limits.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal

import redis as redis_lib
from fastapi import Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader
from redis.cluster import RedisCluster

from service.errors import (
    REDIS_DOWN_ERRORS,
    InsufficientScopeError,
    InvalidApiKeyError,
    MissingApiKeyError,
    RedisUnavailableError,
    ServiceError,
    error_response,
    redis_unavailable,
)
from service.rate_limit import RateLimiter

Scope = Literal["read", "admin"]

#: Every scope, from the weakest; a scope allows what the ones before it allow.
SCOPES: tuple[Scope, ...] = ("read", "admin")
HEADER_NAME = "X-API-Key"
KEY_PREFIX = "sfk_"
#: The principal of every request while ``auth`` is ``off``.
AUTH_OFF_ID = "auth-off"
#: The principal of the admin key from the settings (``SPHEREFACE_API_KEY``).
ENV_KEY_ID = "env"

_KEY_RE = re.compile(r"^sfk_([0-9a-f]{12})_([A-Za-z0-9_-]{16,})$")
_KEY_ID_RE = re.compile(r"^[0-9a-f]{12}$")
_SCOPE_RANK = {scope: rank for rank, scope in enumerate(SCOPES)}

api_key_header = APIKeyHeader(
    name=HEADER_NAME,
    auto_error=False,
    scheme_name="ApiKey",
    description="An API key (`sfk_...`) with scope `read`, or `admin` to change the gallery",
)


@dataclass(frozen=True)
class ApiKeyInfo:
    """What is known about a stored key; never its secret nor its hash."""

    key_id: str
    scope: Scope
    name: str
    created_at: str  # ISO 8601, UTC


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a stored key's id, ``"env"`` or ``"auth-off"``, and its scope."""

    key_id: str
    scope: Scope

    def allows(self, needed: Scope) -> bool:
        """Whether this principal may use a route that needs the scope ``needed``."""
        return _SCOPE_RANK[self.scope] >= _SCOPE_RANK[needed]


# -- storage --------------------------------------------------------------------------------


def _record_key(prefix: str, key_id: str) -> str:
    return f"{prefix}apikey:{key_id}"


def _index_key(prefix: str) -> str:
    return f"{prefix}apikeys"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_scope(scope: str) -> Scope:
    if scope not in _SCOPE_RANK:
        raise ValueError(f"unknown API key scope {scope!r}: use one of {', '.join(SCOPES)}")
    return scope


@contextmanager
def _redis_errors(doing: str) -> Iterator[None]:
    """Turn a Redis that cannot be reached into :class:`RedisUnavailableError` (503)."""
    try:
        yield
    except REDIS_DOWN_ERRORS as exc:
        raise redis_unavailable(exc, doing) from exc


def parse_key(key: str) -> str | None:
    """The key id of a well-formed key ``sfk_<key_id>_<secret>``, else None."""
    match = _KEY_RE.match(key)
    return match.group(1) if match else None


def create_key(
    redis: redis_lib.Redis, scope: str, name: str = "", prefix: str = "sf:"
) -> tuple[str, ApiKeyInfo]:
    """Create a key with ``scope`` (``read`` or ``admin``); returns the full key, to be shown once.

    Only the SHA-256 of the key is stored. Raises ValueError for an unknown scope.
    """
    checked = _check_scope(scope)
    created_at = datetime.now(UTC).isoformat(timespec="seconds")
    with _redis_errors("create an API key"):
        while True:
            key_id = secrets.token_hex(6)
            # SADD answers 0 when the id is taken (48 random bits: all but impossible).
            if redis.sadd(_index_key(prefix), key_id):
                break
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        redis.hset(
            _record_key(prefix, key_id),
            mapping={"hash": _hash(key), "scope": checked, "name": name, "created_at": created_at},
        )
    return key, ApiKeyInfo(key_id=key_id, scope=checked, name=name, created_at=created_at)


def revoke_key(redis: redis_lib.Redis | RedisCluster, key_or_id: str, prefix: str = "sf:") -> bool:
    """Delete a key given in full or by its id; False when there is no such key."""
    key_or_id = key_or_id.strip()
    key_id = key_or_id if _KEY_ID_RE.match(key_or_id) else parse_key(key_or_id)
    if key_id is None:
        return False
    with _redis_errors("revoke an API key"):
        if isinstance(redis, RedisCluster):
            # The record and the index are in two slots: no transaction spans them. The record
            # goes first, so the key stops working before it leaves the list.
            deleted = redis.delete(_record_key(prefix, key_id))
            removed = redis.srem(_index_key(prefix), key_id)
        else:
            pipe = redis.pipeline(transaction=True)
            pipe.delete(_record_key(prefix, key_id))
            pipe.srem(_index_key(prefix), key_id)
            deleted, removed = pipe.execute()
    return bool(deleted or removed)


def list_keys(redis: redis_lib.Redis, prefix: str = "sf:") -> list[ApiKeyInfo]:
    """Every stored key (id, scope, name, creation time), oldest first; never a hash."""
    with _redis_errors("list the API keys"):
        key_ids = sorted(_text(k) for k in redis.smembers(_index_key(prefix)))
        pipe = redis.pipeline(transaction=False)
        for key_id in key_ids:
            pipe.hmget(_record_key(prefix, key_id), "scope", "name", "created_at")
        records = pipe.execute() if key_ids else []
    keys = []
    for key_id, (scope, name, created_at) in zip(key_ids, records, strict=True):
        if scope is None:  # the id is listed but its record is gone
            continue
        keys.append(
            ApiKeyInfo(key_id=key_id, scope=_text(scope), name=_text(name), created_at=_text(created_at))
        )
    keys.sort(key=lambda k: (k.created_at, k.key_id))
    return keys


# -- authentication -------------------------------------------------------------------------


def authenticate(
    redis: redis_lib.Redis | None, presented: str | None, *, env_key: str | None, prefix: str = "sf:"
) -> Principal:
    """The principal of the key ``presented``.

    ``env_key``, when set, is accepted as an admin key. Hashes are compared in constant time.
    Raises :class:`MissingApiKeyError` without a key, :class:`InvalidApiKeyError` for a
    malformed, unknown or revoked key (the message never repeats the key) and
    :class:`RedisUnavailableError` when Redis cannot be reached.
    """
    presented = (presented or "").strip()
    if not presented:
        raise MissingApiKeyError(f"an API key is needed: send it in the header {HEADER_NAME}")
    digest = _hash(presented)
    if env_key and hmac.compare_digest(digest, _hash(env_key)):
        return Principal(key_id=ENV_KEY_ID, scope="admin")
    key_id = parse_key(presented)
    if key_id is None:
        raise InvalidApiKeyError(f"the API key is malformed: keys look like {KEY_PREFIX}<id>_<secret>")
    if redis is None:
        raise RedisUnavailableError("no Redis is configured, so only the admin key of the settings works")
    with _redis_errors("check the API key"):
        stored, scope = redis.hmget(_record_key(prefix, key_id), "hash", "scope")
    if stored is None or not hmac.compare_digest(digest, _text(stored)):
        raise InvalidApiKeyError(f"the API key with id {key_id} is unknown or revoked")
    scope_text = _text(scope)
    if scope_text not in _SCOPE_RANK:
        raise InvalidApiKeyError(f"the API key with id {key_id} has no valid scope")
    return Principal(key_id=key_id, scope=scope_text)


def request_principal(state, presented: str | None) -> Principal:
    """Who sends a request with the key ``presented``, under the app's settings (typed errors)."""
    settings = state.settings
    if settings.auth == "off":
        return Principal(key_id=AUTH_OFF_ID, scope="admin")
    env_key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    return authenticate(
        getattr(state, "redis", None), presented, env_key=env_key, prefix=settings.redis_prefix
    )


def admit(state, presented: str | None) -> Principal:
    """:func:`request_principal`, then one token from the key's bucket of its scope's rate limit
    (raises :class:`~service.rate_limit.RateLimitedError` when it is empty). Nothing is limited
    with ``auth`` off. Both steps may wait on Redis: the gate runs this in a worker thread."""
    principal = request_principal(state, presented)
    if state.settings.auth == "off":
        return principal
    limiter = getattr(state, "rate_limiter", None)
    if limiter is None:
        limiter = state.rate_limiter = RateLimiter.from_settings(state.settings)
    limiter.check(getattr(state, "redis", None), principal.key_id, principal.scope)
    return principal


class AuthGate:
    """Authenticate every ``/v1`` request before anything reads its body (ASGI middleware).

    FastAPI reads and parses a route's body before it runs the route's dependencies, so without
    this gate a request with no key or a wrong one could make the service read (and parse) up to
    the body limit before being told 401. The routes' dependencies then only check the scope.
    A key over its rate limit is answered 429 ``rate_limited`` with ``Retry-After``, also before
    its body is read. The Redis calls run in a worker thread, never on the event loop.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        presented = None
        for name, value in scope.get("headers") or ():
            if name == HEADER_NAME.lower().encode():
                presented = value.decode("latin-1")
                break
        try:
            principal = await run_in_threadpool(admit, scope["app"].state, presented)
        except ServiceError as exc:  # a rate-limited key's answer carries Retry-After
            return await error_response(exc, headers=getattr(exc, "headers", None))(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        return await self.app(scope, receive, send)


def _requirement(needed: Scope):
    """A FastAPI dependency that lets a request through when its key has scope ``needed``."""

    async def dependency(
        request: Request, api_key: Annotated[str | None, Security(api_key_header)] = None
    ) -> Principal:
        # AuthGate has checked the key of every /v1 request: no Redis, no thread needed here
        principal = getattr(request.state, "principal", None)
        if principal is None:  # the key lookup may ask Redis: off the event loop
            principal = await run_in_threadpool(request_principal, request.app.state, api_key)
        if not principal.allows(needed):
            raise InsufficientScopeError(
                f"this operation needs an API key with scope {needed!r}; "
                f"the key {principal.key_id} has scope {principal.scope!r}"
            )
        request.state.principal = principal
        return principal

    dependency.__name__ = f"require_{needed}"
    dependency.__doc__ = f"Let the request through when its API key has scope {needed!r} (or more)."
    return dependency


#: ``Depends(require_read)``: verify, embed, identify, read the gallery.
require_read = _requirement("read")
#: ``Depends(require_admin)``: also change the gallery.
require_admin = _requirement("admin")
