"""The gallery's writes: acknowledged once enough replicas have them, retried through the passing
states of a Redis Cluster.

Every change of the gallery is one Lua script on one partition (:mod:`service.gallery.store`).
:class:`ScriptWriter` runs a batch of them:

* **Replica acknowledgement.** With a level ``n > 0`` (:class:`WritePolicy`), the scripts sent to
  a node are followed by ``WAIT n ms`` *on the same connection*: Redis counts, for WAIT, the
  replicas that have every write that connection made, so WAIT on another connection (a fresh
  one has made none) would answer at once and prove nothing. On a cluster the writer therefore
  groups the scripts by the primary that owns their slot and sends each group, with its WAIT, as
  one pipeline of that node's own client (one connection). Fewer replicas than ``n`` within
  ``ms`` raise :class:`~service.errors.NotReplicatedError` (503 ``not_replicated``).
* **Retries** (a cluster only). A script a node refused (``MOVED``, ``ASK``, ``TRYAGAIN`` while a
  slot migrates; ``CLUSTERDOWN``, ``MASTERDOWN`` or a refused connection during a failover) is
  sent again, to the node that now owns its slot (after ``ASKING`` for an ``ASK``), with a short
  back-off, until :attr:`WritePolicy.retry_seconds` have passed; then 503 ``redis_unavailable``.
  A node that refused a script did not run it. A dropped connection is different: the script
  may have run before its reply was lost. Such a script is sent again too, and its result says
  ``maybe_repeated``: the gallery's scripts are written so that running one twice changes
  nothing (a face id is chosen before the script runs, and a second add of the same face id
  finds its own photo key and reports it as a duplicate of itself), and the store reads a
  repeated script's answer with that in mind. A stalled node (a timeout) is not retried: the
  caller answers 503 at once, as on one Redis.

On one Redis the writer sends the batch as one pipeline (its ``WAIT``, when the level is over 0,
last on the same connection) and retries nothing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.exceptions import AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError

from service.errors import NotReplicatedError, RedisUnavailableError, redis_unavailable

#: Replies of a node that refused a script without running it: send it again.
REFUSED = (AskError, MovedError, TryAgainError, ClusterDownError)
#: Errors a script meets inside a cluster node that mean the same as a refusal: a key the script
#: did not declare (the removal script builds its face keys) has left with its migrating slot,
#: or the cluster went down. Redis stops the script at that command; what it changed before stays,
#: and every gallery script is written so that running it again finishes the job once.
SCRIPT_REFUSALS = (
    "Script attempted to access a non local key in a cluster node",
    "Script attempted to execute a command while the cluster is down",
    "Script attempted to execute a write command while the cluster is down",
)
#: The first pause between two tries; each next one is twice as long, at most :data:`MAX_PAUSE`.
FIRST_PAUSE = 0.02
MAX_PAUSE = 0.25
#: Redirections (MOVED, ASK) a write follows at once, without waiting, before the back-off applies.
MAX_REDIRECTS = 3

T = TypeVar("T")


@dataclass(frozen=True)
class WritePolicy:
    """How the gallery's writes are acknowledged and retried.

    ``wait_replicas``: replicas that must have a write before it is acknowledged (``WAIT``); None:
    1 when the Redis (a cluster: any primary) has a replica, else 0 (off). ``wait_ms``: how long
    ``WAIT`` waits for them. ``retry_seconds``: how long a cluster's refused writes and failed
    reads are retried before the answer is 503."""

    wait_replicas: int | None = None
    wait_ms: int = 500
    retry_seconds: float = 2.0

    @classmethod
    def from_settings(cls, settings: Any) -> WritePolicy:
        """The policy of the service's settings; ``WAIT`` lasts at most half of ``redis_timeout``,
        so that a write waiting for its replicas is not taken for a stalled Redis."""
        wait_ms = max(1, min(settings.redis_wait_ms, int(settings.redis_timeout * 500)))
        return cls(settings.redis_wait_replicas, wait_ms, settings.redis_retry_seconds)


@dataclass
class Write:
    """One script to run: its keys (all in one slot) and arguments."""

    script: Script
    keys: list[str]
    args: list[Any]


@dataclass
class Outcome:
    """A script's reply, and whether an earlier try of it may have run (its reply was lost)."""

    reply: Any = None
    maybe_repeated: bool = False
    done: bool = field(default=False, repr=False)
    ask: tuple[str, int] | None = field(default=None, repr=False)


