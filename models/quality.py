"""Face quality: how likely a face is to be recognised, from what the face path already has.

One pure function of one face, numpy only (no torch, no ONNX Runtime), for every caller (the
service, the evaluation jobs, a video tracker)::

    face_quality(detection_score, box, landmarks, crop, raw_embedding=None, model=None) -> FaceQuality

It reads five ingredients:

* ``detection``: MTCNN O-Net's face probability, as a log-odds (clipped);
* ``size``: the face box's side in pixels of the photo (the square root of its area), log2;
* ``sharpness``: the variance of the Laplacian of the aligned crop in grey over its central
  part, log (a blurred or upscaled small face has little of it);
* ``yaw``, ``pitch``, ``roll``: the head's pose from the 5 landmarks (the nose off the line
  between the eyes' and the mouth's midpoints, the nose's height between eyes and mouth, the
  slant of the eye line);
* ``norm``: the log of the norm of the model's fused output before L2 normalisation, for the
  model the weights were fitted on (other models: left out).

and combines them by a logistic model fitted on LFW's genuine pairs (with degraded copies), so
the score is the estimated probability that the face matches a typical LFW photo of the same
person at the model's threshold for a false match rate of 1e-3: 0 = will not be recognised,
1 = will. The fit (``python -m training.evaluation.quality_fit``) writes the weights below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

#: The ingredients, in the order of the fitted weights.
FEATURES = ("detection", "size", "sharpness", "yaw", "pitch", "roll", "norm")
#: Where each ingredient is clipped before it is weighted (outside, the fit has no faces to say).
FEATURE_RANGES: dict[str, tuple[float, float]] = {
    "detection": (-4.0, 12.0),
    "size": (3.0, 8.0),
    "sharpness": (0.0, 9.0),
    "yaw": (0.0, 1.0),
    "pitch": (0.0, 1.0),
    "roll": (0.0, 90.0),
    "norm": (-1.5, 1.5),
}
#: Which ingredient each refusal reason names (``low_quality`` answers carry the worst one).
REASONS = {
    "size": "too_small",
    "sharpness": "blurred",
    "yaw": "turned_away",
    "pitch": "turned_away",
    "roll": "turned_away",
    "detection": "unclear_face",
    "norm": "unclear_face",
}
#: The nose's height between the eyes (0) and the mouth (1) of a frontal face (LFW's median).
FRONTAL_PITCH = 0.5
#: A face this many octaves under the reference size is enlarged to fill the crop, which blurs it:
#: its lost sharpness is blamed on its size (the reason is ``too_small``, not ``blurred``).
UPSCALED_OCTAVES = 1.0


@dataclass(frozen=True)
class QualityModel:
    """Fitted weights: ``score = sigmoid(intercept + sum(weights[k] * clip(features[k])))``.

    ``reference`` holds the ingredients of a typical face of the fit (its medians): a refusal
    names the ingredient that falls furthest below its reference, weighted. ``norm_model`` is
    the model id whose raw output norm ``norm_scale`` centres; for another model the norm is
    taken as the reference (it says nothing)."""

    intercept: float
    weights: Mapping[str, float]
    reference: Mapping[str, float]
    norm_model: str | None = None
    norm_scale: float = 1.0
    fitted_on: str = ""


@dataclass(frozen=True)
class FaceQuality:
    """A face's quality ``score`` in [0, 1], its ``features`` (ingredients, before clipping) and
    ``reason``: the ingredient that lowers the score most, as a refusal reason (``too_small``,
    ``blurred``, ``turned_away``, ``unclear_face``), or None when none is below its reference."""

    score: float
    features: dict[str, float] = field(default_factory=dict)
    reason: str | None = None


def face_size_px(box) -> float:
    """The side of a face box ``(x1, y1, x2, y2)`` in pixels: the square root of its area."""
    x1, y1, x2, y2 = (float(v) for v in np.asarray(box, dtype=np.float64).reshape(4))
    return math.sqrt(max(x2 - x1 + 1.0, 0.0) * max(y2 - y1 + 1.0, 0.0))


def sharpness(crop: np.ndarray) -> float:
    """log(1 + variance of the 4-neighbour Laplacian) of an aligned crop's central part in grey
    (0-255 scale): the middle 70% across, from 15% to 85% down (eyes, nose, mouth).

    ``crop``: ``(H, W, 3)`` RGB or ``(H, W)`` grey, uint8 or float."""
    grey = np.asarray(crop, dtype=np.float64)
    if grey.ndim == 3:
        grey = grey @ np.array([0.299, 0.587, 0.114])
    h, w = grey.shape
    part = grey[int(0.15 * h) : int(0.85 * h), int(0.15 * w) : int(0.85 * w)]
    lap = 4 * part[1:-1, 1:-1] - part[:-2, 1:-1] - part[2:, 1:-1] - part[1:-1, :-2] - part[1:-1, 2:]
    return float(np.log1p(lap.var())) if lap.size else 0.0


def head_pose(landmarks) -> dict[str, float]:
    """Pose cues from 5 landmarks (left eye, right eye, nose, left and right mouth corners).

    ``roll``: degrees of the eye line from level (absolute). After undoing the roll, ``yaw``: the
    nose's sideways offset from the line through the eyes' and the mouth's midpoints, in units of
    the eye distance (absolute; about 0 frontal, 0.3 or more for a face turned well away);
    ``pitch``: how far the nose's height between eyes (0) and mouth (1) is from
    :data:`FRONTAL_PITCH` (absolute)."""
    p = np.asarray(landmarks, dtype=np.float64).reshape(5, 2)
    eyes = p[1] - p[0]
    angle = math.atan2(eyes[1], eyes[0])
    c, s = math.cos(-angle), math.sin(-angle)
    q = (p - p[:2].mean(axis=0)) @ np.array([[c, s], [-s, c]])
    eye_distance = max(float(np.hypot(*eyes)), 1e-6)
    mouth = q[3:].mean(axis=0)  # the eyes' midpoint is the origin
    height = float(mouth[1])
    if abs(height) < 1e-6:
        return {"yaw": 1.0, "pitch": 1.0, "roll": abs(math.degrees(angle))}
    midline_x = mouth[0] * q[2, 1] / height
    return {
        "yaw": abs(float(q[2, 0]) - float(midline_x)) / eye_distance,
        "pitch": abs(float(q[2, 1]) / height - FRONTAL_PITCH),
        "roll": abs(math.degrees(angle)),
    }


def quality_features(
    detection_score: float, box, landmarks, crop: np.ndarray, raw_norm: float | None = None
) -> dict[str, float]:
    """The ingredients of one face (see the module docstring), before clipping; ``norm`` is the
    log of ``raw_norm`` (omitted when None)."""
    p = min(max(float(detection_score), 1e-7), 1 - 1e-7)
    features = {
        "detection": math.log(p / (1 - p)),
        "size": math.log2(max(face_size_px(box), 1.0)),
        "sharpness": sharpness(crop),
        **head_pose(landmarks),
    }
    if raw_norm is not None:
        features["norm"] = math.log(max(float(raw_norm), 1e-12))
    return features


def _terms(features: Mapping[str, float], model: QualityModel, model_id: str | None) -> dict[str, float]:
    """Each ingredient's weighted, clipped value; a missing one (or the norm of another model)
    counts as the reference."""
    terms = {}
    for name in FEATURES:
        value = features.get(name)
        if name == "norm":
            usable = value is not None and model.norm_model is not None and model_id == model.norm_model
            value = value - math.log(model.norm_scale) if usable else None
        if value is None:
            value = model.reference[name]
        low, high = FEATURE_RANGES[name]
        terms[name] = model.weights[name] * min(max(value, low), high)
    return terms


def score_features(
    features: Mapping[str, float], model: QualityModel | None = None, model_id: str | None = None
) -> FaceQuality:
    """:class:`FaceQuality` of ingredients (:func:`quality_features`) under ``model`` (default
    :data:`DEFAULT_QUALITY_MODEL`); ``model_id``: the embedding model's, for the norm."""
    model = model or DEFAULT_QUALITY_MODEL
    terms = _terms(features, model, model_id)
    z = model.intercept + sum(terms.values())
    score = 1.0 / (1.0 + math.exp(-min(max(z, -60.0), 60.0)))
    reason = _reason(features, terms, model)
    return FaceQuality(score=score, features=dict(features), reason=reason)


