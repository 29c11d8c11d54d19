"""Decide a model's flip fusion by measurement on a labelled photo set that is not LFW.

The papers fuse the embeddings of a face and of its mirror image (``concat``); dlib's own pipeline
uses the face alone (``none``); ``sum`` averages the two. Which helps depends on the network, so it
is measured: every photo of a set of identities (``celeba_faces`` by default, disjoint from LFW's
protocol) goes through the service's path (our MTCNN, the model's template), each fusion is
applied, and every pair of photos is scored; the fusion with the highest true-accept rate at a
false-accept rate of 1e-3 (per person, so people with many photos do not dominate) wins.

    python -m training.flip_fusion --model models/dlib_resnet_v1 --data ../shared/data/celeba_faces \\
        --json docs/results/dlib_flip_fusion.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.calibration import (
    calibrate,
    identity_folds,
    impostor_scores_to_keep,
    score_all_pairs,
)
from training.evaluation.report import write_json

FUSIONS = ("none", "concat", "sum")
DECISION_FAR = "1e-03"


def fuse(original: np.ndarray, mirrored: np.ndarray, fusion: str) -> np.ndarray:
    """L2-normalised fused features, as :class:`models.embedder.Embedder` makes them."""
    if fusion == "none":
        fused = original
    elif fusion == "concat":
        fused = np.concatenate([original, mirrored], axis=1)
    elif fusion == "sum":
        fused = original + mirrored
    else:
        raise ValueError(f"unknown fusion {fusion!r}")
    return fused / np.maximum(np.linalg.norm(fused, axis=1, keepdims=True), 1e-12)


def raw_features(
    model_dir: Path, data: Path, cache: Path, workers: int = 2, progress: bool = True
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Network outputs of every photo's crop and of its mirror, and the photos' identities."""
    from models.align import align_face, get_template
    from models.embedder import Embedder
    from models.image import read_image
    from training.evaluation.cache import detect_landmarks
    from training.evaluation.faces import load_face_set
    from training.evaluation.parallel import ordered_map, progress_bar

    faces = load_face_set(data, data.name, probes=True)
    points, _ = detect_landmarks(faces, cache, workers=workers, progress=progress)
    embedder = Embedder(model_dir, "cpu", batch_size=64)
    template = get_template(embedder.manifest.template)

    def crop(i: int) -> np.ndarray:
        return align_face(read_image(faces.paths[i]), points[i], template)

    originals: list[np.ndarray] = []
    mirrored: list[np.ndarray] = []
    batch: list[np.ndarray] = []

    def flush() -> None:
        if batch:
            crops = np.stack(batch)
            originals.append(embedder.raw(crops))
            mirrored.append(embedder.raw(np.ascontiguousarray(crops[:, :, ::-1])))
            batch.clear()

    stream = ordered_map(crop, range(len(faces)), workers, window=128)
    for item in progress_bar(stream, len(faces), f"embed {data.name}", progress):
        batch.append(item)
        if len(batch) == 64:
            flush()
    flush()
    return np.concatenate(originals), np.concatenate(mirrored), list(faces.identities or [])


def compare_fusions(
    original: np.ndarray,
    mirrored: np.ndarray,
    identities: Sequence[str],
    fars: Sequence[float] = (1e-3, 1e-4),
) -> dict[str, Any]:
    """TAR (all pairs, and per person) at each FAR for each fusion, and the winner."""
    folds = identity_folds(identities)
    n = len(identities)
    keep = impostor_scores_to_keep(fars, n * (n - 1) // 2)
    table = {}
    for fusion in FUSIONS:
        scores = score_all_pairs(
            fuse(original, mirrored, fusion), identities, folds, keep=keep, progress=False
        )
        table[fusion] = calibrate(scores, fars)
    best = max(FUSIONS, key=lambda f: table[f][DECISION_FAR]["tar_per_identity"])
    return {"fusions": table, "chosen": best, "rule": f"highest per-person TAR at FAR {DECISION_FAR}"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model name or folder")
    ap.add_argument(
        "--data", type=Path, required=True, help="folder with one sub-folder of photos per person"
    )
    ap.add_argument("--cache", type=Path, default=None, help="landmark cache (default .cache/megaface)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from models.registry import resolve_model
    from training.evaluation.cache import default_cache_dir

    started = time.perf_counter()
    model_dir = resolve_model(args.model)
    original, mirrored, identities = raw_features(
        model_dir, args.data, args.cache or default_cache_dir(), progress=not args.no_progress
    )
    report = {
        "model": str(model_dir),
        "data": str(args.data),
        "photos": len(identities),
        "people": len(set(identities)),
        **compare_fusions(original, mirrored, identities),
        "seconds": time.perf_counter() - started,
    }
    for fusion, entry in report["fusions"].items():
        cells = [
            f"FAR {label}: TAR {100 * e['tar']:.2f}% (per person {100 * e['tar_per_identity']:.2f}%)"
            for label, e in entry.items()
            if e
        ]
        print(f"{fusion:7} " + "; ".join(cells))
    print(f"chosen: {report['chosen']} ({report['rule']})")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