def replicas_of(client: redis.Redis | RedisCluster) -> int:
    """How many replicas are connected to the Redis (on a cluster: to its primaries, all asked)."""
    if isinstance(client, RedisCluster):
        infos = client.info("replication", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(info.get("connected_slaves", 0)) for info in infos.values())
    return int(client.info("replication").get("connected_slaves", 0))


def _refused_inside(reply: Any) -> bool:
    """Whether a script's error is one of :data:`SCRIPT_REFUSALS` (send it again later)."""
    return isinstance(reply, redis.ResponseError) and any(text in str(reply) for text in SCRIPT_REFUSALS)


def _graver(first: Exception | None, second: Exception | None) -> Exception | None:
    """Of two refusals, the one to wait for: a redirection (MOVED, ASK) is followed at once."""
    if first is None or (isinstance(first, AskError) and second is not None):
        return second
    return first


def refresh_slots(client: RedisCluster, error: BaseException | None) -> None:
    """Learn the cluster's slots again after a redirection or a lost node (not after an ASK or a
    TRYAGAIN: the slot's owner has not changed yet)."""
    if error is None or (isinstance(error, (AskError, TryAgainError)) and not isinstance(error, MovedError)):
        return
    try:
        client.nodes_manager.initialize()
    except (redis.RedisError, OSError):
        pass  # no node answered yet: the next try uses the slots as known


