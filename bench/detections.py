"""Detections of the two MTCNNs in one format, matched by box IoU and compared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.face_path_settings import MATCH_IOU
from models.tracking import box_iou


@dataclass
class Found:
    """Detections of one image: boxes ``(n, 4)``, scores ``(n,)``, landmarks ``(n, 5, 2)``."""

    boxes: np.ndarray
    scores: np.ndarray
    points: np.ndarray

    def __len__(self) -> int:
        return len(self.boxes)


def found_from_ours(faces) -> Found:
    if not faces:
        return Found(np.zeros((0, 4)), np.zeros(0), np.zeros((0, 5, 2)))
    return Found(
        np.stack([f.box for f in faces]).astype(np.float64),
        np.array([f.score for f in faces], dtype=np.float64),
        np.stack([f.landmarks for f in faces]).astype(np.float64),
    )


def found_from_facenet(result) -> Found:
    boxes, probs, points = result
    if boxes is None or len(boxes) == 0:
        return Found(np.zeros((0, 4)), np.zeros(0), np.zeros((0, 5, 2)))
    return Found(
        np.asarray(boxes, dtype=np.float64).reshape(-1, 4),
        np.asarray(probs, dtype=np.float64).reshape(-1),
        np.asarray(points, dtype=np.float64).reshape(-1, 5, 2),
    )


def match_boxes(a: np.ndarray, b: np.ndarray, threshold: float = MATCH_IOU) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching by decreasing IoU; pairs ``(i, j, iou)`` with IoU > threshold."""
    iou = box_iou(a, b)
    pairs = []
    used_a, used_b = set(), set()
    for flat in np.argsort(-iou, axis=None, kind="stable"):
        i, j = np.unravel_index(flat, iou.shape)
        if iou[i, j] <= threshold:
            break
        if i in used_a or j in used_b:
            continue
        used_a.add(i)
        used_b.add(j)
        pairs.append((int(i), int(j), float(iou[i, j])))
    return pairs


def compare_detections(
    ours: list[Found], theirs: list[Found], names: list[str], reference: list[np.ndarray] | None
) -> dict[str, Any]:
    """Faces found by each, matching by IoU, and landmark distances of matched faces."""
    dists, offsets, corner, ious, score_diff, widths = [], [], [], [], [], []
    per_image = []
    only_ours = only_theirs = 0
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        pairs = match_boxes(a.boxes, b.boxes)
        only_ours += len(a) - len(pairs)
        only_theirs += len(b) - len(pairs)
        image_d = []
        for i, j, iou in pairs:
            delta = b.points[j] - a.points[i]  # (5, 2) facenet - ours
            d = np.linalg.norm(delta, axis=1)
            dists.append(d)
            offsets.append(delta)
            corner.append(b.boxes[j] - a.boxes[i])
            ious.append(iou)
            score_diff.append(b.scores[j] - a.scores[i])
            widths.append(a.boxes[i, 2] - a.boxes[i, 0])
            image_d.append(float(d.mean()))
        per_image.append(
            {
                "image": names[k],
                "faces_ours": len(a),
                "faces_facenet": len(b),
                "matched": len(pairs),
                "landmark_px_mean_per_match": image_d,
            }
        )
    out: dict[str, Any] = {
        "faces_ours": int(sum(len(f) for f in ours)),
        "faces_facenet": int(sum(len(f) for f in theirs)),
        "matched": len(dists),
        "only_ours": only_ours,
        "only_facenet": only_theirs,
        "images_with_count_difference": int(sum(len(a) != len(b) for a, b in zip(ours, theirs, strict=True))),
    }
    if dists:
        d = np.stack(dists)  # (m, 5)
        face_mean = d.mean(axis=1)
        off = np.stack(offsets)  # (m, 5, 2)
        out["landmarks"] = {
            "mean_px": float(face_mean.mean()),
            "median_px": float(np.median(face_mean)),
            "p90_px": float(np.percentile(face_mean, 90)),
            "max_px": float(face_mean.max()),
            "share_faces_within_1px": float(np.mean(face_mean <= 1.0)),
            "per_point_mean_px": [float(x) for x in d.mean(axis=0)],
            "mean_offset_facenet_minus_ours_xy": [float(x) for x in off.reshape(-1, 2).mean(axis=0)],
            "mean_px_per_100px_box_width": float(np.mean(100 * face_mean / np.maximum(widths, 1.0))),
        }
        out["boxes"] = {
            "mean_iou": float(np.mean(ious)),
            "mean_corner_offset_facenet_minus_ours": [float(x) for x in np.stack(corner).mean(axis=0)],
            "mean_abs_score_diff": float(np.mean(np.abs(score_diff))),
        }
    if reference is not None:
        out["vs_reference_landmarks"] = {
            "ours": _vs_reference(ours, reference),
            "facenet": _vs_reference(theirs, reference),
        }
    out["per_image"] = per_image
    return out


def _vs_reference(found: list[Found], reference: list[np.ndarray], limit_px: float = 10.0) -> dict[str, Any]:
    """Landmark distance to LFW's landmarks.txt for the detection nearest to it, per image."""
    best = []
    missed = 0
    for f, ref in zip(found, reference, strict=True):
        if len(f) == 0:
            missed += 1
            continue
        d = np.linalg.norm(f.points - ref[None], axis=2).mean(axis=1).min()
        if d > limit_px:
            missed += 1
        else:
            best.append(d)
    return {
        "mean_px": float(np.mean(best)) if best else None,
        "median_px": float(np.median(best)) if best else None,
        "images": len(best),
        "no_face_within_10px": missed,
    }
