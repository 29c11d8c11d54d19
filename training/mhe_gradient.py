"""How hard SphereFace+'s MHE term pulls on the classifier, next to A-Softmax, at a trained run.

For random batches of the run's training data, the gradient of the weighted output-layer MHE term
(Eq. 5.8) and of the A-Softmax loss (Eq. 2.20, λ at the config's floor) with respect to the
classifier rows of the batch's classes: the ratio of their norms and the cosine between them.
A ratio of 0.01 means MHE moves those neurons 1% as far as the classification loss does.

Usage (docs/training.md §6.4)::

    python -m training.mhe_gradient runs/celeba_more/sf4_asoftmax_m4 \\
        --config training/configs/celeba_more/sf4_sphereface_plus_finetune.toml --batches 5
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from training.config import ConfigError, load_config
from training.data import to_network_input
from training.losses import ASoftmaxHead, SphereFacePlusHead, output_mhe_loss


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
    mhe = head.mhe_weight * output_mhe_loss(head.weight, labels, head.mhe_power, head.mhe_distance)
    grad_mhe = torch.autograd.grad(mhe, head.weight)[0]
    rows = torch.unique(labels)
    a, m = grad_asoftmax[rows].flatten(), grad_mhe[rows].flatten()
    return GradientComparison(
        ratio=float(m.norm() / a.norm()), cosine=float(torch.nn.functional.cosine_similarity(m, a, dim=0))
    )


def _load(run: str, config_path: str) -> tuple[nn.Module, SphereFacePlusHead, np.ndarray, np.ndarray]:
    from training.prepare import load_training_set
    from training.trainer import build_model, load_checkpoint

    config = load_config(config_path)
    if config.head != "sphereface_plus":
        raise ConfigError(f"{config_path}: head is {config.head!r}; the comparison needs sphereface_plus")
    state = load_checkpoint(run)
    data = load_training_set(config.data_paths, config.min_photos_per_identity)
    images, labels = data.concatenate()
    model = build_model(config, int(labels.max()) + 1)
    model.net.load_state_dict(state["net"])
    if state["head"]["weight"].shape != model.head.weight.shape:
        raise ConfigError(f"{run}: its classifier has other classes than the data of {config_path}")
    with torch.no_grad():
        model.head.weight.copy_(state["head"]["weight"])
    return model.net.eval(), model.head, images, labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MHE against A-Softmax gradient on a run's classifier")
    parser.add_argument("run", help="a run folder or checkpoint.pt of sphereface train")
    parser.add_argument("--config", required=True, help="a sphereface_plus config: its data and MHE weight")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-batch numbers here")
    args = parser.parse_args(argv)
    try:
        net, head, images, labels = _load(args.run, args.config)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    results = []
    for _ in range(args.batches):
        chosen = rng.choice(len(labels), args.batch_size, replace=False)
        batch, batch_labels = torch.from_numpy(images[chosen]), torch.from_numpy(labels[chosen]).long()
        results.append(compare_gradients(net, head, batch, batch_labels))
    ratios = [r.ratio for r in results]
    cosines = [r.cosine for r in results]
    print(
        f"MHE weight {head.mhe_weight:g}: ||grad MHE|| / ||grad A-Softmax|| on the batch's classifier rows "
        f"{min(ratios):.4f} / {float(np.median(ratios)):.4f} / {max(ratios):.4f} (min / median / max of "
        f"{len(results)} batches), cosine {min(cosines):.3f} to {max(cosines):.3f}"
    )
    if args.json:
        report = {"run": args.run, "config": args.config, "mhe_weight": head.mhe_weight, "ratios": ratios,
                  "cosines": cosines}  # fmt: skip
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
