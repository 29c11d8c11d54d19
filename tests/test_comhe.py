"""Compressive MHE (training/comhe.py): energies by hand, the projections, Lemma 3 and Theorem 3."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.comhe import (
    CoMHEOptions,
    CompressiveMHE,
    angle_preservation_loss,
    group_energy,
    hidden_regulariser,
    projected_energy,
)
from training.losses import HiddenMHE, mhe_energy

D64 = torch.float64


def _pairwise_energy(unit: torch.Tensor, power: int = 2) -> float:
    """Eq. 6.3 for unit rows, by a double loop, normalised by the ordered pairs."""
    n = unit.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += float((unit[i] - unit[j]).norm()) ** (-power)
    return total / (n * (n - 1))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(16, 12, 3), nn.ReLU(), nn.Conv2d(12, 12, 3), nn.Flatten(), nn.Linear(108, 6)
    )


def test_random_projection_energy_is_eq_6_4_by_hand():
    torch.manual_seed(1)
    w = torch.randn(7, 40, dtype=D64)
    p = torch.randn(3, 5, 40, dtype=D64)
    expected = []
    for c in range(3):
        projected = F.normalize(F.normalize(w, dim=1) @ p[c].T, dim=1)
        expected.append(_pairwise_energy(projected))
    mean = projected_energy(w, p, half_space=False)
    assert float(mean) == pytest.approx(sum(expected) / 3, rel=1e-4)  # MHE_EPS inside the kernel
    assert float(projected_energy(w, p, half_space=False, reduce="max")) == pytest.approx(
        max(expected), rel=1e-4
    )


def test_group_energy_is_the_mean_energy_of_each_channel_groups_sub_neurons():
    torch.manual_seed(2)
    w = torch.randn(6, 10 * 9, dtype=D64)  # 10 input channels, 3x3 kernels
    groups = [w.reshape(6, 10, 9)[:, a:b].reshape(6, -1) for a, b in ((0, 4), (4, 8), (8, 10))]
    expected = sum(float(mhe_energy(g, 2, half_space=True)) for g in groups) / 3
    assert float(group_energy(w, 10, 4, half_space=True)) == pytest.approx(expected)


def test_random_projections_are_redrawn_every_n_calls_and_shared_by_equal_dimensions():
    net = nn.Sequential(nn.Linear(20, 8), nn.Linear(20, 8), nn.Linear(8, 4))
    reg = CompressiveMHE("random", options=CoMHEOptions(dim=5, projections=2, redraw_every=3))
    reg(net)
    first = dict(reg._projections)
    assert set(first) == {20, 8} and first[20].shape == (2, 5, 20)
    reg(net)
    reg(net)
    assert torch.equal(reg._projections[20], first[20])  # calls 1 and 2 keep it
    reg(net)
    assert not torch.equal(reg._projections[20], first[20])  # call 3 draws anew
    separate = CompressiveMHE("random", options=CoMHEOptions(dim=5, share=False))
    separate(net)
    assert len(separate._projections) == 3


def test_random_projection_gradients_reach_the_neurons_and_not_the_projection():
    net = _net()
    reg = hidden_regulariser(1.0, True, "random", {"dim": 10, "projections": 3})
    loss = reg(net)
    loss.backward()
    assert all(
        layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in HiddenMHE.layers(net)
    )
    assert all(not p.requires_grad for p in reg._projections.values())


def test_angle_preserving_projection_preserves_angles_better_than_a_random_one():
    torch.manual_seed(3)
    w = torch.randn(30, 200)
    random_p = torch.randn(1, 12, 200)
    reg = CompressiveMHE("angle", options=CoMHEOptions(dim=12, ap_steps=200))
    reg._projections[200] = random_p.clone()
    reg._fit_angle_projection(200, [w])
    before = float(angle_preservation_loss(w, random_p[0]))
    after = float(angle_preservation_loss(w, reg._projections[200][0]))
    assert after < 0.5 * before


def test_unrolled_angle_projection_adds_a_second_order_gradient_path():
    torch.manual_seed(4)
    w = torch.randn(6, 15, dtype=D64, requires_grad=True)
    p0 = torch.randn(1, 4, 15, dtype=D64)

    def unrolled(weights: torch.Tensor) -> torch.Tensor:
        reg = CompressiveMHE("angle", options=CoMHEOptions(dim=4, unrolled=True, ap_lr=0.3))
        reg._projections[15] = p0.clone()
        return projected_energy(weights, reg._unrolled_projection(15, [weights]), half_space=False)

    assert torch.autograd.gradcheck(unrolled, (w,), eps=1e-6, atol=1e-5)
    # the stepped projection depends on the neurons: its gradient w.r.t. them is not zero
    reg = CompressiveMHE("angle", options=CoMHEOptions(dim=4, unrolled=True, ap_lr=0.3))
    reg._projections[15] = p0.clone()
    stepped = reg._unrolled_projection(15, [w])
    (grad,) = torch.autograd.grad(stepped.sum(), w)
    assert grad.abs().max() > 1e-6


def test_every_projection_trains_a_small_network_and_lowers_its_compressive_energy():
    for projection in ("random", "angle", "group"):
        net = _net()
        reg = hidden_regulariser(1.0, True, projection, {"dim": 8, "redraw_every": 1000})
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        first = float(reg(net).detach())
        for _ in range(30):
            loss = reg(net)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert float(reg(net).detach()) < first, projection


def test_bad_comhe_options_get_clear_errors():
    with pytest.raises(ValueError, match="unknown CoMHE projection"):
        CompressiveMHE("pca")
    with pytest.raises(ValueError, match="unknown CoMHE options"):
        CoMHEOptions.from_options({"dims": 3})
    with pytest.raises(ValueError, match="reduce must be mean or max"):
        CoMHEOptions(reduce="sum")
    from training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs hidden_mhe_weight"):
        load_config(None, ["data=x", 'hidden_mhe_projection="random"'])
    with pytest.raises(ConfigError, match="unknown CoMHE options"):
        load_config(
            None,
            [
                "data=x",
                "hidden_mhe_weight=1",
                'hidden_mhe_projection="random"',
                "hidden_mhe_options={ k = 3 }",
            ],
        )


# ------------------------------------------------------------------------------------------------
# Theory: Lemma 3 and Theorem 3 (CoMHE, thesis Ch. 6), by Monte Carlo
# ------------------------------------------------------------------------------------------------


def test_lemma_3_random_projection_preserves_inner_products_in_expectation():
    """E<P w1, P w2> = k <w1, w2> for P with N(0, 1) entries (k rows): Lemma 3 up to the 1/k scale."""
    generator = torch.Generator().manual_seed(5)
    d, k, draws = 50, 8, 20000
    w1, w2 = torch.randn(d, generator=generator, dtype=D64), torch.randn(d, generator=generator, dtype=D64)
    p = torch.randn(draws, k, d, generator=generator, dtype=D64)
    products = ((p @ w1) * (p @ w2)).sum(1) / k
    standard_error = float(products.std()) / math.sqrt(draws)
    assert abs(float(products.mean()) - float(w1 @ w2)) < 4 * standard_error


@pytest.mark.parametrize(("k", "epsilon"), [(30, 0.9), (100, 0.6), (400, 0.3)])
def test_theorem_3_bound_holds_at_least_as_often_as_it_promises(k, epsilon):
    generator = torch.Generator().manual_seed(k)
    d, draws = 500, 400
    cosines = []
    for angle in (0.3, 1.2, 2.5):
        w1 = torch.zeros(d, dtype=D64)
        w1[0] = 1.0
        w2 = torch.zeros(d, dtype=D64)
        w2[0], w2[1] = math.cos(angle), math.sin(angle)
        p = torch.randn(draws, k, d, generator=generator, dtype=D64)
        projected = F.cosine_similarity(p @ w1, p @ w2, dim=1)
        c = math.cos(angle)
        inside = ((c - epsilon) / (1 + epsilon) < projected) & (projected < (c + epsilon) / (1 - epsilon))
        promised = (1 - 2 * math.exp(-k * epsilon**2 / 8)) ** 2
        assert float(inside.double().mean()) >= promised
        cosines.append((projected - c).abs().mean())
    # the projected angle concentrates as k grows (the reason for a projection dimension of 30, not 3)
    assert float(torch.stack(cosines).mean()) < 2.0 / math.sqrt(k)
