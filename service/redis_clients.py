"""The gallery's Redis clients: one Redis (a URL) or a Redis Cluster (some of its nodes)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from service.errors import RedisSetupError
from service.settings import Settings


def redis_client(url: str, timeout: float) -> redis.Redis:
    """A client that gives up on a stalled Redis after ``timeout`` seconds without retrying (the
    caller answers 503 at once), retries once a connection that was refused or dropped (free, and
    what a restarted Redis needs for its pooled connections), and reconnects by itself."""
    return redis.Redis.from_url(
        url,
        protocol=2,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        health_check_interval=30,
    )


def cluster_client(nodes: list[tuple[str, int]], timeout: float) -> RedisCluster:
    """A Redis Cluster client from some of its nodes (it learns the others and the slots from
    them), with the same timeouts as :func:`redis_client`; reads go to the primaries.

    Raises:
        RedisSetupError: none of the nodes answered as a cluster node.
    """
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            protocol=2,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
        )
    except (redis.RedisError, RedisClusterException, OSError) as exc:
        listed = ",".join(f"{host}:{port}" for host, port in nodes)
        raise RedisSetupError(f"the Redis Cluster at {listed} does not answer as a cluster: {exc}") from exc


def gallery_client(settings: Settings, timeout: float | None = None) -> redis.Redis | RedisCluster:
    """The client of the gallery's Redis the settings name: a cluster (``redis_cluster``) or one
    Redis (``redis_url``); ``timeout`` defaults to ``redis_timeout``."""
    settings.check_redis()
    timeout = settings.redis_timeout if timeout is None else timeout
    if settings.redis_cluster:
        return cluster_client(settings.cluster_nodes(), timeout)
    if not settings.redis_url:
        raise RedisSetupError(
            "no Redis for the gallery: set REDIS_URL (e.g. redis://localhost:6379/0) or "
            "SPHEREFACE_REDIS_CLUSTER, or run `sphereface serve`, which starts a local redis-server"
        )
    return redis_client(settings.redis_url, timeout)
