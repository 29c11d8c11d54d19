"""Minimum hyperspherical energy (Eq. 5.1, 5.4, 5.5, 5.8, 6.2) and the numpy geometry metrics."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from training import metrics  # noqa: E402
from training.losses import MHE_EPS, HiddenMHE, mhe_energy, output_mhe_loss  # noqa: E402
from training.metrics import (  # noqa: E402
    angular_fisher_score,
    hyperspherical_energy,
    neuron_angles,
)

POWERS = (0, 1, 2)
DISTANCES = ("euclidean", "angular")


def _distance(a: torch.Tensor, b: torch.Tensor, distance: str) -> torch.Tensor:
    """Distance between two unit vectors, computed directly (not from a Gram matrix)."""
    if distance == "euclidean":
        return torch.sqrt(((a - b) ** 2).sum() + MHE_EPS)
    return torch.acos(torch.clamp((a * b).sum(), -1.0 + MHE_EPS, 1.0 - MHE_EPS))


def _f(z: torch.Tensor, power: int) -> torch.Tensor:
    return torch.log(1.0 / z) if power == 0 else z ** (-power)


def _loop_energy(points: torch.Tensor, power: int, distance: str) -> torch.Tensor:
    """Eq. 5.1 over ordered pairs by a double loop, divided by N (N - 1)."""
    unit = points / points.norm(dim=1, keepdim=True)
    n = unit.shape[0]
    total = sum(
        _f(_distance(unit[i], unit[j], distance), power) for i in range(n) for j in range(n) if i != j
    )
    return total / (n * (n - 1))


def _random_weights(n: int = 7, d: int = 5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("power", "distance"), list(itertools.product(POWERS, DISTANCES)))
def test_mhe_energy_and_gradient_match_direct_double_loop(power: int, distance: str) -> None:
    w1 = _random_weights().requires_grad_(True)
    w2 = w1.detach().clone().requires_grad_(True)
    energy = mhe_energy(w1, power=power, distance=distance)
    reference = _loop_energy(w2, power, distance)
    energy.backward()
    reference.backward()
    assert energy.item() == pytest.approx(reference.item(), rel=1e-9)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-7, atol=1e-10)


def test_e2_gradient_is_twice_eq_6_2_for_ordered_pairs_over_the_normalisation() -> None:
    n = 6
    w = F.normalize(_random_weights(n=n, d=4, seed=1), dim=1).requires_grad_(True)
    mhe_energy(w, power=2).backward()
    unit = w.detach()
    diff = unit[:, None, :] - unit[None, :, :]  # (i, j, D): w_i - w_j
    sq = (diff**2).sum(-1) + MHE_EPS
    sq.fill_diagonal_(float("inf"))
    eq_6_2 = (-2.0 * diff / sq[..., None] ** 2).sum(1)  # Eq. 6.2: sum_j -2 (w_i - w_j) / ||w_i - w_j||^4
    # E_2 sums ordered pairs: the pair {i, j} appears as (i, j) and (j, i), so dE_2/dw_i = 2 x Eq. 6.2;
    # mhe_energy divides E_2 by N (N - 1); the gradient w.r.t. the raw w_i (here ||w_i|| = 1) is its
    # projection on the tangent space, (I - w_i w_i^T).
    tangent = torch.eye(4, dtype=torch.float64) - unit[:, :, None] * unit[:, None, :]
    expected = torch.einsum("nij,nj->ni", tangent, 2.0 * eq_6_2 / (n * (n - 1)))
    assert torch.allclose(w.grad, expected, rtol=1e-8, atol=1e-12)
    single_counted = torch.einsum("nij,nj->ni", tangent, eq_6_2 / (n * (n - 1)))
    assert not torch.allclose(w.grad, single_counted, rtol=1e-3)


@pytest.mark.parametrize(("power", "distance"), list(itertools.product(POWERS, DISTANCES)))
def test_half_space_energy_equals_direct_computation_over_2n_points(power: int, distance: str) -> None:
    w = _random_weights(n=5, d=4, seed=2)
    unit = F.normalize(w, dim=1)
    both = torch.cat([unit, -unit], dim=0)
    expected = _loop_energy(both, power, distance)  # normalised by 2N (2N - 1)
    assert mhe_energy(w, power, distance, half_space=True).item() == pytest.approx(expected.item(), rel=1e-9)


def test_mhe_energy_ignores_neuron_norms_and_handles_duplicates() -> None:
    w = _random_weights()
    scaled = w * torch.arange(1, 8, dtype=torch.float64)[:, None]
    assert mhe_energy(scaled).item() == pytest.approx(mhe_energy(w).item(), rel=1e-12)
    duplicated = torch.cat([w, w[:1]]).requires_grad_(True)
    energy = mhe_energy(duplicated)
    energy.backward()
    assert torch.isfinite(energy) and torch.isfinite(duplicated.grad).all()
    assert mhe_energy(w[:1]).item() == 0.0


@pytest.mark.parametrize(("power", "distance"), list(itertools.product(POWERS, DISTANCES)))
def test_output_mhe_loss_equals_direct_loop_of_eq_5_8(power: int, distance: str) -> None:
    num_classes = 6
    w1 = _random_weights(n=num_classes, d=5, seed=3).requires_grad_(True)
    w2 = w1.detach().clone().requires_grad_(True)
    labels = torch.tensor([0, 3, 3, 5, 1])
    loss = output_mhe_loss(w1, labels, power=power, distance=distance)
    unit = w2 / w2.norm(dim=1, keepdim=True)
    total = sum(
        _f(_distance(unit[y], unit[j], distance), power)
        for y in labels.tolist()
        for j in range(num_classes)
        if j != y
    )
    reference = total / (len(labels) * (num_classes - 1))  # Eq. 5.8, 1 / (m (N - 1))
    loss.backward()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-9)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-7, atol=1e-10)
    assert w1.grad[[2, 4]].abs().sum().item() > 0  # classes absent from the batch are pushed too


def test_gradient_descent_on_energy_spreads_ten_neurons_on_the_sphere() -> None:
    w = _random_weights(n=10, d=3, seed=4).float().requires_grad_(True)
    start_energy = mhe_energy(w).item()
    start_angle = neuron_angles(w.detach().numpy())["min_deg"]
    optimiser = torch.optim.SGD([w], lr=0.5)
    for _ in range(300):
        optimiser.zero_grad()
        mhe_energy(w).backward()
        optimiser.step()
    end_energy = mhe_energy(w).item()
    end_angle = neuron_angles(w.detach().numpy())["min_deg"]
    assert end_energy < start_energy
    assert end_angle > start_angle + 5.0


@pytest.mark.parametrize(
    ("power", "distance", "half_space"),
    [(s, d, h) for s in POWERS for d in DISTANCES for h in (False, True)],
)
def test_numpy_hyperspherical_energy_equals_torch_mhe_energy(
    power: int, distance: str, half_space: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _random_weights(n=40, d=16, seed=5)
    expected = mhe_energy(w, power, distance, half_space).item()
    assert hyperspherical_energy(w.numpy(), power, distance, half_space) == pytest.approx(expected, rel=1e-9)
    monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", 7 * 40)  # several row blocks
    assert hyperspherical_energy(w.numpy(), power, distance, half_space) == pytest.approx(expected, rel=1e-9)


def test_neuron_angles_on_a_known_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    square = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [0.0, -0.5]])
    expected = {"min_deg": 90.0, "mean_deg": 120.0, "nearest_mean_deg": 90.0}
    assert neuron_angles(square) == pytest.approx(expected)
    monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", 4)  # one row per block
    assert neuron_angles(square) == pytest.approx(expected)


def test_angular_fisher_score_matches_hand_computation() -> None:
    # normalised: class 0 = e1, e2 (mean direction 45 deg); class 1 = -e2; global mean = (1/3, 0)
    features = np.array([[2.0, 0.0], [0.0, 0.5], [0.0, -2.0]])
    labels = np.array([7, 7, 3])
    s_w = 2.0 * (1.0 - 1.0 / math.sqrt(2.0))
    s_b = 2.0 * (1.0 - 1.0 / math.sqrt(2.0)) + 1.0 * (1.0 - 0.0)
    assert angular_fisher_score(features, labels) == pytest.approx(s_w / s_b, rel=1e-12)


def test_angular_fisher_score_is_lower_for_tight_clusters() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(10, 32))
    labels = np.repeat(np.arange(10), 20)

    def sample(spread: float) -> np.ndarray:
        return centres[labels] + spread * rng.normal(size=(labels.size, 32))

    tight = angular_fisher_score(sample(0.1), labels)
    loose = angular_fisher_score(sample(1.0), labels)
    assert 0.0 <= tight < loose
    with pytest.raises(ValueError):
        angular_fisher_score(sample(0.1)[:20], labels[:20])


def _tiny_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 6),
        torch.nn.Linear(6, 5),
    )


def _layer_weights(net: torch.nn.Sequential) -> list[torch.Tensor]:
    return [net[0].weight.reshape(4, -1), net[3].weight, net[4].weight]


@pytest.mark.parametrize("half_space", [False, True])
def test_hidden_mhe_is_weight_times_sum_of_per_layer_energies(half_space: bool) -> None:
    net = _tiny_net()
    regulariser = HiddenMHE(half_space=half_space)
    assert regulariser.weight == (1.0 if half_space else 10.0)  # thesis App. D.1 defaults
    value = regulariser(net)
    expected = regulariser.weight * sum(
        mhe_energy(w, 2, "euclidean", half_space) for w in _layer_weights(net)
    )
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    value.backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum().item() > 0
    assert HiddenMHE(weight=0.5, power=0)(net).item() == pytest.approx(
        0.5 * sum(mhe_energy(w, 0).item() for w in _layer_weights(net)), rel=1e-6
    )


def test_hidden_mhe_mini_batch_uses_a_random_subset_of_neurons_per_layer() -> None:
    net = _tiny_net()
    regulariser = HiddenMHE(weight=1.0, max_neurons=3)
    value = regulariser(net, generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    expected = 0.0
    for w in _layer_weights(net):
        pick = torch.randperm(w.shape[0], generator=g)[:3]
        expected += mhe_energy(w[pick]).item()
    assert value.item() == pytest.approx(expected, rel=1e-6)
    full = HiddenMHE(weight=1.0, max_neurons=100)(net)
    assert full.item() == pytest.approx(HiddenMHE(weight=1.0)(net).item(), rel=1e-6)


def test_mhe_gradient_comparison_splits_the_sphereface_plus_gradient_and_scales_with_the_weight() -> None:
    from torch import nn

    from training.data import to_network_input
    from training.losses import SphereFacePlusHead
    from training.mhe_diagnostics import compare_gradients

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 6, 16))
    images = torch.randint(0, 256, (12, 8, 6, 3), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 3] * 3)
    classifier = torch.randn(9, 16)
    comparisons = []
    for weight in (10.0, 20.0):
        head = SphereFacePlusHead(16, 9, m=4, lambda_schedule=5.0, mhe_weight=weight)
        with torch.no_grad():
            head.weight.copy_(classifier)
        comparisons.append(compare_gradients(net, head, images, labels))
        # The two parts add up to the gradient of the SphereFace+ loss itself (Eq. 5.8).
        loss = head(net(to_network_input(images)), labels, step=10**9).loss
        total = torch.autograd.grad(loss, head.weight)[0]
        mhe = torch.autograd.grad(weight * output_mhe_loss(head.weight, labels), head.weight)[0]
        rows = torch.unique(labels)
        asoftmax_norm = (total - mhe)[rows].norm()
        assert comparisons[-1].ratio == pytest.approx(float(mhe[rows].norm() / asoftmax_norm), rel=1e-4)
    assert comparisons[1].ratio == pytest.approx(2 * comparisons[0].ratio, rel=1e-5)
    assert comparisons[1].cosine == pytest.approx(comparisons[0].cosine, abs=1e-5)
    assert comparisons[0].ratio > 0


def test_energy_by_class_frequency_matches_a_direct_loop() -> None:
    from training.mhe_diagnostics import energy_by_class_frequency

    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 4))
    counts = np.array([2, 2, 5, 9, 3, 2])
    unit = w / np.linalg.norm(w, axis=1, keepdims=True)
    pair = [[0.0 if i == j else 1 / np.sum((unit[i] - unit[j]) ** 2) for j in range(6)] for i in range(6)]
    per_class = np.array([sum(row) / 5 for row in pair])
    rare = [0, 1, 5]
    among_rare = sum(pair[i][j] for i in rare for j in rare if i != j) / 6
    got = energy_by_class_frequency(torch.from_numpy(w * 3.0), counts)  # row norms play no part
    assert got["all"] == pytest.approx(per_class.mean(), rel=1e-9)
    assert got["photo_weighted"] == pytest.approx(np.sum(per_class * counts) / counts.sum(), rel=1e-9)
    assert got["two_photos"] == pytest.approx(per_class[rare].mean(), rel=1e-9)
    assert got["five_or_more_photos"] == pytest.approx(per_class[[2, 3]].mean(), rel=1e-9)
    assert got["among_two_photo_classes"] == pytest.approx(among_rare, rel=1e-9)
    assert got["all"] == pytest.approx(float(mhe_energy(torch.from_numpy(w))), rel=1e-5)  # MHE_EPS


def test_caffe_among_form_gives_the_released_layers_update_to_the_batch_neurons_only() -> None:
    """The InterClass layer (type AMONG) of the authors' Caffe, written out as its kernels do: D
    over all neurons and the batch's labels, then -4/(M D^2 + 1e-5) (w_y - w_mean) per sample."""
    from training.losses import SphereFacePlusHead, caffe_among_distance, caffe_among_mhe_loss

    torch.manual_seed(0)
    weights = torch.randn(7, 5, requires_grad=True)
    labels = torch.tensor([1, 4, 4, 0, 6])  # a class twice: its two updates add up
    term = caffe_among_mhe_loss(weights, labels)
    assert term.item() == 0.0
    (grad,) = torch.autograd.grad(term, weights)

    w = torch.nn.functional.normalize(weights.detach().double(), dim=1)
    n, m = w.shape[0], len(labels)
    distance = sum(float(((w[i] - w[y]) ** 2).sum()) for i in range(n) for y in labels.tolist()) / n
    assert caffe_among_distance(weights, labels).item() == pytest.approx(distance, rel=1e-6)
    expected = torch.zeros_like(w)
    coefficient = -4.0 / (m * distance**2 + 1e-5)
    for y in labels.tolist():
        expected[y] += coefficient * (w[y] - w.mean(0))
    torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-9)
    assert grad[[2, 3, 5]].abs().max() == 0  # neurons of classes not in the batch do not move

    head = SphereFacePlusHead(5, 7, m=4, lambda_schedule=5.0, mhe_weight=10.0, mhe_form="caffe_among")
    term, logged = head.mhe_term(labels)
    assert term.item() == 0.0
    assert logged.item() == pytest.approx(caffe_among_distance(head.weight, labels).item())
    with pytest.raises(ValueError, match="mhe_form"):
        SphereFacePlusHead(5, 7, mhe_form="caffe")
