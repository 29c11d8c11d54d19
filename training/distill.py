"""Distillation from a teacher model folder: one network learns to score pairs as the teacher does.

Two of this project's networks side by side reach 90% on LFW where each alone stays near 89%
(``sphereface combine``), at twice the cost per face. Distillation asks one network to reproduce
the ensemble's similarities: in every batch, the cosine of each pair of the student's features is
pulled towards the cosine the teacher gives the same two (augmented, possibly mirrored) crops,

    L_distill = mean over pairs i != j of (cos(s_i, s_j) - cos(t_i, t_j))^2,

added to the training loss with the weight ``distill_weight``. The loss compares similarities,
not features, so the student may have any embedding size (MobileFaceNet's 128 against the
ensemble's 256). It is the relational form of knowledge distillation (Park et al., CVPR 2019,
distance-wise term, here on cosines, the service's score).

The teacher is any model folder (``sphereface models``), run on ONNX Runtime on the batch the
student sees: the CPU's threads are shared with training (set ``threads``), on a GPU run its CUDA
provider. It is not a method of the SphereFace papers: docs/results/sphereface-celeba.md reports
what it gives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.manifest import INPUT_NAME, MODEL_NAME, load_manifest
from models.runtime import create_session
from training.step_hooks import StepHook, StepInputs


class TeacherEmbedder:
    """A model folder's network on batches already in the trainer's input form.

    The trainer feeds ``(pixel - 127.5) / 128`` RGB crops of the SphereFace 112x96 template, so
    only teachers that take exactly that crop are accepted.
    """

    def __init__(self, model_dir: str | Path, device: torch.device, threads: int = 0) -> None:
        manifest = load_manifest(model_dir)
        expected = {
            "template": "sphereface_112x96", "color_order": "RGB", "pixel_mean": 127.5, "pixel_std": 128.0,
        }  # fmt: skip
        differing = {k: getattr(manifest, k) for k, v in expected.items() if getattr(manifest, k) != v}
        if differing:
            raise ValueError(
                f"the teacher {model_dir} takes a different crop than the trainer feeds ({differing}); "
                f"a teacher must take {expected}"
            )
        providers = "cuda,cpu" if device.type == "cuda" else "cpu"
        self.session = create_session(Path(model_dir) / MODEL_NAME, providers, intra_op_threads=threads)
        self.model_id = manifest.model_id
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, 112, 96)`` network input -> the teacher's L2-normalised features ``(B, D)``."""
        batch = images.detach().float().cpu().contiguous().numpy()
        out = self.session.run(None, {INPUT_NAME: batch})[0]
        features = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(self.device)
        return F.normalize(features, dim=1)

    def distillation_loss(self, student_features: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """:func:`similarity_distillation_loss` of the student's features of ``images`` against
        this teacher's."""
        return similarity_distillation_loss(student_features, self(images))


class DistillationHook(StepHook):
    """The step hook of distillation: ``weight * L_distill`` added to the loss, ``L_distill``
    logged as ``distill``."""

    def __init__(self, teacher: TeacherEmbedder, weight: float) -> None:
        self.teacher, self.weight = teacher, weight
        self._term: torch.Tensor | None = None

    def penalty(self, inputs: StepInputs) -> torch.Tensor:
        term = self.teacher.distillation_loss(inputs.features, inputs.images)
        self._term = term.detach()
        return self.weight * term

    def logged(self) -> dict[str, torch.Tensor]:
        return {} if self._term is None else {"distill": self._term}


def similarity_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the pairwise cosines of ``student`` and ``teacher`` features
    (rows are the same crops; the diagonal, always 1, is left out)."""
    if student.shape[0] != teacher.shape[0]:
        raise ValueError(f"{student.shape[0]} student features but {teacher.shape[0]} teacher features")
    n = student.shape[0]
    if n < 2:
        return student.sum() * 0.0
    s = F.normalize(student.float(), dim=1)
    t = F.normalize(teacher.float(), dim=1)
    off_diagonal = ~torch.eye(n, dtype=torch.bool, device=s.device)
    return ((s @ s.T - t @ t.T)[off_diagonal] ** 2).mean()
