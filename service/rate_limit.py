"""Per-key rate limits: a token bucket per API key, kept in Redis so that every worker and every
pod on the same Redis draws from the same bucket.

A bucket holds up to ``burst`` tokens and gains ``per_second`` tokens a second; every ``/v1``
request of a key takes one token (whatever its route), and a request that finds less than one
token is answered 429 ``rate_limited`` with ``Retry-After``: the whole seconds until a token is
there (at least 1). The rate and the burst are set per scope (``SPHEREFACE_RATE_LIMIT_READ``,
``SPHEREFACE_RATE_LIMIT_ADMIN`` and their ``_BURST``); a scope without a rate is not limited.

Project decisions, with their reasons:

* one token per request: the key is checked before the body is read, so what a request holds
  (how many photos, or only embeddings) is not known yet; what a client can count is requests,
  and the face path's CPU is bounded per worker by admission control anyway;
* one Lua script does the whole step (read, refill, take, write, expire) on the Redis server's
  clock (``TIME``): atomic whatever the number of workers and pods, one round trip, no clock
  skew between machines. A bucket is a hash of two fields that expires once it would be full
  again, so idle keys cost no memory. It is kept in memory only (not in the append-only file,
  not replicated): a restarted or failed-over Redis starts every bucket full;
* the ``limits`` library was not used: it has fixed and sliding windows but no token bucket,
  tells the wait until the next request only through a second, separate call, and its moving
  window times requests by each worker's own clock;
* when Redis fails, the limiter lets requests through (fails open) and does not ask Redis again
  for ``cooldown`` seconds: the keyed routes answer 503 ``redis_unavailable`` anyway, and the
  face path (verify, embed), which needs no Redis, keeps its normal speed.

Needs Redis 5 or later (scripts replicate their effects, so a script may write after ``TIME``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis as redis_lib
from redis.commands.core import Script

from service.errors import ServiceError

log = logging.getLogger(__name__)

#: One step of a token bucket. KEYS[1]: the bucket, a hash {tokens, at} (at: milliseconds of the
#: Redis server's clock). ARGV: tokens per second, the bucket's size. Takes one token when there
#: is one. Returns {1 if taken else 0, whole tokens left, milliseconds until a token is there}.
#: Its writes go neither to the append-only file nor to replicas (REPL_NONE): a bucket is
#: worth nothing after a restart, and with ``appendfsync always`` every request would wait for
#: a disk flush (3.4 ms measured on a local redis-server, against 0.18 ms without).
TOKEN_BUCKET_LUA = """
redis.set_repl(redis.REPL_NONE)
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
if now > at then
  tokens = math.min(burst, tokens + (now - at) * rate / 1000)
end
if tokens < 1 then
  return {0, 0, math.ceil((1 - tokens) * 1000 / rate)}
end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) * 1000 / rate) + 1000)
return {1, math.floor(tokens), 0}
"""
#: The script, run on whichever client is given (EVALSHA; loaded again after a Redis restart).
_TOKEN_BUCKET = Script(None, TOKEN_BUCKET_LUA.encode("utf-8"))


class RateLimitedError(ServiceError):
    """A key made more requests than its scope's rate allows; ``retry_after``: whole seconds
    (at least 1) until its bucket holds a token again."""

    code = "rate_limited"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        """The headers of the 429 answer: ``Retry-After`` in whole seconds."""
        return {"Retry-After": str(self.retry_after)}


@dataclass(frozen=True)
class Rate:
    """A bucket's refill rate (tokens, that is requests, per second) and size (requests at once)."""

    per_second: float
    burst: int


@dataclass(frozen=True)
class Taken:
    """One step of a bucket: whether a token was taken, whole tokens left, and milliseconds until
    the next token (0 when one was taken)."""

    allowed: bool
    remaining: int
    wait_ms: int

    @property
    def retry_after(self) -> int:
        """The wait as ``Retry-After`` says it: whole seconds, at least 1."""
        return max(1, math.ceil(self.wait_ms / 1000))


def bucket_key(prefix: str, key_id: str) -> str:
    """The Redis key of the bucket of the API key ``key_id`` (``"env"``: the settings' key)."""
    return f"{prefix}ratelimit:{key_id}"


def scope_rates(settings: Any) -> dict[str, Rate | None]:
    """Each scope's :class:`Rate` from the settings (``rate_limit_<scope>`` and
    ``rate_limit_<scope>_burst``, default twice the rate, at least 1); None: no limit."""
    rates: dict[str, Rate | None] = {}
    for scope in ("read", "admin"):
        per_second = getattr(settings, f"rate_limit_{scope}")
        burst = getattr(settings, f"rate_limit_{scope}_burst")
        if per_second is None:
            rates[scope] = None
        else:
            rates[scope] = Rate(per_second, burst if burst is not None else max(1, math.ceil(2 * per_second)))
    return rates


class RateLimiter:
    """The buckets of every key, by scope; :meth:`check` takes a token or raises 429.

    ``cooldown``: seconds to let requests through without asking Redis after Redis failed.
    """

    def __init__(self, rates: Mapping[str, Rate | None], prefix: str = "sf:", cooldown: float = 5.0) -> None:
        self.rates = dict(rates)
        self.prefix = prefix
        self.cooldown = cooldown
        self._skip_until = 0.0

    @classmethod
    def from_settings(cls, settings: Any) -> RateLimiter:
        """The limiter of the service's settings (rates per scope, the Redis key prefix)."""
        return cls(scope_rates(settings), prefix=settings.redis_prefix)

    def take(self, client: redis_lib.Redis, key_id: str, rate: Rate) -> Taken:
        """One step of the bucket of ``key_id`` at ``rate`` (raises redis errors)."""
        allowed, remaining, wait_ms = _TOKEN_BUCKET(
            keys=[bucket_key(self.prefix, key_id)], args=[rate.per_second, rate.burst], client=client
        )
        return Taken(bool(allowed), int(remaining), int(wait_ms))

    def check(self, client: redis_lib.Redis | None, key_id: str, scope: str) -> Taken | None:
        """Take a token for a request of the key ``key_id`` with scope ``scope``.

        Returns None when the scope has no limit or the limiter lets the request through without
        Redis (none configured, or it failed less than ``cooldown`` seconds ago); raises
        :class:`RateLimitedError` when the bucket is empty.
        """
        rate = self.rates.get(scope)
        if rate is None or client is None or time.monotonic() < self._skip_until:
            return None
        try:
            taken = self.take(client, key_id, rate)
        except redis_lib.RedisError as exc:
            self._skip_until = time.monotonic() + self.cooldown
            log.warning(
                "rate limits let requests through for %g s: Redis failed (%s: %s)",
                self.cooldown,
                type(exc).__name__,
                exc,
            )
            return None
        if not taken.allowed:
            raise RateLimitedError(
                f"the key {key_id} made more requests than its scope {scope!r} allows "
                f"({rate.per_second:g} per second, {rate.burst} at once); "
                f"try again in {taken.retry_after} s",
                taken.retry_after,
            )
        return taken
