"""Pure-torch stand-in for the two torchvision functions facenet-pytorch's MTCNN code imports.

facenet_pytorch/models/utils/detect_face.py does ``from torchvision.ops.boxes import batched_nms``
and ``from torchvision.transforms import functional as F`` (``F.to_tensor``). torchvision does not
work on these machines, so ``bench/facenet_env.py`` copies this file into the throwaway folder it
builds for facenet-pytorch (``.cache/bench/...``) as ``torchvision/_standin.py`` and adds tiny
``torchvision.ops.boxes`` / ``torchvision.transforms.functional`` modules that re-export it. It is
never importable as ``torchvision`` from the project itself.

The semantics follow torchvision's documented behaviour: boxes are ``(x1, y1, x2, y2)`` with areas
``(x2 - x1) * (y2 - y1)`` (no +1), a box is suppressed when its IoU with a kept, higher-scoring box
is strictly greater than the threshold, and kept indices come back by decreasing score. The NMS is
a greedy loop over kept boxes, each step vectorised over the remaining ones (the same algorithm as
the project's numpy NMS); time spent in it is counted in :data:`TIMING` so the benchmark can show
how much of facenet-pytorch's time it accounts for (the real torchvision runs it in C++), and its
inputs can be recorded (:data:`RECORD`) so that the benchmark times the same calls in the real
torchvision, in a separate environment (``bench/torchvision_nms.py``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

#: Cumulative calls and seconds spent in :func:`batched_nms` (read and reset by the benchmark).
TIMING = {"batched_nms_calls": 0, "batched_nms_seconds": 0.0}
#: When the benchmark sets a list here, every :func:`batched_nms` call appends its inputs and the
#: indices it kept (numpy arrays), to be timed again in the real torchvision
#: (``bench/torchvision_nms.py``).
RECORD: list[dict] | None = None


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression; int64 indices of the kept boxes, best score first."""
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    x1, y1, x2, y2 = boxes.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = torch.argsort(scores, descending=True, stable=True)
    keep = []
    while order.numel() > 0:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        w = (torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest])).clamp(min=0)
        h = (torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest])).clamp(min=0)
        inter = w * h
        iou = inter / (areas[i] + areas[rest] - inter)
        order = rest[iou <= iou_threshold]
    return torch.stack(keep).to(torch.int64)


def batched_nms(
    boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float
) -> torch.Tensor:
    """NMS within each category ``idxs``: boxes of different categories never suppress each other.

    Uses torchvision's "coordinate trick": every category is shifted by ``idx * (max + 1)`` so a
    single NMS pass keeps them apart.
    """
    start = time.perf_counter()
    kept = None
    try:
        if boxes.numel() == 0:
            kept = torch.empty((0,), dtype=torch.int64, device=boxes.device)
        else:
            offsets = idxs.to(boxes) * (boxes.max() + 1)
            kept = nms(boxes + offsets[:, None], scores, iou_threshold)
        return kept
    finally:
        TIMING["batched_nms_calls"] += 1
        TIMING["batched_nms_seconds"] += time.perf_counter() - start
        if RECORD is not None and kept is not None:
            RECORD.append(
                {
                    "boxes": boxes.detach().cpu().numpy().copy(),
                    "scores": scores.detach().cpu().numpy().copy(),
                    "idxs": idxs.detach().cpu().numpy().copy(),
                    "iou_threshold": float(iou_threshold),
                    "kept": kept.cpu().numpy().copy(),
                }
            )


def to_tensor(pic) -> torch.Tensor:
    """PIL image or ``(H, W[, C])`` ndarray -> ``(C, H, W)`` tensor; uint8 is scaled to [0, 1]."""
    arr = np.asarray(pic)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    tensor = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
    if tensor.dtype == torch.uint8:
        return tensor.to(torch.get_default_dtype()).div(255)
    return tensor
