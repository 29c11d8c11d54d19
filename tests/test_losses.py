"""Classifier heads of training/losses.py: A-Softmax (Eq. 2.7, 2.18, 2.20), annealing, baselines."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from training.losses import (  # noqa: E402
    HEADS,
    ArcFaceHead,
    ASoftmaxHead,
    CosFaceHead,
    GASoftmaxHead,
    LambdaSchedule,
    ModifiedSoftmaxHead,
    SoftmaxHead,
    SphereFacePlusHead,
    SSoftmaxHead,
    WSoftmaxHead,
    arc_margin_cos,
    build_head,
    cos_m_theta,
    output_mhe_loss,
    psi,
)

MARGINS = (1, 2, 3, 4)


def _theta_grid(n: int = 20001) -> torch.Tensor:
    return torch.linspace(0.0, math.pi, n, dtype=torch.float64)


def _batch(n: int = 12, d: int = 8, c: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    features = 3.0 * torch.randn(n, d, generator=g)
    labels = torch.randint(0, c, (n,), generator=g)
    return features, labels


def _modified_softmax_reference(weight: torch.Tensor, features: torch.Tensor, labels: torch.Tensor):
    return F.cross_entropy(features @ F.normalize(weight, dim=1).t(), labels)


@pytest.mark.parametrize("m", MARGINS)
def test_multi_angle_polynomial_equals_cos_m_arccos(m: int) -> None:
    c = torch.linspace(-1.0, 1.0, 4001, dtype=torch.float64)
    expected = torch.cos(m * torch.arccos(c))
    assert (cos_m_theta(c, m) - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("m", MARGINS)
def test_psi_equals_cos_m_theta_on_first_interval(m: int) -> None:
    theta = torch.linspace(0.0, math.pi / m, 2001, dtype=torch.float64)
    assert torch.allclose(psi(torch.cos(theta), m), torch.cos(m * theta), atol=1e-9)


@pytest.mark.parametrize("m", MARGINS)
def test_psi_is_continuous_at_every_interval_boundary(m: int) -> None:
    for k in range(1, m):
        edge = k * math.pi / m
        around = torch.tensor([edge - 1e-9, edge, edge + 1e-9], dtype=torch.float64)
        values = psi(torch.cos(around), m)
        assert (values - (1.0 - 2.0 * k)).abs().max().item() < 1e-6


@pytest.mark.parametrize("m", MARGINS)
def test_psi_strictly_decreasing_with_endpoints_and_below_cos(m: int) -> None:
    theta = _theta_grid()
    c = torch.cos(theta)
    values = psi(c, m)
    assert bool((values[1:] < values[:-1]).all())
    assert values[0].item() == pytest.approx(1.0, abs=1e-12)
    assert values[-1].item() == pytest.approx(1.0 - 2.0 * m, abs=1e-9)
    assert bool((values <= c + 1e-12).all())
    if m >= 2:
        assert bool((values[1:] < c[1:]).all())


def test_psi_k_carries_no_gradient_and_matches_analytic_derivative() -> None:
    theta = torch.tensor([0.3, 1.0, 2.0, 2.9], dtype=torch.float64)
    c = torch.cos(theta).requires_grad_(True)
    psi(c, 4).sum().backward()
    # d/dc [(-1)^k cos(4 theta) - 2k] = (-1)^k * 4 sin(4 theta) / sin(theta)
    k = torch.clamp(torch.floor(4 * theta / math.pi), max=3)
    expected = (-1.0) ** k * 4 * torch.sin(4 * theta) / torch.sin(theta)
    assert torch.allclose(c.grad, expected, atol=1e-9)


@pytest.mark.parametrize("bad", [0, 5, 2.0, True, "4"])
def test_asoftmax_rejects_margins_outside_1_to_4(bad: object) -> None:
    with pytest.raises(ValueError):
        ASoftmaxHead(8, 5, m=bad)


@pytest.mark.parametrize("schedule", [None, LambdaSchedule(), 7.0])
def test_asoftmax_m1_equals_modified_softmax_loss_and_gradients(schedule) -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=1, lambda_schedule=schedule)
    x1 = features.clone().requires_grad_(True)
    loss = head(x1, labels, step=3).loss
    loss.backward()

    w2 = head.weight.detach().clone().requires_grad_(True)
    x2 = features.clone().requires_grad_(True)
    reference = _modified_softmax_reference(w2, x2, labels)
    reference.backward()

    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)
    assert torch.allclose(head.weight.grad, w2.grad, atol=1e-6)


def test_modified_softmax_head_is_asoftmax_with_m1_and_no_annealing() -> None:
    features, labels = _batch()
    head = ModifiedSoftmaxHead(8, 5)
    assert head.m == 1
    out = head(features, labels, step=0)
    assert out.extras["lambda"] == 0.0
    assert out.loss.item() == pytest.approx(
        _modified_softmax_reference(head.weight.detach(), features, labels).item(), rel=1e-6
    )


def test_huge_lambda_makes_asoftmax_m4_equal_modified_softmax() -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=4, lambda_schedule=LambdaSchedule(base=1e9, minimum=1e9))
    loss = head(features, labels, step=0).loss
    reference = _modified_softmax_reference(head.weight.detach(), features, labels)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    pure = ASoftmaxHead(8, 5, m=4, lambda_schedule=None)
    pure.load_state_dict(head.state_dict())
    assert pure(features, labels).loss.item() > reference.item() + 1e-3


@pytest.mark.parametrize("m", MARGINS)
@pytest.mark.parametrize("lam", [0.0, 5.0, 1000.0])
def test_non_target_logits_are_unchanged_for_any_lambda(m: int, lam: float) -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=m, lambda_schedule=lam)
    with torch.no_grad():
        margin = head.margin_logits(features, labels)
        plain = features @ F.normalize(head.weight, dim=1).t()
    non_target = torch.ones_like(plain, dtype=torch.bool).scatter(1, labels.view(-1, 1), False)
    assert torch.allclose(margin[non_target], plain[non_target], atol=1e-6)
    # the target logit is the annealed psi logit of thesis App. A.7
    norm = features.norm(dim=1)
    cos_y = plain.gather(1, labels.view(-1, 1)).squeeze(1) / norm
    expected = norm * (lam * cos_y + psi(cos_y, m)) / (1.0 + lam)
    assert torch.allclose(margin.gather(1, labels.view(-1, 1)).squeeze(1), expected, atol=1e-5)


def test_asoftmax_loss_is_cross_entropy_of_margin_logits_and_logits_have_no_margin() -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=4)
    out = head(features, labels, step=100)
    with torch.no_grad():
        expected = F.cross_entropy(head.margin_logits(features, labels, step=100), labels)
        plain = features @ F.normalize(head.weight, dim=1).t()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(out.logits, plain, atol=1e-6)
    assert out.extras["lambda"] == pytest.approx(LambdaSchedule()(100))


@pytest.mark.parametrize("m", (2, 3, 4))
def test_pure_asoftmax_loss_is_at_least_modified_softmax_loss(m: int) -> None:
    for seed in range(5):
        features, labels = _batch(seed=seed)
        head = ASoftmaxHead(8, 5, m=m, lambda_schedule=None)
        reference = _modified_softmax_reference(head.weight.detach(), features, labels)
        assert head(features, labels).loss.item() >= reference.item() - 1e-6


def _caffe_lambdas(iterations: int) -> list[float]:
    """lambda as the authors' MarginInnerProductLayer computes it, forward pass by forward pass:
    ``iter_ += 1`` first, then ``max(base * (1 + gamma * iter_) ** -power, lambda_min)``."""
    out, iter_ = [], 0.0
    for _ in range(iterations):
        iter_ += 1.0
        out.append(max(1000.0 * (1.0 + 0.12 * iter_) ** -1.0, 5.0))
    return out


def test_lambda_schedule_equals_the_authors_caffe_layer_step_by_step() -> None:
    schedule = LambdaSchedule()
    expected = _caffe_lambdas(5000)
    assert [schedule(t) for t in range(5000)] == pytest.approx(expected, rel=1e-12)
    assert schedule(0) == pytest.approx(892.857, abs=1e-3)  # Caffe's first lambda, not 1000
    assert schedule(1657) > 5.0
    assert schedule(1658) == 5.0
    assert schedule.floor_step() == 1658
    assert schedule(10**7) == 5.0


def test_asoftmax_normalises_weights_every_forward_without_touching_the_parameter() -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=4)
    before = head(features, labels, step=2000).loss.item()
    with torch.no_grad():
        head.weight.mul_(3.7)
    stored = head.weight.detach().clone()
    after = head(features, labels, step=2000).loss.item()
    assert after == pytest.approx(before, rel=1e-6)
    assert torch.equal(head.weight.detach(), stored)
    assert not torch.allclose(stored.norm(dim=1), torch.ones(5))


def test_asoftmax_keeps_the_feature_norm() -> None:
    features, labels = _batch()
    head = ASoftmaxHead(8, 5, m=4)
    small = head(features, labels, step=2000)
    large = head(2.0 * features, labels, step=2000)
    assert abs(small.loss.item() - large.loss.item()) > 1e-3
    assert torch.allclose(large.logits, 2.0 * small.logits, atol=1e-5)


def test_softmax_head_is_linear_layer_with_bias_and_cross_entropy() -> None:
    features, labels = _batch()
    head = SoftmaxHead(8, 5)
    with torch.no_grad():
        head.bias.copy_(torch.arange(5.0))
    out = head(features, labels)
    logits = features @ head.weight.detach().t() + head.bias.detach()
    assert torch.allclose(out.logits, logits, atol=1e-6)
    assert out.loss.item() == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)


def _two_class_head(head_cls, **options):
    head = head_cls(2, 2, **options)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 0.5]]))  # normalised to e1, e2
    return head


def test_cosface_target_logit_matches_hand_computation() -> None:
    head = _two_class_head(CosFaceHead, scale=30.0, margin=0.35)
    features = torch.tensor([[6.0, 8.0], [-3.0, 4.0]])  # cos to e1: 0.6 and -0.6; to e2: 0.8, 0.8
    labels = torch.tensor([0, 1])
    margin = head.margin_logits(features, labels)
    expected = torch.tensor([[30.0 * (0.6 - 0.35), 30.0 * 0.8], [30.0 * -0.6, 30.0 * (0.8 - 0.35)]])
    assert torch.allclose(margin, expected, atol=1e-4)
    out = head(features, labels)
    assert torch.allclose(out.logits, torch.tensor([[18.0, 24.0], [-18.0, 24.0]]), atol=1e-4)
    assert out.loss.item() == pytest.approx(F.cross_entropy(expected, labels).item(), rel=1e-5)


def test_arcface_target_logit_matches_hand_computation() -> None:
    head = _two_class_head(ArcFaceHead, scale=30.0, margin=0.5)
    features = torch.tensor([[6.0, 8.0], [-1.0, 1e-3]])
    labels = torch.tensor([0, 0])
    margin = head.margin_logits(features, labels)
    assert margin[0, 0].item() == pytest.approx(30.0 * math.cos(math.acos(0.6) + 0.5), rel=1e-5)
    assert margin[0, 1].item() == pytest.approx(30.0 * 0.8, rel=1e-5)
    # theta ~ pi - 1e-3 > pi - m: fallback -2 - cos(theta + m)
    theta = math.atan2(1e-3, -1.0)
    assert margin[1, 0].item() == pytest.approx(30.0 * (-2.0 - math.cos(theta + 0.5)), rel=1e-4)
    out = head(features, labels)
    assert out.logits[0, 0].item() == pytest.approx(18.0, rel=1e-5)


def test_arcface_target_cosine_is_continuous_decreasing_and_below_cos() -> None:
    theta = _theta_grid()
    c = torch.cos(theta)
    for m in (0.2, 0.5, 1.0):
        values = arc_margin_cos(c, m)
        assert bool((values[1:] < values[:-1]).all())
        assert (values[1:] - values[:-1]).abs().max().item() < 1e-3
        assert bool((values <= c + 1e-12).all())
    with pytest.raises(ValueError):
        ArcFaceHead(2, 2, margin=4.0)


def test_build_head_builds_every_head_and_rejects_unknown_names() -> None:
    expected = {
        "softmax": SoftmaxHead,
        "modified_softmax": ModifiedSoftmaxHead,
        "asoftmax": ASoftmaxHead,
        "sphereface_plus": SphereFacePlusHead,
        "cosface": CosFaceHead,
        "arcface": ArcFaceHead,
        "w_softmax": WSoftmaxHead,
        "ga_softmax": GASoftmaxHead,
        "s_softmax": SSoftmaxHead,
    }
    assert set(HEADS) == set(expected)
    for name in HEADS:
        head = build_head(name, 8, 5)
        assert type(head) is expected[name]
        assert head.weight.shape == (5, 8)
    assert build_head("asoftmax", 8, 5, m=2).m == 2
    assert build_head("cosface", 8, 5, scale=64.0).scale == 64.0
    with pytest.raises(ValueError, match="sphereface_plus"):
        build_head("large_margin", 8, 5)


def test_sphereface_plus_adds_weighted_output_mhe_and_logs_it() -> None:
    features, labels = _batch()
    plain = ASoftmaxHead(8, 5, m=4)
    plus = SphereFacePlusHead(8, 5, m=4, mhe_weight=2.5)
    plus.load_state_dict(plain.state_dict())
    out = plus(features, labels, step=50)
    ce = plain(features, labels, step=50).loss.item()
    mhe = output_mhe_loss(plus.weight.detach(), labels).item()
    assert out.loss.item() == pytest.approx(ce + 2.5 * mhe, rel=1e-6)
    assert float(out.extras["mhe"]) == pytest.approx(mhe, rel=1e-6)
    assert float(out.extras["ce"]) == pytest.approx(ce, rel=1e-6)
    assert out.extras["lambda"] == pytest.approx(LambdaSchedule()(50))


@pytest.mark.parametrize("name", HEADS)
def test_heads_run_under_bf16_autocast_and_return_float32(name: str) -> None:
    torch.manual_seed(0)
    head = build_head(name, 8, 5)
    features, labels = _batch()
    backbone = torch.nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        embedded = backbone(features)
        assert embedded.dtype == torch.bfloat16
        out = head(embedded, labels, step=10)
    assert out.loss.dtype == torch.float32
    assert out.logits.dtype == torch.float32
    assert out.logits.shape == (12, 5)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(head.weight.grad).all()
    assert torch.isfinite(backbone.weight.grad).all()


def test_lambda_schedule_can_be_set_to_reach_its_floor_at_a_given_step():
    schedule = LambdaSchedule().reaching_floor_at(48.7)
    assert schedule(0) == pytest.approx(1000.0 / (1.0 + 199.0 / 49.7))  # Caffe iteration 1
    assert schedule.floor_step() == 49
    assert schedule(48) > 5.0
    assert schedule(49) == 5.0
    with pytest.raises(ValueError):
        LambdaSchedule().reaching_floor_at(0)


def test_classifier_rows_start_near_unit_norm_as_caffe_xavier_gives() -> None:
    # Caffe's xavier filler on a (10572, 512) blob: U(+-sqrt(3/512)), rows of norm ~1.0; PyTorch's
    # xavier_uniform_ would give ~0.30 and an angular learning rate ~11x the authors'.
    head = ASoftmaxHead(512, 10572, m=4)
    norms = head.weight.detach().norm(dim=1)
    assert norms.mean().item() == pytest.approx(1.0, abs=0.02)
    bound = (3.0 / 512) ** 0.5
    assert head.weight.abs().max().item() <= bound * (1 + 1e-6)
    assert head.weight.abs().max().item() > 0.99 * bound


def test_renormalise_puts_every_classifier_row_back_on_the_unit_sphere() -> None:
    head = ASoftmaxHead(16, 7, m=4)
    with torch.no_grad():
        head.weight.mul_(torch.linspace(0.1, 3.0, 7).unsqueeze(1))
    direction = F.normalize(head.weight.detach().clone(), dim=1)
    features, labels = torch.randn(5, 16), torch.randint(0, 7, (5,))
    before = head(features, labels, step=3).loss
    head.renormalise_()
    assert torch.allclose(head.weight.norm(dim=1), torch.ones(7), atol=1e-6)
    assert torch.allclose(head.weight, direction, atol=1e-6)  # directions unchanged
    assert torch.allclose(head(features, labels, step=3).loss, before, atol=1e-6)  # same loss
