"""The face trainer's LFW check: the network being trained, scored on LFW's 10-fold protocol
(thesis §2.3.6 "Testing") on crops aligned once."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.callbacks import Callback, Interval

log = logging.getLogger(__name__)


@torch.no_grad()
def embed_crops(
    net: nn.Module, crops: np.ndarray, device: torch.device, batch_size: int = 256, bf16: bool = False
) -> np.ndarray:
    """Fused features of aligned crops with a PyTorch network: ``[f(x); f(flip(x))]`` (thesis
    §2.3.6 "Testing").

    Args:
        crops: ``(N, 112, 96, 3)`` uint8 RGB.

    Returns:
        ``(N, 2D)`` float32, not normalised (the LFW protocol normalises after mean subtraction).
    """
    from training.data import to_network_input

    was_training = net.training
    net.eval()
    out = []
    try:
        for start in range(0, len(crops), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(crops[start : start + batch_size])).to(device)
            x = to_network_input(batch)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                both = net(torch.cat([x, x.flip(3)]))
            both = both.float()
            n = len(x)
            out.append(torch.cat([both[:n], both[n:]], dim=1).cpu().numpy())
    finally:
        net.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


class LFWCheck:
    """LFW accuracy of the network being trained, on crops aligned once.

    ``landmarks="detect"`` (the default of the trainer) aligns LFW with our MTCNN's landmarks, as
    the training data and the service are; ``"file"`` uses ``landmarks.txt``.
    """

    def __init__(
        self,
        lfw_dir: str | Path,
        pairs_per_fold: int | None,
        device: torch.device,
        bf16: bool,
        landmarks: str = "detect",
    ) -> None:
        from training.evaluation.lfw import aligned_lfw_crops

        started = time.perf_counter()
        self.crops, self.names, self.pairs = aligned_lfw_crops(lfw_dir, workers=2, landmarks=landmarks)
        self.quick_pairs = self.pairs.subset(pairs_per_fold) if pairs_per_fold else self.pairs
        quick_names = set(self.quick_pairs.images())
        self.quick_rows = np.array([i for i, n in enumerate(self.names) if n in quick_names])
        self.device = device
        self.bf16 = bf16
        log.info("LFW check: %d crops aligned in %.1f s", len(self.crops), time.perf_counter() - started)

    def __call__(self, net: nn.Module, full: bool) -> dict[str, Any]:
        from training.evaluation.lfw_files import pair_features
        from training.evaluation.verification import lfw_10fold_accuracy

        started = time.perf_counter()
        pairs = self.pairs if full else self.quick_pairs
        rows = np.arange(len(self.names)) if full else self.quick_rows
        names = [self.names[i] for i in rows]
        features = embed_crops(net, self.crops[rows], self.device, bf16=self.bf16)
        left, right = pair_features(features, names, pairs)
        result = lfw_10fold_accuracy(left, right, pairs.is_same, pairs.fold)
        out: dict[str, Any] = {
            "accuracy": result.accuracy,
            "std": result.std,
            "pairs": len(pairs),
            "seconds": time.perf_counter() - started,
        }
        if full:
            out["angular_fisher_score"] = _lfw_afs(features, names)
        return out


def _lfw_afs(features: np.ndarray, names: list[str]) -> float | None:
    """Angular Fisher score (Eq. A.1) of LFW features over the people with 2+ images."""
    from training.evaluation.lfw_files import identity_of
    from training.metrics import angular_fisher_score

    people = np.array([identity_of(n) for n in names])
    unique, counts = np.unique(people, return_counts=True)
    keep = np.isin(people, unique[counts >= 2])
    if keep.sum() < 4:
        return None
    _, labels = np.unique(people[keep], return_inverse=True)
    return float(angular_fisher_score(features[keep], labels))


class LFWEvaluation(Callback):
    """The LFW check at the end of every ``every`` steps' log interval (0: none) and at the run's
    last step, which scores all pairs; ``last`` is the latest result."""

    def __init__(self, check: LFWCheck, net: nn.Module, every: int) -> None:
        self.check, self.net, self.every = check, net, every
        self.last: dict[str, Any] | None = None

    def on_interval(self, interval: Interval) -> None:
        if not (interval.is_last or (self.every > 0 and interval.done % self.every == 0)):
            return
        lfw = self.check(self.net, full=interval.is_last)
        interval.row["lfw_accuracy"], interval.row["lfw_std"] = lfw["accuracy"], lfw["std"]
        self.last = lfw
