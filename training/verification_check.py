"""The face trainer's check of the verification sets a config names (``verification_sets``:
insightface ``.bin`` files, :mod:`training.evaluation.bin_sets`): the network being trained,
scored as ``sphereface evaluate bin`` scores a model, at the LFW check's steps.

Each check decodes the faces again, in chunks (a set is kept as its encoded bytes, a few MB, not
as crops), cuts the SphereFace 112x96 crop (columns 8 to 103 of the ArcFace face, the trainer's
input) and embeds it with its mirror (:func:`training.lfw_check.embed_crops`). The results go
into the interval's row (``<set>_accuracy``: insightface's scoring), into ``verification.csv``
in the run folder (one line per set and check, kept across resumes) and into ``summary.json``.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from training.callbacks import Callback, Interval
from training.evaluation.bin_sets import VerificationBin, decode_face, read_bin
from training.evaluation.errors import VerificationSetError

log = logging.getLogger(__name__)

#: The columns of ``verification.csv``.
COLUMNS = (
    "step", "set", "pairs", "accuracy", "std", "accuracy_cosine", "std_cosine", "tar_far_1e-3_cosine",
    "seconds",
)  # fmt: skip
#: Faces decoded, cropped and embedded at a time.
CHUNK = 1024


def load_sets(paths: Sequence[str | Path]) -> list[VerificationBin]:
    """Every set read (and checked) once; names are the file names without ``.bin``.

    Raises:
        VerificationSetError: a set cannot be read, or two sets share a name.
    """
    sets = [read_bin(path) for path in paths]
    names = [s.name for s in sets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise VerificationSetError(f"verification_sets names {twice} twice: the log tells sets by file name")
    return sets


def set_features(
    net: nn.Module, verification_set: VerificationBin, device: torch.device, bf16: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(fused, summed)`` features of every face of the set: ``[f(x); f(flip x)]`` (the exported
    model's concat fusion) and ``f(x) + f(flip x)`` (insightface's), each ``(2P, .)`` float32."""
    from models.align import SPHEREFACE_TEMPLATE_112x96
    from models.arcface_crop import crop_from_arcface
    from training.evaluation.parallel import ordered_map
    from training.lfw_check import embed_crops

    images, name = verification_set.images, verification_set.name

    def crop(index: int) -> np.ndarray:
        return crop_from_arcface(decode_face(images[index], index, name), SPHEREFACE_TEMPLATE_112x96)

    fused = []
    for start in range(0, len(images), CHUNK):
        indices = range(start, min(start + CHUNK, len(images)))
        crops = np.stack(list(ordered_map(crop, indices, 2, window=64)))
        fused.append(embed_crops(net, crops, device, bf16=bf16))
    both = np.concatenate(fused)
    half = both.shape[1] // 2
    return both, both[:, :half] + both[:, half:]


class VerificationSetsCheck(Callback):
    """The sets checked at the end of every ``every`` steps' log interval (0: none) and at the
    run's last step; ``last`` holds the latest result of each set."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        net: nn.Module,
        device: torch.device,
        bf16: bool,
        every: int,
        log_path: Path,
        resume_step: int,
    ) -> None:
        started = time.perf_counter()
        self.sets = load_sets(paths)
        self.net, self.device, self.bf16, self.every = net, device, bf16, every
        self.log_path = log_path
        self.last: dict[str, dict[str, Any]] | None = None
        _keep_rows_up_to(log_path, resume_step)
        log.info(
            "verification sets %s read in %.1f s",
            ", ".join(f"{s.name} ({len(s)} pairs)" for s in self.sets), time.perf_counter() - started,
        )  # fmt: skip

    def __call__(self) -> dict[str, dict[str, Any]]:
        """Every set scored with the network as it is now."""
        from training.evaluation.bin_eval import HEADLINE_FAR, score_pairs

        results = {}
        for verification_set in self.sets:
            started = time.perf_counter()
            fused, summed = set_features(self.net, verification_set, self.device, self.bf16)
            scores = score_pairs(fused, summed, verification_set.is_same)
            results[verification_set.name] = {
                "pairs": len(verification_set),
                "accuracy": scores.insightface.accuracy,
                "std": scores.insightface.std,
                "accuracy_cosine": scores.cosine.accuracy,
                "std_cosine": scores.cosine.std,
                "tar_far_1e-3_cosine": scores.roc_cosine.tar_at_far.get(HEADLINE_FAR),
                "seconds": time.perf_counter() - started,
            }
        return results

    def on_interval(self, interval: Interval) -> None:
        if not (interval.is_last or (self.every > 0 and interval.done % self.every == 0)):
            return
        self.last = self()
        with self.log_path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, COLUMNS)
            for name, result in self.last.items():
                interval.row[f"{name}_accuracy"] = result["accuracy"]
                writer.writerow({"step": interval.done, "set": name, **_formatted(result)})


def _formatted(result: dict[str, Any]) -> dict[str, Any]:
    return {k: "" if v is None else f"{v:.6g}" if isinstance(v, float) else v for k, v in result.items()}


def _keep_rows_up_to(path: Path, step: int) -> None:
    """``verification.csv`` with its header and only the lines of steps up to ``step`` (a resumed
    run's later lines are written again)."""
    rows = []
    if path.is_file():
        with path.open(newline="") as handle:
            rows = [r for r in csv.DictReader(handle) if int(r["step"]) <= step]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
