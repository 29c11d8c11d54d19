"""Partitions of the gallery: which keys a subject and its faces live under.

On one Redis the gallery is a single partition whose keys carry no hash tag (``sf:subject:{id}``,
``sf:rev``, ...): the layout every gallery written so far has, read as it is.

On a Redis Cluster every Lua script must touch keys of one slot only, so the gallery is split
into :data:`CLUSTER_PARTITIONS` partitions, each a complete small gallery under its own hash tag
(``sf:{g07.41}:subject:{id}``, ``sf:{g07.41}:rev``, ``sf:{g07.41}:changes``, ...): its subjects,
their faces, its per-model face sets, its photo keys, its revision counter and its change stream.
A subject belongs to the partition given by a stable hash of its id (:func:`partition_of`); a
face id is drawn so that it hashes to its subject's partition (:func:`new_face_id`), so a face is
found from its id alone.

Why 64 partitions: each partition is one slot, and slots (not keys) are what a cluster moves
between primaries when it is resharded or rebalanced, so a primary's share of the gallery is its
share of the partitions. 64 give every primary of a 3-primary cluster 21 or 22 of them, still
several each at 16 primaries, and let a rebalance move a sixty-fourth of the gallery at a time;
more would make every fan-out (the revision check before each identification, listing subjects,
counts) longer for no gain at these sizes.

Why the tags are not plain ``g00``..``g63``: the slot of a tag is a CRC16, so 64 arbitrary tags
fall unevenly into a cluster's slot ranges. Partition ``p``'s tag is ``g<p>.<n>`` with the
smallest ``n`` whose slot lies in the ``p``-th of 64 equal spans of the 16384 slots: primaries
that own equal contiguous ranges of slots (what ``redis-cli --cluster create`` and ``rebalance``
give) then own equal numbers of partitions. The tags are a pure function of the partition
number: the layout never changes.
"""

from __future__ import annotations

import hashlib
import secrets
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

#: Partitions of a gallery on a Redis Cluster (see the module docstring for why 64).
CLUSTER_PARTITIONS = 64


def stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process and version (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def partition_of(identifier: str, partitions: int) -> int:
    """The partition of a subject id or a face id (0 when there is one partition)."""
    return 0 if partitions == 1 else stable_hash(identifier) % partitions


def new_face_id(partition: int = 0, partitions: int = 1) -> str:
    """A random face id (24 hex digits) that hashes to ``partition``: drawn again until it does
    (``partitions`` draws on average, a few microseconds each)."""
    while True:
        face_id = secrets.token_hex(12)
        if partition_of(face_id, partitions) == partition:
            return face_id


@lru_cache(maxsize=8)
def partition_tags(partitions: int) -> tuple[str, ...]:
    """The hash tag of every partition: ``g<p>.<n>`` with the smallest ``n`` whose slot lies in
    the ``p``-th of ``partitions`` equal spans of the cluster's slots."""
    width = len(str(partitions - 1))
    tags = []
    for p in range(partitions):
        low = p * REDIS_CLUSTER_HASH_SLOTS // partitions
        high = (p + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions
        n = 0
        while not low <= key_slot(f"g{p:0{width}d}.{n}".encode()) < high:
            n += 1
        tags.append(f"g{p:0{width}d}.{n}")
    return tuple(tags)


def partition_prefixes(prefix: str, partitions: int) -> tuple[str, ...]:
    """The key prefix of every partition: ``prefix`` itself for one partition (the single-Redis
    layout), else ``prefix{tag}:``."""
    if partitions == 1:
        return (prefix,)
    return tuple(f"{prefix}{{{tag}}}:" for tag in partition_tags(partitions))