class ScriptWriter:
    """Runs batches of gallery scripts under a :class:`WritePolicy` (see the module docstring)."""

    def __init__(self, client: redis.Redis | RedisCluster, policy: WritePolicy | None = None) -> None:
        self.client = client
        self.policy = policy or WritePolicy()
        self.cluster = isinstance(client, RedisCluster)
        self._level = self.policy.wait_replicas

    def level(self) -> int:
        """The replicas a write waits for (the automatic level is found on first use)."""
        if self._level is None:
            self._level = 1 if replicas_of(self.client) > 0 else 0
        return self._level

    def run(self, writes: Sequence[Write]) -> list[Outcome]:
        """Run the scripts; one :class:`Outcome` per write, in order. Raises the typed 503s."""
        if not self.cluster:
            return self._run_single(writes)
        return self._run_cluster(writes)

    # -- one Redis --------------------------------------------------------------------------
    def _run_single(self, writes: Sequence[Write]) -> list[Outcome]:
        level = self.level()
        if level == 0 and len(writes) == 1:  # one script, no WAIT: no pipeline needed
            (write,) = writes
            return [Outcome(write.script(keys=write.keys, args=write.args), done=True)]
        pipe = self.client.pipeline(transaction=False)
        for write in writes:
            write.script(keys=write.keys, args=write.args, client=pipe)
        if level > 0:
            pipe.execute_command("WAIT", level, self.policy.wait_ms)
        replies = pipe.execute()
        if level > 0:
            self._check_wait(replies.pop(), level)
        return [Outcome(reply, done=True) for reply in replies]

    def _check_wait(self, acknowledged: int, level: int) -> None:
        if int(acknowledged) < level:
            raise NotReplicatedError.of(int(acknowledged), level, self.policy.wait_ms)

    # -- a cluster --------------------------------------------------------------------------
    def _run_cluster(self, writes: Sequence[Write]) -> list[Outcome]:
        outcomes = [Outcome() for _ in writes]
        deadline = time.monotonic() + self.policy.retry_seconds
        pause = FIRST_PAUSE
        redirects = 0
        while True:
            refused = self._cluster_round(writes, outcomes)
            if all(o.done for o in outcomes):
                return outcomes
            refresh_slots(self.client, refused)  # for the next try, or the next request
            if isinstance(refused, AskError) and redirects < MAX_REDIRECTS:
                redirects += 1  # the node that has the slot is known: no need to wait
                continue
            if time.monotonic() + pause > deadline:
                raise redis_unavailable(refused or ClusterDownError("writes refused"), "change the gallery")
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE)

    def _cluster_round(self, writes: Sequence[Write], outcomes: list[Outcome]) -> Exception | None:
        """Send every write not done yet, grouped by node; returns a refusal seen, a redirection
        only when nothing else was refused."""
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        refused: Exception | None = None
        for i, outcome in enumerate(outcomes):
            if outcome.done:
                continue
            try:
                node = self._node_of(writes[i], outcome)
            except SlotNotCoveredError as exc:  # no owner known yet: learn the slots, try again
                refused = _graver(refused, exc)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        for node, indices in groups.values():
            sent = self._send_to_node(node, [writes[i] for i in indices], [outcomes[i] for i in indices])
            refused = _graver(refused, sent)
        return refused

    def _node_of(self, write: Write, outcome: Outcome) -> ClusterNode:
        if outcome.ask is not None:
            host, port = outcome.ask
            node = self.client.get_node(host=host, port=port)
            if node is not None:
                return node
        return self.client.get_node_from_key(write.keys[0])

    def _send_to_node(
        self, node: ClusterNode, writes: list[Write], outcomes: list[Outcome]
    ) -> Exception | None:
        """One pipeline on the node's own connection: the scripts, then WAIT; returns a refusal."""
        level = self.level()
        pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
        for write, outcome in zip(writes, outcomes, strict=True):
            if outcome.ask is not None:
                pipe.execute_command("ASKING")
            pipe.execute_command("EVAL", write.script.script, len(write.keys), *write.keys, *write.args)
        if level > 0:
            pipe.execute_command("WAIT", level, self.policy.wait_ms)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.TimeoutError:
            raise
        except (redis.ConnectionError, OSError) as exc:
            for outcome in outcomes:
                outcome.maybe_repeated = True  # it may have run before the connection dropped
            return exc
        if level > 0:
            acknowledged = replies.pop()
            if isinstance(acknowledged, Exception):
                acknowledged = 0  # a node that cannot count its replicas confirms none
        refused = self._take_replies(replies, outcomes)
        if level > 0 and any(o.done for o in outcomes):
            self._check_wait(acknowledged, level)
        return refused

    @staticmethod
    def _take_replies(replies: list[Any], outcomes: list[Outcome]) -> Exception | None:
        """Record each script's reply (skipping ASKING's); a refused one stays to send again."""
        replies = iter(replies)
        refused: Exception | None = None
        for outcome in outcomes:
            if outcome.ask is not None:
                next(replies)  # ASKING's OK
                outcome.ask = None
            reply = next(replies)
            if isinstance(reply, AskError) and not isinstance(reply, MovedError):
                outcome.ask = reply.node_addr
            if isinstance(reply, REFUSED) or _refused_inside(reply):
                refused = _graver(refused, reply)
                outcome.maybe_repeated = outcome.maybe_repeated or not isinstance(reply, REFUSED)
            elif isinstance(reply, Exception):
                raise reply
            else:
                outcome.reply, outcome.done = reply, True
        return refused


#: What a read retries on a cluster: the refusals of :data:`REFUSED`, a slot no node serves yet,
#: a lost connection (a primary that died). Not a timeout: a stalled node answers 503 at once.
READ_RETRIED = (*REFUSED, SlotNotCoveredError, redis.ConnectionError)

_reading = threading.local()


def retry_passing(call: Callable[[], T], store: Any) -> T:
    """``call()``, again with back-off for the store's ``policy.retry_seconds`` while a cluster
    refuses it in passing (see :data:`READ_RETRIED`); one Redis, or a call inside another retried
    one, runs once (the outer one retries)."""
    if not store.cluster or getattr(_reading, "active", False):
        return call()
    deadline = time.monotonic() + store.policy.retry_seconds
    pause = FIRST_PAUSE
    _reading.active = True
    try:
        while True:
            try:
                return call()
            except RedisUnavailableError as exc:
                cause = exc.__cause__
                passing = isinstance(cause, READ_RETRIED) and not isinstance(cause, redis.TimeoutError)
                if not passing or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE)
            refresh_slots(store.redis, cause)
    finally:
        _reading.active = False


def retried_read(method: Callable[..., T]) -> Callable[..., T]:
    """A read-only method of the store, retried on a cluster by :func:`retry_passing`."""

    @functools.wraps(method)
    def read(store: Any, *args: Any, **kwargs: Any) -> T:
        return retry_passing(lambda: method(store, *args, **kwargs), store)

    return read
