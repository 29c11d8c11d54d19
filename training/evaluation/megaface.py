"""MegaFace Challenge 1 identification and verification, on any probe and distractor set.

The protocol of MegaFace Challenge 1 (Kemelmacher-Shlizerman et al., "The MegaFace benchmark",
CVPR 2016; the benchmark of SphereFace thesis §2.3.6 and Tables 2.10, A.2, 5.8-5.10), scored as
its official devkit scores it:

* **Identification.** For every probe identity with ``M`` images and every one of them ``g``: put
  ``g`` into a gallery with ``N`` distractors and search with each of the other ``M - 1`` images
  ``p``. The rank of the search is ``1 + #{distractors d : cos(p, d) > cos(p, g)}`` (a distractor
  that ties the genuine score does not beat it). Rank-1 (and rank-k, the CMC) identification rate
  is the share of all ``(p, g)`` searches with rank <= k, for ``N`` = 10, 100, ..., 1,000,000.
  The distractor sets of the sizes are nested: the first ``N`` of one fixed random order.
* **Verification.** Genuine pairs: every unordered pair of probe images of one identity.
  Impostor pairs: every probe image with every one of the ``N`` distractors. TAR at FAR ``f``:
  the threshold is the ``(k+1)``-th highest impostor score with ``k = floor(f * n_impostor)``
  and a genuine pair is accepted when it scores strictly above it (the rule of
  :func:`training.evaluation.verification.tar_at_far`).
* **Noise lists** (FaceScrub / MegaFace label noise): removed probe images leave the probe set;
  removed distractors stay in the count but can never outscore anything (their scores are
  ``-inf``), as InsightFace's ``remove_noises.py`` does by pushing them far away. With lists, both
  the ``raw`` and the ``cleaned`` numbers are reported.

Faces go through the project's one face path: MTCNN (the face nearest the image centre, the LFW
detect-mode rule with its no-face fallback), the SphereFace 5-point alignment and the model's
flip-fused embedding, L2-normalised (cosine = dot product, no mean subtraction).

The job (:class:`MegaFaceJob`) runs in stages: load the sets and the model, embed the faces
(landmarks and embeddings cached on disk, resumable: :mod:`training.evaluation.cache`), search
the distractors in chunks of bounded memory (:mod:`training.evaluation.megaface_search`), score
(:mod:`training.evaluation.megaface_metrics`) and report (JSON and the plots of
:mod:`training.evaluation.megaface_report`).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.cache import ModelKey, default_cache_dir, detect_landmarks, embed_faces
from training.evaluation.errors import MegaFaceDataError
from training.evaluation.faces import (
    FaceSet,
    cap_per_identity,
    images_under,
    load_face_set,
    read_removal_list,
    removed_mask,
    shard_of,
)
from training.evaluation.megaface_augment import AUGMENTATION_DESCRIPTION, embed_augmented
from training.evaluation.megaface_metrics import summarise
from training.evaluation.megaface_report import write_plots
from training.evaluation.megaface_search import (
    TOP_K,
    VERIFICATION_FARS,
    SearchResult,
    _Stacked,
    distractor_sizes,
    load_feature_file,
    search_distractors,
)
from training.evaluation.report import write_json
from training.evaluation.verification import far_label

#: The local protocol: versioned, so numbers from different versions are never put side by side.
LOCAL_PROTOCOL = "local-v1"
LOCAL_MAX_PER_IDENTITY = 20
LOCAL_PROTOCOL_DESCRIPTION = (
    "probes = the LFW people with 2 or more photos, the first 20 photos of each (file "
    "name order; George_W_Bush alone would otherwise make 58% of the searches); distractors = the "
    "LFW people with exactly one photo plus every photo of ../shared/data/celeba_faces (CelebA "
    "identity numbers are anonymised, so a few CelebA people may also be LFW probe identities); "
    "distractor order: a fixed random permutation (seed 0), sizes nested; every face through "
    "MTCNN (central face) and the SphereFace 112x96 alignment"
)
PROTOCOLS = ("custom", "megaface", "local")
#: What each protocol is (the report's ``protocol_description``).
PROTOCOL_DESCRIPTIONS = {
    "local": LOCAL_PROTOCOL_DESCRIPTION,
    "megaface": "MegaFace Challenge 1 (FaceScrub probes, MegaFace distractors) run by this job",
    "custom": "the MegaFace Challenge 1 rule on the probe and distractor sets named here",
}
#: The rules the numbers follow, as the report states them.
RULES = {
    "identification": "each probe image g in a gallery with N distractors, searched with every other "
    "image of its identity; rank = 1 + distractors scoring strictly higher than g",
    "verification": "genuine = unordered probe pairs of one identity; impostor = probe x "
    "distractor; threshold = (k+1)-th highest impostor score, k = floor(FAR * n_impostor); "
    "accept if score > threshold",
    "sizes": "nested: the first N distractors of one random order (seed)",
    "cleaned": "removed probe images leave the probe set; removed distractors stay counted but score -inf",
}
NO_FACE_POLICY = "MTCNN face nearest the centre; no face: O-Net landmarks in the central box (as LFW detect)"


def local_protocol(data_dir: str | Path) -> tuple[FaceSet, FaceSet]:
    """Probes and distractors of :data:`LOCAL_PROTOCOL` from ``../shared/data`` (see its description)."""
    data_dir = Path(data_dir)
    lfw = data_dir / "lfw" / "images"
    celeba = data_dir / "celeba_faces"
    for folder in (lfw, celeba):
        if not folder.is_dir():
            raise MegaFaceDataError(f"the local protocol needs {folder} (see ../shared/data/README.md)")
    people: dict[str, list[Path]] = {}
    for path in images_under(lfw):
        people.setdefault(path.parent.name, []).append(path)
    probe_paths, single = [], []
    for person in sorted(people):
        photos = people[person]
        if len(photos) >= 2:
            probe_paths.extend(photos[:LOCAL_MAX_PER_IDENTITY])
        else:
            single.extend(photos)
    probes = FaceSet(
        "local-probes",
        probe_paths,
        ["lfw/" + p.relative_to(lfw).as_posix() for p in probe_paths],
        [p.parent.name for p in probe_paths],
    )
    celeba_paths = images_under(celeba)
    distractors = FaceSet(
        "local-distractors",
        single + celeba_paths,
        ["lfw/" + p.relative_to(lfw).as_posix() for p in single]
        + ["celeba_faces/" + p.relative_to(celeba).as_posix() for p in celeba_paths],
    )
    return probes, distractors


# --------------------------------------------------------------------------------------------
# The job, in stages: load -> embed -> search -> score -> report
# --------------------------------------------------------------------------------------------


@dataclass
class _Loaded:
    """What the load stage found: the sets, the noise masks and the model."""

    probes: FaceSet
    distractors: FaceSet
    max_per_identity: int | None
    removed_probes: np.ndarray | None
    removed_distractors: np.ndarray | None
    embedder: Any
    model: ModelKey


@dataclass
class _Embedded:
    """What the embed stage made: probe features and the distractor pool (real, augmented, extra)."""

    probe_features: np.ndarray
    probe_found: np.ndarray
    distractor_found: np.ndarray
    pool: Any
    augmented: int
    extra_files: list[str | Path]
    extra_rows: int


@dataclass
class MegaFaceJob:
    """One run of the protocol: the options, and one method per stage (:meth:`run` drives them).

    ``protocol``: ``local`` (:data:`LOCAL_PROTOCOL` from ``data_dir``), ``megaface`` (FaceScrub
    probes and MegaFace distractors given as ``probes`` / ``distractors``: the papers' numbers are
    comparable) or ``custom`` (any other sets). ``augment_to``: add augmented distractors until
    there are that many; ``extra_features``: more distractors as ``.npy`` features made elsewhere
    (e.g. by :func:`embed_distractor_shard`); ``sizes``: distractor counts (default
    :data:`~training.evaluation.megaface_search.DISTRACTOR_SIZES` up to the set);
    ``remove_probes`` / ``remove_distractors``: noise lists (add the ``cleaned`` variant);
    ``device``: ``cpu`` (numpy) or a torch device for the search; ``chunk_mb``: score-matrix
    memory per search chunk; ``seed``: distractor order and augmentation.
    """

    model_dir: str | Path
    protocol: str = "custom"
    data_dir: str | Path | None = None
    probes: str | Path | None = None
    distractors: str | Path | None = None
    augment_to: int | None = None
    extra_features: str | Path | Sequence[str | Path] | None = None
    sizes: Sequence[int] | None = None
    remove_probes: str | Path | None = None
    remove_distractors: str | Path | None = None
    max_per_identity: int | None = None
    json_out: str | Path | None = None
    plots_dir: str | Path | None = None
    cache_dir: str | Path | None = None
    providers: str | Sequence[str] = "cpu"
    device: str = "cpu"
    chunk_mb: float = 256.0
    workers: int = 2
    batch_size: int = 64
    seed: int = 0
    detector: Any = None
    progress: bool = True
    #: seconds since :meth:`run` started at the end of each stage (``loaded``, ``embedded_real``, ...)
    marks: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()

    def run(self) -> dict[str, Any]:
        """Every stage in order; returns (and writes to ``json_out``, plots to ``plots_dir``) the report."""
        started = time.perf_counter()
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        loaded = self.load()
        self._mark("loaded", started)
        embedded = self.embed(loaded, started)
        result, sizes = self.search(loaded, embedded)
        results = self.score(loaded, embedded, result)
        self._mark("finished", started)
        report = self.report(loaded, embedded, result, sizes, results)
        report["started_at"] = started_at
        report["host"] = {"cpus": os.cpu_count()}
        return self.write(report)

    def _mark(self, stage: str, started: float) -> None:
        self.marks[stage] = time.perf_counter() - started

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> _Loaded:
        """The probe and distractor sets, their noise masks, the embedder and the model's key."""
        from models.embedder import Embedder

        probe_set, distractor_set, max_per_identity = self._face_sets()
        probe_set = cap_per_identity(probe_set, max_per_identity)
        if len(probe_set) == 0:
            raise MegaFaceDataError("no probe identity has two or more images")
        removed_p = (
            removed_mask(probe_set.keys, read_removal_list(self.remove_probes))
            if self.remove_probes
            else None
        )
        removed_d = (
            removed_mask(distractor_set.keys, read_removal_list(self.remove_distractors))
            if self.remove_distractors
            else None
        )
        embedder = Embedder(self.model_dir, self.providers, batch_size=self.batch_size, intra_op_threads=0)
        model = ModelKey.of(self.model_dir)
        return _Loaded(probe_set, distractor_set, max_per_identity, removed_p, removed_d, embedder, model)

    def _face_sets(self) -> tuple[FaceSet, FaceSet, int | None]:
        """Probes, distractors and the cap of images per probe identity the protocol asks for."""
        if self.protocol not in PROTOCOLS:
            raise MegaFaceDataError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.protocol == "local":
            if self.data_dir is None:
                raise MegaFaceDataError("--protocol local needs --data (the ../shared/data folder)")
            if self.probes is not None or self.distractors is not None:
                raise MegaFaceDataError(
                    "--protocol local builds its own probes and distractors; drop --probes/--distractors"
                )
            probe_set, distractor_set = local_protocol(self.data_dir)
            return probe_set, distractor_set, LOCAL_MAX_PER_IDENTITY
        if self.probes is None:
            raise MegaFaceDataError(
                f"--protocol {self.protocol} needs --probes (a folder per identity or a list)"
            )
        probe_set = load_face_set(self.probes, "probes", probes=True)
        distractor_set = (
            load_face_set(self.distractors, "distractors", probes=False)
            if self.distractors is not None
            else FaceSet("distractors", [], [])
        )
        return probe_set, distractor_set, self.max_per_identity

    # -- embed --------------------------------------------------------------------------------

    def embed(self, loaded: _Loaded, started: float) -> _Embedded:
        """Landmarks and embeddings of the probes and real distractors (cached), then the
        augmented distractors and the extra feature files: the pool the search streams."""
        probe_features, probe_found, _ = self._landmarks_and_embeddings(loaded, loaded.probes)
        probe_features = np.asarray(probe_features)
        parts: list[np.ndarray] = []
        marks = np.zeros((0, 5, 2), np.float32)
        distractor_found = np.zeros(0, dtype=bool)
        if len(loaded.distractors):
            features, distractor_found, marks = self._landmarks_and_embeddings(loaded, loaded.distractors)
            parts.append(features)
        self._mark("embedded_real", started)
        augmented = self._augmented(loaded, marks, parts)
        self._mark("embedded", started)
        extra_files, extra_rows = self._extra(loaded, parts)
        size = loaded.embedder.output_size
        pool = _Stacked(parts) if parts else np.zeros((0, size), np.float32)
        return _Embedded(
            probe_features, probe_found, distractor_found, pool, augmented, extra_files, extra_rows
        )

    def _landmarks_and_embeddings(
        self, loaded: _Loaded, faces: FaceSet
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(features, found, landmarks)`` of a set, from the cache or made and cached."""
        marks, found = detect_landmarks(
            faces, self.cache, detector=self.detector, providers=self.providers, workers=self.workers,
            progress=self.progress,
        )  # fmt: skip
        features = embed_faces(
            faces, marks, loaded.model, loaded.embedder, self.cache,
            batch_size=self.batch_size, workers=self.workers, progress=self.progress,
        )  # fmt: skip
        return features, found, marks

    def _augmented(self, loaded: _Loaded, marks: np.ndarray, parts: list[np.ndarray]) -> int:
        """Append the augmented distractors ``augment_to`` asks for to ``parts``; returns their count."""
        if self.augment_to is None or self.augment_to <= len(loaded.distractors):
            return 0
        count = self.augment_to - len(loaded.distractors)
        augmented, _ = embed_augmented(
            loaded.distractors, marks, count, loaded.model, loaded.embedder, self.cache, seed=self.seed,
            batch_size=self.batch_size, workers=self.workers, progress=self.progress,
        )  # fmt: skip
        parts.append(augmented)
        return count

    def _extra(self, loaded: _Loaded, parts: list[np.ndarray]) -> tuple[list[str | Path], int]:
        """Append the extra feature files (e.g. the shards of :func:`embed_distractor_shard`, in
        their order) to ``parts``; returns the files and their rows."""
        extra = self.extra_features
        files = [extra] if isinstance(extra, str | Path) else list(extra or [])
        rows = 0
        for file in files:
            features = load_feature_file(file, loaded.embedder.output_size)
            parts.append(features)
            rows += len(features)
        return files, rows

    # -- search and score ---------------------------------------------------------------------

    def search(self, loaded: _Loaded, embedded: _Embedded) -> tuple[SearchResult, list[int]]:
        """Every probe against the distractor pool at each size, in one random order (``seed``)."""
        total = len(embedded.pool)
        removed_d = loaded.removed_distractors
        if removed_d is not None:  # the augmented and extra distractors are never removed
            removed_d = np.concatenate([removed_d, np.zeros(total - len(removed_d), dtype=bool)])
        sizes = distractor_sizes(total, self.sizes)
        order = np.random.default_rng(self.seed).permutation(total)
        result = search_distractors(
            embedded.probe_features, embedded.pool, order, sizes, removed_probes=loaded.removed_probes,
            removed_distractors=removed_d, chunk_mb=self.chunk_mb, device=self.device, progress=self.progress,
        )  # fmt: skip
        return result, sizes

    def score(self, loaded: _Loaded, embedded: _Embedded, result: SearchResult) -> dict[str, Any]:
        """Identification and verification per size and variant (``raw``, ``cleaned``)."""
        return summarise(embedded.probe_features, loaded.probes.identities or [], result)

    # -- report -------------------------------------------------------------------------------

    def report(
        self,
        loaded: _Loaded,
        embedded: _Embedded,
        result: SearchResult,
        sizes: list[int],
        results: dict[str, Any],
    ) -> dict[str, Any]:
        """The report's numbers and what they were measured on (``started_at`` and ``host`` are
        added by :meth:`run`)."""
        return {
            "benchmark": "MegaFace Challenge 1 protocol (identification and verification)",
            "protocol": LOCAL_PROTOCOL if self.protocol == "local" else self.protocol,
            "protocol_description": PROTOCOL_DESCRIPTIONS[self.protocol],
            "rules": dict(RULES),
            "model_id": loaded.model.model_id,
            "model_dir": str(self.model_dir),
            "model_digest": loaded.model.digest,
            "embedding_size": loaded.embedder.output_size,
            "provider": loaded.embedder.provider,
            "search_device": self.device,
            "probes": self._probes_section(loaded, embedded),
            "distractors": self._distractors_section(loaded, embedded),
            "sizes": sizes,
            "fars": [far_label(f) for f in VERIFICATION_FARS],
            "top_k": TOP_K,
            "results": results,
            "no_face_policy": NO_FACE_POLICY,
            "timing_s": self._timing(result),
            "peak_rss_gib": _peak_rss_gib(),
            "chunk_mb": self.chunk_mb,
            "cache_dir": str(self.cache),
        }

    def _probes_section(self, loaded: _Loaded, embedded: _Embedded) -> dict[str, Any]:
        probes, removed = loaded.probes, loaded.removed_probes
        return {
            "source": str(self.data_dir if self.protocol == "local" else self.probes),
            "images": len(probes),
            "identities": len(set(probes.identities or [])),
            "max_per_identity": loaded.max_per_identity,
            "no_face_images": int((~embedded.probe_found).sum()),
            "removed": None if removed is None else int(removed.sum()),
        }

    def _distractors_section(self, loaded: _Loaded, embedded: _Embedded) -> dict[str, Any]:
        removed, files = loaded.removed_distractors, embedded.extra_files
        return {
            "source": str(self.data_dir if self.protocol == "local" else self.distractors),
            "images": len(loaded.distractors),
            "no_face_images": int((~embedded.distractor_found).sum()),
            "augmented": embedded.augmented,
            "augmentation": AUGMENTATION_DESCRIPTION if embedded.augmented else None,
            "extra_features": None
            if not files
            else {"file": ", ".join(str(f) for f in files), "rows": embedded.extra_rows},
            "total": len(embedded.pool),
            "removed": None if removed is None else int(removed.sum()),
            "order_seed": self.seed,
        }

    def _timing(self, result: SearchResult) -> dict[str, float]:
        m = self.marks
        return {
            "total": m["finished"],
            "load": m["loaded"],
            "faces_real": m["embedded_real"] - m["loaded"],
            "faces_augmented": m["embedded"] - m["embedded_real"],
            "search": result.seconds,
            "metrics": m["finished"] - m["loaded"] - (m["embedded"] - m["loaded"]) - result.seconds,
        }

    def write(self, report: dict[str, Any]) -> dict[str, Any]:
        """The report to ``json_out`` and its plots to ``plots_dir`` (each when set); the plots'
        paths are added to the returned report, not to the file."""
        if self.json_out is not None:
            write_json(self.json_out, report, indent=1)
        if self.plots_dir is not None:
            report["plots"] = [str(p) for p in write_plots(report, self.plots_dir)]
        return report


def run_megaface(model_dir: str | Path, **options: Any) -> dict[str, Any]:
    """Run the protocol end to end (:class:`MegaFaceJob` with these options); returns (and writes
    to ``json_out``) every number."""
    return MegaFaceJob(model_dir, **options).run()


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# --------------------------------------------------------------------------------------------
# One pod's share of a large distractor set
# --------------------------------------------------------------------------------------------


def embed_distractor_shard(
    model_dir: str | Path,
    distractors: str | Path,
    shard: int,
    shards: int,
    out: str | Path,
    *,
    cache_dir: str | Path | None = None,
    providers: str | Sequence[str] = "cpu",
    workers: int = 2,
    batch_size: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """One pod's share of a large distractor set: detect, align and embed every ``shards``-th
    image and write the L2-normalised features to ``out`` (``.npy``, float32) with a ``.json``
    beside it. The shards' files together are the whole set for ``--extra-features``."""
    from models.embedder import Embedder

    faces = shard_of(load_face_set(distractors, "distractors", probes=False), shard, shards)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    embedder = Embedder(model_dir, providers, batch_size=batch_size, intra_op_threads=0)
    marks, found = detect_landmarks(faces, cache, providers=providers, workers=workers, progress=progress)
    features = np.ascontiguousarray(
        embed_faces(
            faces, marks, ModelKey.of(model_dir), embedder, cache,
            batch_size=batch_size, workers=workers, progress=progress,
        ),
        dtype=np.float32,
    )  # fmt: skip
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial.npy")
    np.save(partial, features)
    partial.replace(out)  # a finished shard's file appears whole or not at all
    summary = {
        "model_id": embedder.manifest.model_id,
        "shard": shard,
        "shards": shards,
        "images": len(faces),
        "faces_found": int(found.sum()),
        "features": str(out),
    }
    write_json(out.with_suffix(".json"), summary, indent=2)
    return summary


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A short human summary of :func:`run_megaface`'s report."""
    d = report["distractors"]
    lines = [
        f"MegaFace protocol {report['protocol']}: model {report['model_id']}; "
        f"{report['probes']['images']} probe images of {report['probes']['identities']} identities; "
        f"{d['total']} distractors "
        f"({d['images']} images, {d['augmented']} augmented)",
    ]
    for variant, res in report["results"].items():
        for size in report["sizes"]:
            ident = res["identification"][str(size)]
            tar = res["verification"][str(size)]["tar_at_far"]
            tars = ", ".join(f"{100 * v:.2f}% @ {k}" for k, v in tar.items() if v is not None) or "-"
            lines.append(
                f"  {variant:7s} N={size:>9,}  rank-1 {100 * ident['rank1']:6.2f}%  rank-10 "
                f"{100 * ident['rank10']:6.2f}%  TAR {tars}"
            )
    t = report["timing_s"]
    lines.append(
        f"took {t['total']:.1f} s (faces {t['faces_real'] + t['faces_augmented']:.1f} s, "
        f"search {t['search']:.1f} s); "
        f"peak RSS {report['peak_rss_gib']:.2f} GiB"
    )
    return lines
