"""The incremental clustering of unknown faces: which cluster a new face joins.

The rule (average link to the best few faces): a new face ``x`` scores each cluster ``C`` that
holds at least one face within the threshold by the mean of its ``min(LINK_FACES, |C|)`` highest
cosines to ``C``'s faces. It joins the cluster of the highest score when that score reaches the
threshold; otherwise it starts a cluster of its own. Clusters never merge and faces never move, so
a cluster id stays valid for as long as one of its faces is kept.

The threshold is a cosine in [-1, 1] from the model's calibration: a face joins a cluster only when
it is at least as close to the cluster's best faces as two photos of one person must be at the
calibrated false-accept rate (per comparison). Asking for several close faces (not just one)
keeps one chance match from chaining two people together.

:class:`PoolView` is the in-process copy of one model's pool that the rule runs on; the service
keeps it current from Redis (:mod:`service.unknowns.pool`) and the benchmark drives it directly.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

#: The cluster's faces whose cosines to a new face are averaged (fewer when it is smaller).
LINK_FACES = 3


class PoolView:
    """Unit vectors of pooled faces (float32, (n, dim)), each face's cluster and time (seconds)."""

    def __init__(self, dim: int, capacity: int = 1024) -> None:
        self.dim = dim
        self.vectors = np.zeros((capacity, dim), np.float32)
        self.ids: list[str] = []
        self.clusters: list[str] = []
        self.times: list[float] = []
        self.rows: dict[str, int] = {}
        self.members: dict[str, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, face_id: str) -> bool:
        return face_id in self.rows

    def clear(self) -> None:
        self.__init__(self.dim, max(1024, len(self.vectors) // 4))

    def add(self, face_id: str, vector: np.ndarray, cluster_id: str, at: float) -> None:
        """Add a face (a face already here is left as it is: adds may be replayed)."""
        if face_id in self.rows:
            return
        n = len(self.ids)
        if n == len(self.vectors):
            grown = np.zeros((2 * n, self.dim), np.float32)
            grown[:n] = self.vectors
            self.vectors = grown
        self.vectors[n] = vector
        self.rows[face_id] = n
        self.ids.append(face_id)
        self.clusters.append(cluster_id)
        self.times.append(at)
        self.members[cluster_id].add(face_id)

    def remove(self, face_id: str) -> bool:
        """Remove a face (the last row moves into its place); False when it is not here."""
        row = self.rows.pop(face_id, None)
        if row is None:
            return False
        cluster = self.clusters[row]
        self.members[cluster].discard(face_id)
        if not self.members[cluster]:
            del self.members[cluster]
        last = len(self.ids) - 1
        if row != last:
            self.vectors[row] = self.vectors[last]
            self.ids[row], self.clusters[row], self.times[row] = (
                self.ids[last],
                self.clusters[last],
                self.times[last],
            )
            self.rows[self.ids[row]] = row
        self.ids.pop()
        self.clusters.pop()
        self.times.pop()
        return True

    def scores(self, vector: np.ndarray) -> np.ndarray:
        """Cosines of ``vector`` (unit) to every pooled face, in row order."""
        return self.vectors[: len(self.ids)] @ np.asarray(vector, np.float32)

    def assign(self, vector: np.ndarray, threshold: float) -> str | None:
        """The cluster a new face joins under the rule of the module docstring, or None (a new one)."""
        scores = self.scores(vector)
        near = np.flatnonzero(scores >= threshold)
        best, best_score = None, -np.inf
        for cluster in {self.clusters[i] for i in near}:
            rows = np.fromiter((self.rows[f] for f in self.members[cluster]), np.int64)
            linked = link_score(scores[rows])
            if linked >= threshold and linked > best_score:
                best, best_score = cluster, linked
        return best

    def matching(self, vectors: np.ndarray, threshold: float) -> list[str]:
        """Pooled faces whose cosine to any of ``vectors`` ((m, dim), unit) reaches ``threshold``."""
        if not self.ids or len(vectors) == 0:
            return []
        scores = self.vectors[: len(self.ids)] @ np.asarray(vectors, np.float32).T
        return [self.ids[i] for i in np.flatnonzero(scores.max(axis=1) >= threshold)]

    def cluster_sizes(self) -> list[tuple[str, int]]:
        """(cluster id, faces), largest first, then the most recently seen first."""
        latest = {c: max(self.times[self.rows[f]] for f in faces) for c, faces in self.members.items()}
        return sorted(((c, len(f)) for c, f in self.members.items()), key=lambda cs: (-cs[1], -latest[cs[0]]))

    def representatives(self, cluster_id: str, count: int) -> list[str]:
        """The ``count`` faces of a cluster nearest its mean direction (the most typical first)."""
        faces = sorted(self.members.get(cluster_id, ()))
        if not faces:
            return []
        rows = [self.rows[f] for f in faces]
        block = self.vectors[rows]
        centre = block.sum(axis=0)
        order = np.argsort(-(block @ centre), kind="stable")
        return [faces[i] for i in order[:count]]


def link_score(scores: np.ndarray) -> float:
    """The mean of the ``LINK_FACES`` highest cosines (all of them when there are fewer)."""
    k = min(LINK_FACES, len(scores))
    if k == 0:
        return -np.inf
    return float(np.partition(scores, len(scores) - k)[-k:].mean())
