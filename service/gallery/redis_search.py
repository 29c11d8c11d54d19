"""Identification search by the Redis Query Engine (Redis Stack, Redis 8): exact FLAT KNN.

One index per model over the face hashes of that model (``FILTER @model_id==...``), so vectors
of different models are never compared. The engine ranks faces; subjects are aggregated here
(best face per subject), asking for more neighbours until k distinct subjects are found.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import redis

from service.errors import RedisSetupError
from service.gallery.index import SubjectHit
from service.gallery.store import _redis_errors
from service.redis_server import has_query_engine


class RedisKnnSearch:
    """Top-k subjects by the Query Engine's FLAT (exact) cosine KNN over one model's faces."""

    def __init__(self, client: redis.Redis, *, model_id: str, dim: int, prefix: str = "sf:") -> None:
        self.redis = client
        self.model_id = model_id
        self.dim = dim
        self.prefix = prefix
        digest = hashlib.sha256(model_id.encode()).hexdigest()[:16]
        self.index_name = f"{prefix}idx:{digest}:{dim}"

    def ensure_index(self, timeout: float = 600.0) -> None:
        """Create the index if missing and wait until the engine has indexed existing faces."""
        if not has_query_engine(self.redis):
            raise RedisSetupError(
                "SPHEREFACE_SEARCH=redis needs a Redis with the Query Engine (Redis Stack or Redis 8); "
                "this server has no FT.* commands: use SPHEREFACE_SEARCH=numpy"
            )
        existing = {_text(n) for n in self.redis.execute_command("FT._LIST")}
        if self.index_name not in existing:
            model = self.model_id.replace("\\", "\\\\").replace('"', '\\"')
            self.redis.execute_command(
                "FT.CREATE", self.index_name, "ON", "HASH", "PREFIX", "1", f"{self.prefix}face:",
                "FILTER", f'@model_id=="{model}"',
                "SCHEMA", "model_id", "TAG", "subject", "TAG",
                "embedding", "VECTOR", "FLAT", "6", "TYPE", "FLOAT32", "DIM", str(self.dim),
                "DISTANCE_METRIC", "COSINE",
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while self._indexing() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _info(self) -> dict:
        info = self.redis.execute_command("FT.INFO", self.index_name)
        if isinstance(info, dict):  # RESP3: a map
            return {_text(key): value for key, value in info.items()}
        return dict(zip(map(_text, info[::2]), info[1::2], strict=True))  # RESP2: a flat list

    def _indexing(self) -> bool:
        return _text(self._info().get("indexing", 0)) not in ("0", "0.0")

    def __len__(self) -> int:
        """Faces in the index."""
        with _redis_errors():
            return int(float(_text(self._info().get("num_docs", 0))))

    def search(self, queries: np.ndarray, k: int) -> list[list[SubjectHit]]:
        queries = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        if k < 1:  # as VectorIndex: no hits (the loop below would return every subject)
            return [[] for _ in queries]
        with _redis_errors():
            return [self._search_one(q, k) for q in queries]

    def _search_one(self, query: np.ndarray, k: int) -> list[SubjectHit]:
        blob = query.astype("<f4").tobytes()
        neighbours = max(4 * k, 64)
        while True:
            reply = self.redis.execute_command(
                "FT.SEARCH", self.index_name, f"*=>[KNN {neighbours} @embedding $vec AS dist]",
                "PARAMS", "2", "vec", blob, "SORTBY", "dist", "RETURN", "2", "subject", "dist",
                "LIMIT", "0", str(neighbours), "TIMEOUT", "0", "DIALECT", "2",
            )  # fmt: skip
            rows = _search_rows(reply)
            hits: list[SubjectHit] = []
            seen: set[str] = set()
            for key, values in rows:
                subject = values["subject"]
                if subject in seen:
                    continue
                seen.add(subject)
                face_id = _text(key)[len(self.prefix) + len("face:") :]
                # COSINE in the engine is a distance: 1 - cos.
                hits.append(SubjectHit(subject, 1.0 - float(values["dist"]), face_id))
                if len(hits) == k:
                    return hits
            # The reply's total is the size of the KNN result (at most ``neighbours``), not the
            # number of faces: only a reply shorter than asked for shows that none are left.
            if len(rows) < neighbours:
                return hits
            neighbours *= 4

    def drop(self) -> None:
        self.redis.execute_command("FT.DROPINDEX", self.index_name)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _search_rows(reply) -> list[tuple[bytes | str, dict[str, str]]]:
    """(document key, returned fields) of an FT.SEARCH reply, RESP2 or RESP3."""
    if isinstance(reply, dict):  # RESP3: {total_results, results: [{id, extra_attributes}, ...]}
        reply = {_text(key): value for key, value in reply.items()}
        rows = []
        for result in reply.get("results", []):
            result = {_text(key): value for key, value in result.items()}
            fields = result.get("extra_attributes") or {}
            rows.append((result["id"], {_text(k): _text(v) for k, v in fields.items()}))
        return rows
    # RESP2: [total, key, [field, value, ...], key, [...], ...]
    body = reply[1:]
    return [
        (key, dict(zip(map(_text, fields[::2]), map(_text, fields[1::2]), strict=True)))
        for key, fields in zip(body[::2], body[1::2], strict=True)
    ]
