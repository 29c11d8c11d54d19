"""The token bucket of the per-key rate limits on a real redis-server: its burst, its wait, its
refill, atomic and shared by every client, kept out of the append-only file, and out of the way
when Redis fails (the app and a real `sphereface serve`: tests/test_rate_limit_api.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from service.errors import HTTP_STATUS_BY_CODE
from service.rate_limit import Rate, RateLimitedError, RateLimiter, bucket_key, scope_rates
from service.serve_process import free_port
from service.settings import Settings

# -- the bucket ----------------------------------------------------------------------------------


def test_a_bucket_gives_its_burst_then_429_with_the_wait(redis_client: redis.Redis) -> None:
    limiter = RateLimiter({"read": Rate(per_second=0.25, burst=3), "admin": None})
    remaining = [limiter.check(redis_client, "k1", "read").remaining for _ in range(3)]
    assert remaining == [2, 1, 0]
    with pytest.raises(RateLimitedError) as refused:
        limiter.check(redis_client, "k1", "read")
    assert refused.value.code == "rate_limited" and HTTP_STATUS_BY_CODE["rate_limited"] == 429
    # one token every 4 s: the wait is the whole seconds until the next one, here all 4 of them
    assert refused.value.retry_after == 4 and refused.value.headers == {"Retry-After": "4"}
    assert "k1" in refused.value.message and "0.25 per second, 3 at once" in refused.value.message
    # another key has a bucket of its own; a scope without a rate is not limited
    assert limiter.check(redis_client, "k2", "read").remaining == 2
    assert all(limiter.check(redis_client, "k1", "admin") is None for _ in range(10))


def test_the_bucket_refills_after_the_stated_time(redis_client: redis.Redis) -> None:
    limiter = RateLimiter({"read": Rate(per_second=1.0, burst=2)})
    limiter.check(redis_client, "k", "read")
    limiter.check(redis_client, "k", "read")
    taken = limiter.take(redis_client, "k", Rate(1.0, 2))
    assert not taken.allowed and 0 < taken.wait_ms <= 1000 and taken.retry_after == 1
    time.sleep(taken.wait_ms / 1000 + 0.05)  # the stated wait, and a little more
    assert limiter.check(redis_client, "k", "read").remaining == 0  # one token came back
    with pytest.raises(RateLimitedError):  # and only one (the next is a second away)
        limiter.check(redis_client, "k", "read")


def test_the_bucket_is_atomic_and_shared_by_every_client(
    redis_client: redis.Redis, other_client: redis.Redis
) -> None:
    """Eight threads on two connections (two workers) and two limiters: exactly the burst is let
    through (one token per 100 s: none comes back during the test)."""
    rate = Rate(per_second=0.01, burst=40)
    limiters = [RateLimiter({"read": rate}), RateLimiter({"read": rate})]
    clients = [redis_client, other_client]
    outcomes: Counter[bool] = Counter()
    lock = threading.Lock()

    def hammer(index: int) -> None:
        for _ in range(15):
            taken = limiters[index % 2].take(clients[index % 2], "shared", rate)
            with lock:
                outcomes[taken.allowed] += 1

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {True: 40, False: 80}


def test_buckets_stay_out_of_the_append_only_file_and_expire(redis_server, redis_client) -> None:
    limiter = RateLimiter({"read": Rate(per_second=10.0, burst=20)}, prefix="rl:")
    limiter.check(redis_client, "k", "read")
    redis_client.set("rl:control", "written")  # a write of the gallery goes to the AOF
    assert set(redis_client.hgetall(bucket_key("rl:", "k"))) == {b"tokens", b"at"}
    # the bucket is gone once it would be full again: 1 token at 10/s, plus a second
    assert 0 < redis_client.pttl(bucket_key("rl:", "k")) <= 1100
    aof = b"".join(p.read_bytes() for p in Path(redis_server.data_dir).rglob("*.aof"))
    assert b"rl:control" in aof and b"ratelimit" not in aof


def test_a_scope_without_a_rate_never_asks_redis(redis_client: redis.Redis) -> None:
    down = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=None)
    limiter = RateLimiter({"read": None, "admin": None})
    assert all(limiter.check(down, "k", scope) is None for scope in ("read", "admin", "other"))
    assert limiter._skip_until == 0.0  # it did not even fail
    assert limiter.check(None, "k", "read") is None


def test_a_redis_that_fails_lets_requests_through_and_is_left_alone_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    down = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=None)
    limiter = RateLimiter({"read": Rate(per_second=1.0, burst=1)}, cooldown=0.3)
    tries = []
    take = limiter.take
    monkeypatch.setattr(limiter, "take", lambda *args: tries.append(1) or take(*args))
    assert [limiter.check(down, "k", "read") for _ in range(5)] == [None] * 5
    assert len(tries) == 1  # the first failure; then no Redis for the cooldown
    time.sleep(0.35)
    assert limiter.check(down, "k", "read") is None and len(tries) == 2


def test_rates_per_scope_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = scope_rates(Settings())
    assert defaults == {"read": Rate(50.0, 100), "admin": None}
    monkeypatch.setenv("SPHEREFACE_RATE_LIMIT_READ", "off")
    monkeypatch.setenv("SPHEREFACE_RATE_LIMIT_ADMIN", "2.5")
    monkeypatch.setenv("SPHEREFACE_RATE_LIMIT_ADMIN_BURST", "7")
    assert scope_rates(Settings()) == {"read": None, "admin": Rate(2.5, 7)}
    monkeypatch.setenv("SPHEREFACE_RATE_LIMIT_ADMIN", "0.2")
    monkeypatch.setenv("SPHEREFACE_RATE_LIMIT_ADMIN_BURST", "")
    assert scope_rates(Settings())["admin"] == Rate(0.2, 1)  # twice the rate, at least 1