def _reason(features: Mapping[str, float], terms: Mapping[str, float], model: QualityModel) -> str | None:
    """The reason named by the ingredient whose weighted term falls furthest below the
    reference's; a face enlarged to fill the crop (:data:`UPSCALED_OCTAVES`) blames its size."""
    losses = {
        name: terms[name] - model.weights[name] * min(max(model.reference[name], r[0]), r[1])
        for name, r in FEATURE_RANGES.items()
    }
    size = features.get("size")
    if size is not None and size < model.reference["size"] - UPSCALED_OCTAVES:
        losses["size"] += min(losses["sharpness"], 0.0)
        losses["sharpness"] = 0.0
    worst = min(losses, key=losses.get)
    return REASONS[worst] if losses[worst] < 0 else None


def face_quality(
    detection_score: float,
    box,
    landmarks,
    crop: np.ndarray,
    raw_embedding: np.ndarray | None = None,
    *,
    model: QualityModel | None = None,
    model_id: str | None = None,
) -> FaceQuality:
    """The quality of one face, from what the face path has.

    Args:
        detection_score: MTCNN O-Net face probability in [0, 1].
        box: ``(4,)`` ``x1, y1, x2, y2`` in pixels of the photo as decoded at full size.
        landmarks: ``(5, 2)`` (x, y) pixels: left eye, right eye, nose, left and right mouth corners.
        crop: the aligned crop ``(H, W, 3)`` RGB uint8 (``(H, W)`` grey works too).
        raw_embedding: the model's fused output before L2 normalisation (``Embedder.embed(...,
            normalize=False)``), or None; used only when ``model_id`` is the fitted model's.
        model: the weights (default :data:`DEFAULT_QUALITY_MODEL`).
        model_id: the embedding model's id (``manifest.model_id``).

    Returns:
        :class:`FaceQuality`: ``score`` in [0, 1] (the estimated probability that the face is
        recognised at a false match rate of 1e-3), the ingredients and the worst one's reason.
    """
    norm = None if raw_embedding is None else float(np.linalg.norm(np.asarray(raw_embedding, np.float64)))
    return score_features(quality_features(detection_score, box, landmarks, crop, norm), model, model_id)


