"""What SphereFace+'s output-layer MHE (Eq. 5.8) does to a trained run's classifier.

Two measures, for each run given:

- **Gradient:** for random batches of the training data, the gradient of the weighted MHE term
  (Eq. 5.8, or the released Caffe layer's update when the config sets ``mhe_form = "caffe_among"``)
  and of the A-Softmax loss (Eq. 2.20, λ at the config's floor) with respect to the classifier
  rows of the batch's classes: the ratio of their norms and the cosine between them. A ratio of
  0.01 means MHE moves those neurons 1% as far as the classification loss does.
- **Energy by class frequency:** E₂ of every neuron against all others, averaged over all
  classes (the table's E₂), weighted by the classes' share of the photos (what Eq. 5.8's mini-batch
  term lowers in expectation: a batch's classes are drawn by photo), over the classes with 2
  photos, over those with 5 or more, and among the 2-photo classes only.

Usage (docs/results/loss-comparison.md §3)::

    python -m training.mhe_diagnostics runs/celeba_more/sf4_asoftmax_m4_finetune \\
        runs/celeba_more/sf4_sphereface_plus_finetune \\
        --config training/configs/celeba_more/sf4_sphereface_plus_finetune.toml --batches 5
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.config import ConfigError, TrainConfig, load_config
from training.data import to_network_input
from training.losses import ASoftmaxHead, SphereFacePlusHead


@dataclass
class GradientComparison:
    """One batch: ``ratio`` = ||grad MHE|| / ||grad A-Softmax|| over the batch's classifier rows."""

    ratio: float
    cosine: float


def compare_gradients(
    net: nn.Module, head: SphereFacePlusHead, images: torch.Tensor, labels: torch.Tensor
) -> GradientComparison:
    """Both gradients on ``head.weight`` for one batch (``images`` uint8 NHWC crops, ``labels`` (B,))."""
    features = net(to_network_input(images))
    floor_step = 10**9  # λ at its floor, as at the end of a run
    asoftmax = ASoftmaxHead.forward(head, features, labels, step=floor_step).loss
    grad_asoftmax = torch.autograd.grad(asoftmax, head.weight)[0]
    mhe = head.mhe_weight * head.mhe_term(labels)[0]
    grad_mhe = torch.autograd.grad(mhe, head.weight)[0]
    rows = torch.unique(labels)
    a, m = grad_asoftmax[rows].flatten(), grad_mhe[rows].flatten()
    return GradientComparison(
        ratio=float(m.norm() / a.norm()), cosine=float(F.cosine_similarity(m, a, dim=0))
    )


def energy_by_class_frequency(weight: torch.Tensor, photos_per_class: np.ndarray) -> dict[str, float]:
    """E₂ of the unit rows of ``weight`` (C, D), each neuron against all others, averaged five ways.

    ``all``: over the classes (the normalised E₂ of the loss table); ``photo_weighted``: by each
    class's share of the photos; ``two_photos`` / ``five_or_more_photos``: over those classes;
    ``among_two_photo_classes``: E₂ of the 2-photo classes among themselves.
    """
    w = F.normalize(weight.detach().double(), dim=1)
    n = w.shape[0]
    kernel = 1.0 / (2.0 - 2.0 * (w @ w.t())).clamp_min(1e-12)  # f_2 of the Euclidean distance
    kernel.fill_diagonal_(0.0)
    per_class = kernel.sum(dim=1) / (n - 1)
    counts = torch.as_tensor(photos_per_class, dtype=torch.float64)
    rare, common = counts <= 2, counts >= 5
    among_rare = kernel[rare][:, rare].sum() / max(int(rare.sum()) * (int(rare.sum()) - 1), 1)
    return {
        "all": float(per_class.mean()),
        "photo_weighted": float((per_class * counts).sum() / counts.sum()),
        "two_photos": float(per_class[rare].mean()),
        "five_or_more_photos": float(per_class[common].mean()),
        "among_two_photo_classes": float(among_rare),
    }


def _load_data(config_path: str) -> tuple[TrainConfig, np.ndarray, np.ndarray]:
    from training.prepare import load_training_set

    config = load_config(config_path)
    if config.head != "sphereface_plus":
        raise ConfigError(f"{config_path}: head is {config.head!r}; the comparison needs sphereface_plus")
    images, labels = load_training_set(config.data_paths, config.min_photos_per_identity).concatenate()
    return config, images, labels


def _load_run(run: str, config: TrainConfig, num_classes: int) -> tuple[nn.Module, SphereFacePlusHead]:
    from training.trainer import build_model, load_checkpoint

    state = load_checkpoint(run)
    model = build_model(config, num_classes)
    if state["head"]["weight"].shape != model.head.weight.shape:
        raise ConfigError(f"{run}: its classifier has other classes than the config's data")
    model.net.load_state_dict(state["net"])
    with torch.no_grad():
        model.head.weight.copy_(state["head"]["weight"])
    return model.net.eval(), model.head


def _gradient_report(run: str, config: TrainConfig, images: np.ndarray, labels: np.ndarray, args) -> dict:
    net, head = _load_run(run, config, int(labels.max()) + 1)
    rng = np.random.default_rng(args.seed)
    results = []
    for _ in range(args.batches):
        chosen = rng.choice(len(labels), args.batch_size, replace=False)
        batch, batch_labels = torch.from_numpy(images[chosen]), torch.from_numpy(labels[chosen]).long()
        results.append(compare_gradients(net, head, batch, batch_labels))
    ratios, cosines = [r.ratio for r in results], [r.cosine for r in results]
    energy = energy_by_class_frequency(head.weight, np.bincount(labels, minlength=head.weight.shape[0]))
    gradient = (
        f"MHE weight {head.mhe_weight:g} ({head.mhe_form}): ||grad MHE|| / ||grad A-Softmax|| on the "
        f"batch's classifier rows {min(ratios):.3g} / {float(np.median(ratios)):.3g} / {max(ratios):.3g} "
        f"(min / median / max of {len(results)} batches), cosine {min(cosines):.3f} to {max(cosines):.3f}"
    )
    spread = (
        "E2 over all classes {all:.5f}, photo-weighted {photo_weighted:.5f}, 2-photo classes "
        "{two_photos:.5f}, 5+ photos {five_or_more_photos:.5f}, among the 2-photo classes "
        "{among_two_photo_classes:.5f}"
    ).format(**energy)
    print(f"{run}\n  {gradient}\n  {spread}")
    return {
        "run": run,
        "mhe_weight": head.mhe_weight,
        "mhe_form": head.mhe_form,
        "ratios": ratios,
        "cosines": cosines,
        "energy": energy,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="what SphereFace+'s MHE does to trained runs' classifiers")
    parser.add_argument("runs", nargs="+", help="run folders or checkpoint.pt files of sphereface train")
    parser.add_argument("--config", required=True, help="a sphereface_plus config: its data and MHE weight")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        config, images, labels = _load_data(args.config)
        reports = [_gradient_report(run, config, images, labels, args) for run in args.runs]
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": args.config, "runs": reports}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
