"""Random unit vectors and embedding faces shared by the gallery tests."""

from __future__ import annotations

import numpy as np

from service.gallery.store import NewFace, embedding_sha256


def random_unit(rng: np.random.Generator, dim: int, n: int | None = None) -> np.ndarray:
    """Random unit float32 vector(s): one (dim,) vector, or (n, dim) when ``n`` is given."""
    v = rng.standard_normal((n or 1, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v if n is not None else v[0]


def near(rng: np.random.Generator, vector: np.ndarray, noise: float) -> np.ndarray:
    v = (vector + noise * rng.standard_normal(vector.shape)).astype(np.float32)
    return v / np.linalg.norm(v)


def emb_face(vector: np.ndarray) -> NewFace:
    """A face enrolled as an embedding (its duplicate key is the hash of its bytes)."""
    return NewFace(embedding=vector, photo_sha256=embedding_sha256(vector), source="embedding")