def reason_text(quality: FaceQuality) -> str:
    """A sentence for people saying what lowers ``quality`` most (its ``reason``)."""
    size = quality.features.get("size")
    texts = {
        "too_small": "the face is too small"
        + (f" ({2**size:.0f} pixels across)" if size is not None else "")
        + ": send a photo where it is larger or sharper",
        "blurred": "the face is blurred: send a sharper photo",
        "turned_away": "the face is turned away from the camera: send a photo of it from the front",
        "unclear_face": "the face is unclear (covered, badly lit or hardly a face): send a clearer photo",
    }
    return texts.get(quality.reason or "", "the face is of low quality")


#: Fitted on LFW with the default model; written by ``python -m training.evaluation.quality_results``
#: (docs/results/quality.json, which tests/test_quality.py checks this against).
DEFAULT_QUALITY_MODEL = QualityModel(
    intercept=-1.7074,
    weights={
        "detection": 0.12227,
        "size": 0.19892,
        "sharpness": 0.58248,
        "yaw": -0.48783,
        "pitch": -1.54336,
        "roll": -0.00918,
        "norm": 2.43185,
    },
    reference={
        "detection": 9.9213,
        "size": 6.7489,
        "sharpness": 4.062,
        "yaw": 0.0932,
        "pitch": 0.0685,
        "roll": 4.4892,
        "norm": 0.0,
    },
    norm_model="dlib_resnet_v1@1",
    norm_scale=2.83625,
    fitted_on="LFW (13,233 photos and 4,594 degraded copies), genuine pairs at FMR 1e-3",
)
