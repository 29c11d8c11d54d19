"""SphereNet / DCNet operators, SphereNet's losses, their export and serving, and the CIFAR-10 runs.

Numerics are checked in float64 against independent computations (an explicit unfold of the
patches, the printed Eq. 3.4, finite differences), including angles near 0 and pi and zero patches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.nets.hyperspherical import (
    ANGULAR,
    MAGNITUDES,
    HypersphericalConv2d,
    HypersphericalLinear,
    OperatorSpec,
    angular_activation,
    angular_of_theta,
    enable_weighted_gradients,
    hyperspherical_layers,
    orthogonality_penalty,
    project_weights_,
)
from training.losses import build_head, psi

CONFIGS = Path(__file__).resolve().parent.parent / "training" / "configs"
D64 = torch.float64


def printed_sigmoid(theta: torch.Tensor, k: float) -> torch.Tensor:
    """Eq. 3.4 exactly as printed."""
    a = (1 + math.exp(-math.pi / (2 * k))) / (1 - math.exp(-math.pi / (2 * k)))
    e = torch.exp(theta / k - math.pi / (2 * k))
    return a * (1 - e) / (1 + e)


def unfold_angles(x: torch.Tensor, w: torch.Tensor, stride: int = 1, padding: int = 0) -> torch.Tensor:
    """cos(theta) between every kernel and every patch, by explicit unfolding: (N, O, H', W')."""
    n, _, h, wd = x.shape
    kh = w.shape[2]
    patches = F.unfold(x, kh, padding=padding, stride=stride)  # (N, C*k*k, L)
    kernels = w.flatten(1)  # (O, C*k*k)
    dots = torch.einsum("ok,nkl->nol", kernels, patches)
    norms = kernels.norm(dim=1).view(1, -1, 1) * patches.norm(dim=1, keepdim=True)
    cos = dots / norms
    side = (h + 2 * padding - kh) // stride + 1
    return cos.view(n, -1, side, (wd + 2 * padding - kh) // stride + 1)


# ------------------------------------------------------------------------------------------------
# Angular activations and magnitude functions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "cosine", "sigmoid", "square_cosine"])
def test_every_angular_activation_maps_0_half_pi_pi_to_1_0_minus_1(kind):
    theta = torch.tensor([0.0, math.pi / 2, math.pi], dtype=D64)
    for k in (0.1, 0.3, 0.7):
        torch.testing.assert_close(
            angular_of_theta(theta, kind, k), torch.tensor([1.0, 0.0, -1.0], dtype=D64)
        )


@pytest.mark.parametrize("k", [0.1, 0.3, 0.7, 2.0])
def test_sigmoid_activation_equals_the_printed_eq_3_4(k):
    theta = torch.linspace(0, math.pi, 1001, dtype=D64)
    torch.testing.assert_close(angular_of_theta(theta, "sigmoid", k), printed_sigmoid(theta, k))


def test_sigmoid_tends_to_a_step_as_k_falls_and_to_linear_as_k_grows():
    theta = torch.linspace(0, math.pi, 1001, dtype=D64)
    step = torch.sign(math.pi / 2 - theta)
    away = (theta - math.pi / 2).abs() > 0.1
    assert (angular_of_theta(theta, "sigmoid", 0.01)[away] - step[away]).abs().max() < 1e-3
    assert (angular_of_theta(theta, "sigmoid", 100.0) - angular_of_theta(theta, "linear")).abs().max() < 1e-3


@pytest.mark.parametrize("kind", ANGULAR)
def test_activations_from_cosine_stay_in_minus_1_1_and_decrease(kind):
    cos = torch.linspace(-1, 1, 2001, dtype=D64)
    g = angular_activation(cos, kind, 0.3)
    assert g.min() >= -1 - 1e-9 and g.max() <= 1 + 1e-9
    assert (torch.diff(g) >= 0).all()  # increasing in cos = decreasing in theta


def test_magnitude_functions_follow_eq_4_4_to_4_10():
    x = torch.randn(4, 6, 5, 5, dtype=D64) * 3
    norms = {}
    for kind in MAGNITUDES:
        layer = (
            HypersphericalConv2d(6, 2, 3, spec=OperatorSpec(magnitude=kind, angular="cosine")).double().eval()
        )
        if layer.rho is not None:
            layer.running_norm.fill_(2.0)  # rho * E{||x||} = 1 * 2
        cos = unfold_angles(x, layer.weight.detach())
        norm = layer.patch_norm(x)
        norms[kind] = (layer(x) / cos, norm)
    r = 2.0
    for kind, expected in {
        "sphere": lambda n: torch.ones_like(n),
        "ball": lambda n: torch.minimum(n, torch.tensor(r, dtype=D64)) / r,
        "tanh": lambda n: torch.tanh(n / r),
        "linear": lambda n: n,
        "seg": lambda n: torch.where(n <= r, n, 0.5 * n + r - 0.5 * r),
        "log": lambda n: torch.log1p(n),
        "mix": lambda n: n + torch.log1p(n),
    }.items():
        h, n = norms[kind]
        torch.testing.assert_close(h, expected(n).expand_as(h), msg=kind)


def test_operator_radius_tracks_the_mean_patch_norm_in_training_and_freezes_in_eval():
    layer = HypersphericalConv2d(3, 4, 3, spec=OperatorSpec(magnitude="tanh", momentum=0.5))
    x = torch.randn(8, 3, 9, 9) * 5
    layer(x)
    first = float(layer.running_norm)
    assert first == pytest.approx(float(layer.patch_norm(x).mean()), rel=1e-5)
    layer(2 * x)
    assert float(layer.running_norm) == pytest.approx(1.5 * first, rel=1e-5)  # lerp by 0.5 towards 2x
    layer.eval()
    layer(10 * x)
    assert float(layer.running_norm) == pytest.approx(1.5 * first, rel=1e-5)
    assert layer.rho.shape == (4,) and torch.equal(layer.rho, torch.ones(4))


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0)])
def test_sphereconv_is_g_of_the_angle_between_each_kernel_and_patch(stride, padding):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 9, 9, dtype=D64)
    for kind in ANGULAR:
        layer = HypersphericalConv2d(
            5, 7, 3, stride, padding, spec=OperatorSpec(angular=kind, k=0.3)
        ).double()
        cos = unfold_angles(x, layer.weight.detach(), stride, padding)
        if padding:  # interior positions only: border patches carry padding zeros either way
            cos, out = cos[..., 1:-1, 1:-1], layer(x)[..., 1:-1, 1:-1]
        else:
            out = layer(x)
        torch.testing.assert_close(out, angular_activation(cos, kind, 0.3), msg=kind)


def test_grouped_and_depthwise_sphereconv_take_each_patch_norm_over_its_group():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 7, 7, dtype=D64)
    layer = HypersphericalConv2d(6, 6, 3, groups=6, spec=OperatorSpec(angular="cosine")).double()
    for channel in range(6):
        expected = unfold_angles(x[:, channel : channel + 1], layer.weight.detach()[channel : channel + 1])
        torch.testing.assert_close(layer(x)[:, channel : channel + 1], expected)


def test_sphereconv_output_is_invariant_to_rescaling_w_and_x_lemma_2():
    torch.manual_seed(0)
    layer = HypersphericalConv2d(4, 6, 3, spec=OperatorSpec(angular="sigmoid")).double()
    x = torch.randn(3, 4, 8, 8, dtype=D64)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(37.0)
    torch.testing.assert_close(layer(x / 11.0), before)


def test_linear_layer_is_the_fully_connected_special_case():
    torch.manual_seed(0)
    x = torch.randn(5, 12, dtype=D64)
    layer = HypersphericalLinear(12, 4, OperatorSpec(angular="linear")).double()
    cos = F.normalize(x, dim=1) @ F.normalize(layer.weight.detach(), dim=1).t()
    torch.testing.assert_close(layer(x), 1 - 2 * torch.acos(cos) / math.pi)


@pytest.mark.parametrize("kind", ANGULAR)
@pytest.mark.parametrize("magnitude", ["sphere", "tanh", "seg", "mix"])
def test_gradients_match_finite_differences_in_float64(kind, magnitude):
    torch.manual_seed(1)
    spec = OperatorSpec(magnitude=magnitude, angular=kind, learnable_k=kind == "sigmoid")
    layer = HypersphericalConv2d(3, 4, 3, padding=1, spec=spec).double().eval()
    if layer.rho is not None:
        layer.running_norm.fill_(1.7)
    x = torch.randn(2, 3, 5, 5, dtype=D64, requires_grad=True)
    params = [p for p in layer.parameters()]
    assert torch.autograd.gradcheck(lambda x, *p: layer(x), (x, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("theta", [1e-3, 0.05, math.pi - 0.05, math.pi - 1e-3])
@pytest.mark.parametrize("kind", ["linear", "sigmoid"])
def test_gradients_near_theta_0_and_pi_match_finite_differences(theta, kind):
    """Near 0 and pi, d arccos / dc is huge; the gradient with respect to x must still be right."""
    layer = HypersphericalLinear(3, 1, OperatorSpec(angular=kind, k=0.3)).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0.0, 0.0]]))
    x = torch.tensor([[2 * math.cos(theta), 2 * math.sin(theta), 0.0]], dtype=D64, requires_grad=True)
    assert float(torch.acos(F.cosine_similarity(x.detach(), layer.weight.detach()))) == pytest.approx(
        theta, rel=1e-6
    )
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-6, rtol=1e-3)
    # d g / d theta is the printed one: a = -2/pi for linear (Eq. 5-6); |d theta / dx| = 1 / ||x||.
    (grad,) = torch.autograd.grad(layer(x).sum(), x)
    if kind == "linear":
        assert float(grad.norm()) == pytest.approx((2 / math.pi) / 2.0, rel=1e-5)


@pytest.mark.parametrize("kind", ANGULAR)
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_zero_patches_give_finite_outputs_and_gradients(kind, magnitude):
    layer = HypersphericalConv2d(3, 4, 3, padding=1, spec=OperatorSpec(magnitude=magnitude, angular=kind))
    x = torch.zeros(2, 3, 6, 6)
    x[1, :, 2:4, 2:4] = torch.randn(3, 2, 2)  # one image partly zero, one all zero
    x.requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    assert (
        torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    )
    assert out[0].abs().max() <= 1.0 + 1e-6  # all-zero patches: theta = pi/2


def test_learnable_k_is_one_per_filter_starts_at_0_5_and_learns():
    layer = HypersphericalConv2d(3, 5, 3, spec=OperatorSpec(angular="sigmoid", learnable_k=True))
    assert layer.k.shape == (5,) and torch.equal(layer.k.detach(), torch.full((5,), 0.5))
    layer(torch.randn(2, 3, 6, 6)).square().sum().backward()
    assert (layer.k.grad.abs() > 0).all()
    with torch.no_grad():
        layer.k.fill_(-1.0)  # kept positive: clamped to K_MIN, still a valid activation
    out = layer(torch.randn(2, 3, 6, 6))
    assert torch.isfinite(out).all() and out.abs().max() <= 1.0 + 1e-6


def test_spherenorm_rescaling_is_a_learned_beta_f_plus_gamma_per_channel():
    layer = HypersphericalConv2d(3, 4, 3, spec=OperatorSpec(rescale=True))
    x = torch.randn(2, 3, 6, 6)
    plain = layer(x)
    with torch.no_grad():
        layer.scale.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        layer.shift.fill_(0.5)
    torch.testing.assert_close(layer(x), plain * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1, 1) + 0.5)


def test_bad_operator_options_get_clear_errors():
    with pytest.raises(ValueError, match="unknown operator 'sphere'"):
        OperatorSpec.from_options("sphere")
    with pytest.raises(ValueError, match="unknown operator options"):
        OperatorSpec.from_options("sphereconv", {"curvature": 0.3})
    with pytest.raises(ValueError, match="angular activation"):
        OperatorSpec(angular="tanh")
    with pytest.raises(ValueError, match="positive"):
        OperatorSpec(angular="sigmoid", k=0)


# ------------------------------------------------------------------------------------------------
# Regularisers and optimiser options
# ------------------------------------------------------------------------------------------------


def test_orthogonality_penalty_is_frobenius_of_wtw_minus_identity():
    layer = HypersphericalConv2d(4, 3, 2)  # fan-in 16, 3 kernels
    net = torch.nn.Sequential(layer)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(16, 3))
        layer.weight.copy_(q.t().reshape(3, 4, 2, 2))
    assert float(orthogonality_penalty(net).detach()) < 1e-10
    with torch.no_grad():
        layer.weight.mul_(2.0)  # W^T W = 4 I: ||3 I||_F^2 = 27
    assert float(orthogonality_penalty(net).detach()) == pytest.approx(27.0, rel=1e-5)
    assert float(orthogonality_penalty(net, off_diagonal_only=True).detach()) < 1e-9  # DCNet: norms ignored
    with pytest.raises(ValueError, match="no hyperspherical layers"):
        orthogonality_penalty(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1)))


def test_weight_projection_puts_every_kernel_on_the_unit_sphere():
    net = torch.nn.Sequential(HypersphericalConv2d(3, 6, 3), HypersphericalLinear(5, 2))
    project_weights_(net)
    for layer in hyperspherical_layers(net):
        torch.testing.assert_close(layer.weight.flatten(1).norm(dim=1), torch.ones(layer.weight.shape[0]))


def test_weighted_gradients_do_not_depend_on_the_kernel_norm_eq_4_18():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6, dtype=D64)
    grads = {}
    for weighted in (False, True):
        for scale in (1.0, 10.0):
            layer = HypersphericalConv2d(3, 4, 3, spec=OperatorSpec(angular="linear")).double()
            torch.manual_seed(1)
            with torch.no_grad():
                layer.weight.copy_(torch.randn_like(layer.weight) * scale)
            if weighted:
                enable_weighted_gradients(layer)
            layer(x).square().sum().backward()
            grads[weighted, scale] = layer.weight.grad.clone()
    # An angle-only operator's plain gradient shrinks as 1 / ||w||: 10x the kernels, 1/10 the gradient.
    torch.testing.assert_close(grads[False, 10.0] * 10.0, grads[False, 1.0])
    torch.testing.assert_close(grads[True, 10.0], grads[True, 1.0])


# ------------------------------------------------------------------------------------------------
# Networks, export and serving
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sphereface4", "sphereface20", "mobilefacenet"])
def test_every_convolution_of_a_network_becomes_the_operator_and_fc1_stays(name):
    from models.nets import build_network
    from models.nets.hyperspherical import HypersphericalSettings

    plain = build_network(name)
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in plain.modules())
    net = build_network(name, operator=HypersphericalSettings("sphereconv", {"angular": "sigmoid"}))
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == 0
    assert len(list(hyperspherical_layers(net))) == convs
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())  # SphereFace's fc1
    assert sum(isinstance(m, torch.nn.Linear) for m in net.modules()) == linears == (name != "mobilefacenet")
    net.eval()
    assert net(torch.randn(2, 3, 112, 96)).shape == (2, net.embedding_size)
    with_fc = build_network(name, operator=HypersphericalSettings("tanhconv", {}, include_linear=True))
    assert not any(isinstance(m, torch.nn.Linear) for m in with_fc.modules())


@pytest.mark.parametrize(
    "operator,options",
    [("sphereconv", {"angular": "sigmoid", "learnable_k": True}), ("tanhconv", {"angular": "square_cosine"})],
)
def test_a_hyperspherical_network_exports_to_onnx_with_parity(operator, options, tmp_path):
    import onnx

    from models.nets import build_network
    from models.nets.hyperspherical import HypersphericalSettings
    from models.onnx_export import export_checked

    torch.manual_seed(0)
    net = build_network("sphereface4", operator=HypersphericalSettings(operator, options))
    net.train()
    net(torch.randn(4, 3, 112, 96))  # sets the operator radius's running mean
    net.eval()
    diff = export_checked(net, tmp_path, parity_atol=1e-4)
    assert diff < 1e-4
    ops = {node.op_type for node in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "Conv" in ops and ops <= {
        "Conv", "Mul", "Add", "Sqrt", "Div", "Reciprocal", "Acos", "Tanh", "Clip", "Abs", "Sign", "Sub",
        "Reshape", "Flatten", "Gemm", "MatMul", "Relu", "Max", "Min", "Neg", "PRelu", "ReduceSum", "Pow",
        "Expand", "Constant", "Cast", "Log", "Where", "LessOrEqual", "Less", "Greater", "Concat", "Shape",
        "Slice", "Gather", "Unsqueeze", "Squeeze", "Transpose", "Identity", "BatchNormalization",
    }  # fmt: skip


@pytest.mark.shared_data
def test_a_sphereconv_network_trains_exports_and_is_served(tiny_prepared_two, photos_dir, tmp_path):
    from service.serve_process import Service
    from training.config import load_config
    from training.export import export_checkpoint
    from training.trainer import train

    overrides = [
        f"data={tiny_prepared_two.path}", f"out_dir={tmp_path}", "name=sc", "network=sphereface4",
        "batch_size=8", "log_every=1", "checkpoint_every=10", 'lfw=""', "threads=1", "steps=3",
        "operator=sphereconv", 'operator_options={ angular = "sigmoid", learnable_k = true }',
        "orthogonality_weight=0.01", "weight_projection_every=2",
    ]  # fmt: skip
    result = train(load_config(None, overrides), progress=False)
    state = torch.load(result.run_dir / "checkpoint.pt", weights_only=False)
    assert any(key.endswith(".k") for key in state["net"])
    model_dir = tmp_path / "model"
    manifest, report = export_checkpoint(result.run_dir, model_dir, progress=False)
    assert "sphereconv" in manifest.source and report["onnx_parity_max_abs_diff"] < 1e-3
    service = Service(model_dir, tmp_path / "data")
    try:
        people = photos_dir / "people" / "kit_harington"
        files = {"photo1": (people / "1.jpg").read_bytes(), "photo2": (people / "2.jpg").read_bytes()}
        r = service.client.post("/v1/verify", files=files)
        assert r.status_code == 200, r.text
        body = r.json()
        assert (
            -1.0 <= body["score"] <= 1.0 and body["model_id"].startswith("sc") and body["same_person"] is None
        )
    finally:
        service.stop()


@pytest.fixture(scope="module")
def tiny_prepared_two(tmp_path_factory):
    from tests.conftest import require_shared
    from training.prepare import prepare_dataset

    source = require_shared("celeba_faces")
    out = tmp_path_factory.mktemp("prepared") / "celeba2"
    return prepare_dataset(source, out, limit_identities=2, workers=2, progress=False)


# ------------------------------------------------------------------------------------------------
# SphereNet's losses (SphereNet §3, Eq. 9-11)
# ------------------------------------------------------------------------------------------------


def _features(n: int = 16, d: int = 8, c: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    return torch.randn(n, d) * 4, torch.randint(0, c, (n,))


@pytest.mark.parametrize("g", ["linear", "cosine", "sigmoid"])
def test_w_softmax_logits_are_feature_norm_times_g_of_the_angle(g):
    x, y = _features()
    head = build_head("w_softmax", 8, 5, g=g, k=0.3)
    cos = F.normalize(x, dim=1) @ F.normalize(head.weight.detach(), dim=1).t()
    logits = x.norm(dim=1, keepdim=True) * angular_activation(cos, g, 0.3)
    out = head(x, y)
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, y), atol=1e-5, rtol=1e-5)


def test_cosine_ga_softmax_is_a_softmax_and_m_1_is_w_softmax():
    x, y = _features()
    a = build_head("asoftmax", 8, 5, m=4, lambda_schedule=None)
    ga = build_head("ga_softmax", 8, 5, g="cosine", m=4, lambda_schedule=None)
    ga.load_state_dict(a.state_dict())
    torch.testing.assert_close(ga(x, y).loss, a(x, y).loss)
    w = build_head("w_softmax", 8, 5, g="linear")
    ga1 = build_head("ga_softmax", 8, 5, g="linear", m=1, lambda_schedule=None)
    ga1.load_state_dict(w.state_dict())
    torch.testing.assert_close(ga1(x, y).loss, w(x, y).loss)


@pytest.mark.parametrize("g", ["linear", "sigmoid"])
def test_ga_softmax_target_is_g_of_m_theta_and_others_keep_g_of_theta(g):
    x, y = _features()
    head = build_head("ga_softmax", 8, 5, g=g, m=4, k=0.3, lambda_schedule=None)
    logits = head.margin_logits(x, y)
    cos = F.normalize(x, dim=1) @ F.normalize(head.weight.detach(), dim=1).t()
    theta = torch.acos(cos.clamp(-1, 1))
    norm = x.norm(dim=1, keepdim=True)
    expected = norm * angular_of_theta(theta, g, 0.3)
    expected = expected.scatter(
        1, y.view(-1, 1), norm * angular_of_theta(4 * theta.gather(1, y.view(-1, 1)), g, 0.3)
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # Annealing: lambda = 3 gives (3 g(theta) + g(4 theta)) / 4 on the target only.
    annealed = build_head("ga_softmax", 8, 5, g=g, m=4, k=0.3, lambda_schedule=3.0)
    annealed.load_state_dict(head.state_dict())
    mixed = annealed.margin_logits(x, y)
    plain = norm * angular_of_theta(theta, g, 0.3)
    target = (3 * plain.gather(1, y.view(-1, 1)) + expected.gather(1, y.view(-1, 1))) / 4
    torch.testing.assert_close(mixed, plain.scatter(1, y.view(-1, 1), target), atol=1e-4, rtol=1e-4)


def test_cosine_margin_has_flat_points_at_k_pi_over_m_and_linear_has_none_claim_29():
    m = 4
    theta = torch.tensor([k * math.pi / m for k in range(1, m)], dtype=D64, requires_grad=True)
    (d_psi,) = torch.autograd.grad(psi(torch.cos(theta), m).sum(), theta)
    assert d_psi.abs().max() < 1e-6
    theta = torch.linspace(0.01, math.pi - 0.01, 50, dtype=D64, requires_grad=True)
    (d_lin,) = torch.autograd.grad(angular_of_theta(m * theta, "linear").sum(), theta)
    torch.testing.assert_close(d_lin, torch.full_like(d_lin, -2 * m / math.pi))


def test_s_softmax_normalises_features_and_weights_and_scales_by_s():
    x, y = _features()
    head = build_head("s_softmax", 8, 5, scale=16.0)
    out = head(x, y)
    cos = F.normalize(x, dim=1) @ F.normalize(head.weight.detach(), dim=1).t()
    torch.testing.assert_close(out.logits, 16.0 * cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(x * 100, y).loss, out.loss)  # the feature norm does not matter
    with pytest.raises(ValueError, match="g must be"):
        build_head("s_softmax", 8, 5, g="tanh")


# ------------------------------------------------------------------------------------------------
# Configs and the CIFAR-10 runs
# ------------------------------------------------------------------------------------------------


def test_every_hyperspherical_cifar_config_loads_with_the_operator_it_names():
    from training.cifar import is_cifar_config, load_cifar_config

    paths = sorted((CONFIGS / "hyperspherical" / "cifar").glob("*.toml"))
    assert len(paths) >= 30
    for path in paths:
        assert is_cifar_config(path)
        config = load_cifar_config(path)
        assert config.name in path.stem or path.name == "base.toml"
        if "_conv" in path.stem or "_bn" in path.stem and "spherenorm" not in path.stem:
            assert config.operator == "conv", path


def test_the_periodic_test_check_samples_every_class_evenly():
    from training.cifar import periodic_sample

    labels = np.repeat(np.arange(10), 1000)  # stored class by class, as the archive is
    counts = np.bincount(labels[periodic_sample(10000, 2000).numpy()], minlength=10)
    assert counts.min() > 150 and counts.max() < 250
    assert torch.equal(periodic_sample(10000, 2000), periodic_sample(10000, 2000))  # fixed


def test_cifar_config_errors_are_clear(tmp_path):
    from training.cifar import load_cifar_config
    from training.config import ConfigError

    path = tmp_path / "c.toml"
    path.write_text('task = "cifar10"\nwidth = 3\n')
    with pytest.raises(ConfigError, match="unknown CIFAR config fields \\['width'\\]"):
        load_cifar_config(path)
    path.write_text('task = "cifar10"\noperator = "sphereconv"\noperator_options = { angular = "tan" }\n')
    with pytest.raises(ConfigError, match="angular activation"):
        load_cifar_config(path)


@pytest.mark.shared_data
def test_a_cifar_run_trains_logs_and_scores_the_whole_test_set(tmp_path):
    from tests.conftest import require_shared
    from training.cifar import load_cifar10, load_cifar_config, read_cifar_log, train_cifar

    archive = require_shared("cifar10/cifar10-jpg.tar.gz")
    cache = Path(".cache/data/cifar10.npz")
    data = load_cifar10(archive, cache)
    assert data["train_images"].shape == (50000, 32, 32, 3) and data["test_images"].shape == (
        10000,
        32,
        32,
        3,
    )
    assert np.bincount(data["test_labels"]).tolist() == [1000] * 10
    config = load_cifar_config(
        CONFIGS / "hyperspherical" / "cifar" / "cnn9_sigmoid_gasoftmax.toml",
        [f"out_dir={tmp_path}", "steps=30", "log_every=10", "eval_every=20", "widths=[8, 8, 8]",
         "train_per_class=50", f"archive={archive}", f"cache={cache}", "orthogonality_weight=1e-3",
         "weight_projection_every=10", "weighted_gradients=true"],
    )  # fmt: skip
    summary = train_cifar(config, progress=False)
    cols = read_cifar_log(tmp_path / config.name / "log.csv")
    assert cols["step"].tolist() == [10, 20, 30]
    assert np.isfinite(cols["test_accuracy"][1]) and np.isnan(cols["test_accuracy"][0])
    assert "random" in summary["periodic_eval"]
    assert cols["loss"][-1] < cols["loss"][0]  # it learns something in 30 steps
    assert 0.1 < summary["test_accuracy"] < 1.0 and summary["epochs"] == pytest.approx(30 * 128 / 500)
    assert (
        json.loads((tmp_path / config.name / "summary.json").read_text())["test_accuracy"]
        == summary["test_accuracy"]
    )
    assert (tmp_path / config.name / "curves.png").stat().st_size > 10000
    # the last step (30) projected every kernel back onto the unit sphere
    net = torch.load(tmp_path / config.name / "model.pt", weights_only=False)["net"]
    kernels = [v for k, v in net.items() if k.endswith("weight") and v.dim() in (2, 4) and "features" in k]
    assert len(kernels) == 9
    for kernel in kernels:
        torch.testing.assert_close(kernel.flatten(1).norm(dim=1), torch.ones(kernel.shape[0]))


def test_a_cifar_runs_log_gives_each_steps_own_learning_rate(tmp_path):
    """With the drop after step 1, step 1 ran at lr and step 2 at lr / 10: the log says so (not
    the lr of the step after)."""
    from tests.conftest import require_shared
    from training.cifar import load_cifar_config, read_cifar_log, train_cifar

    archive = require_shared("cifar10/cifar10-jpg.tar.gz")
    config = load_cifar_config(
        CONFIGS / "hyperspherical" / "cifar" / "cnn9_sigmoid_gasoftmax.toml",
        [f"out_dir={tmp_path}", "steps=2", "log_every=1", "eval_every=2", "widths=[8, 8, 8]",
         "train_per_class=10", f"archive={archive}", "cache=.cache/data/cifar10.npz", "lr_drops=[0.5]"],
    )  # fmt: skip
    train_cifar(config, progress=False)
    logged = read_cifar_log(tmp_path / config.name / "log.csv")["lr"].tolist()
    assert logged == pytest.approx([config.lr, config.lr / 10])


def _fake_cifar_run(root: Path, name: str, accuracy: float, seconds: float = 0.1) -> None:
    run = root / name
    run.mkdir(parents=True)
    summary = {"name": name, "test_accuracy": accuracy, "seconds_per_step": seconds, "final_train_loss": 1.0}
    summary["periodic_eval"] = "2000 test images drawn at random (seed 0)"
    (run / "summary.json").write_text(json.dumps({**summary, "config": {}}))
    rows = [
        "step,loss,accuracy,test_accuracy,lr,lambda,elapsed_s",
        "10,2.0,0.2,,0.001,0,1",
        "20,1.5,0.4,0.3,0.001,0,2",
    ]
    (run / "log.csv").write_text("\n".join(rows) + "\n")


def test_the_hyperspherical_table_averages_seeds_and_computes_the_claims(tmp_path):
    from training.hyperspherical_table import main

    cifar = tmp_path / "runs" / "cifar"
    _fake_cifar_run(cifar, "cnn9_conv_wsoftmax", 0.60)
    _fake_cifar_run(cifar, "cnn9_conv_wsoftmax_seed1", 0.62)
    _fake_cifar_run(cifar, "cnn9_conv_gasoftmax", 0.65)
    _fake_cifar_run(cifar, "cnn9_sigmoid_wsoftmax", 0.66, seconds=0.3)
    _fake_cifar_run(cifar, "cnn9_conv_softmax", 0.5)
    _fake_cifar_run(cifar, "norm_b4_spherenorm", 0.4)
    out = tmp_path / "out"
    assert (
        main(["--runs", str(tmp_path / "runs"), "--baselines", str(tmp_path / "none"), "--out", str(out)])
        == 0
    )
    report = json.loads((out / "hyperspherical.json").read_text())
    cell = report["table1"]["cells"]["conv"]["wsoftmax"]
    assert cell["mean"] == pytest.approx(61.0) and cell["values"] == pytest.approx([60.0, 62.0])
    assert report["table1"]["sphereconv_minus_conv"] == {"sigmoid/wsoftmax": pytest.approx(5.0)}
    assert report["table1"]["ga_minus_w_softmax"] == {"conv": pytest.approx(4.0)}
    assert report["table1"]["median_seed_spread"] == pytest.approx(2.0)
    assert report["normalisation"]["b4"]["spherenorm"]["mean"] == pytest.approx(40.0)
    convergence = report["convergence"]["wsoftmax"]["conv"]  # seed 0 only: log rows 10 and 20
    assert convergence["loss"]["0-100"] == pytest.approx(1.75) and convergence["loss"]["100-200"] is None
    assert convergence["test_accuracy"]["100"] is None
    assert set(report["convergence"]["wsoftmax"]) == {"conv", "sigmoid"}
    text = (out / "hyperspherical.md").read_text()
    assert "| cosine W-Softmax | original conv | 1.750 | – | – | – | – | – | – | – |" in text
    assert "| original conv | 50.00 | **61.00** (60.00 / 62.00) | 65.00 | 0.100 |" in text
    assert (out / "hyperspherical_convergence.png").stat().st_size > 10000
    assert main(["--runs", str(tmp_path / "empty"), "--out", str(out)]) == 1


def test_the_face_table_takes_missing_baselines_from_the_committed_loss_table(tmp_path):
    from training.hyperspherical_table import face_rows, faces_markdown

    loss_table = tmp_path / "loss_table.json"
    row = {
        "run": "sf4_asoftmax_m4",
        "seed": 0,
        "lfw_accuracy": 0.85,
        "lfw_std": 0.015,
        "megaface_local_rank1": 0.144,
        "final_train_accuracy": 0.95,
        "final_feature_norm": 24.3,
        "train_images_per_s": 62.5,
    }
    other = {**row, "run": "sf4_softmax", "lfw_accuracy": 0.83}
    loss_table.write_text(json.dumps([row, other]))
    rows = face_rows(tmp_path / "runs", tmp_path / "no_baseline_runs", loss_table)
    assert [r["name"] for r in rows] == ["sf4_asoftmax_m4"]
    assert rows[0]["lr"] == pytest.approx(0.025) and rows[0]["source"] == str(loss_table)
    assert (
        "| ordinary convolutions | 0.025 | 0 | 85.00 ± 1.50 | 14.40 | 95.0 | 24.3 | 62 |"
        in faces_markdown(rows)
    )
    assert face_rows(tmp_path / "runs", tmp_path / "no_baseline_runs", None) == []
    # a run the trainer stopped (feature collapse) is shown from its last log row, without LFW
    stopped = tmp_path / "runs" / "sf4_sphereconv_stalled"
    stopped.mkdir(parents=True)
    (stopped / "config.toml").write_text(
        'name = "sf4_sphereconv_stalled"\nlr = 0.025\noperator = "sphereconv"\n'
        'operator_options = { angular = "cosine" }\n'
    )
    header = "step,epoch,loss,accuracy,lambda,mhe,feature_norm,lr,images_per_s,lfw_accuracy,lfw_std,elapsed_s"
    rows_csv = [
        header,
        "50,0,8.05,0.003,315.9,,0.72,0.025,10.0,,,31",
        "100,0,8.04,0.032,100,,0.00723,0.025,12.0,,,60",
    ]
    (stopped / "log.csv").write_text("\n".join(rows_csv) + "\n")
    rows = face_rows(tmp_path / "runs", tmp_path / "no_baseline_runs", None)
    assert [r["stopped_at"] for r in rows] == [100] and rows[0]["lfw_accuracy"] is None
    assert (
        "| sphereconv (angular = cosine), stopped at step 100 (loss 8.040: the features collapsed) "
        "| 0.025 | 0 | – | – | 3.2 | 0.00723 | 11 |" in faces_markdown(rows)
    )
    # a run still going (or killed) whose features did not collapse is "unfinished", not "collapsed"
    (stopped / "log.csv").write_text("\n".join([header, rows_csv[1], rows_csv[2].replace("0.00723", "0.70")]))
    rows = face_rows(tmp_path / "runs", tmp_path / "no_baseline_runs", None)
    assert rows[0]["collapsed"] is False
    assert "| sphereconv (angular = cosine), unfinished at step 100 | 0.025 |" in faces_markdown(rows)
    # the trainer's stopped.json decides, whatever the last logged row says
    record = {"step": 150, "reason": "FeatureCollapseError", "message": "the features collapsed at step 150"}
    (stopped / "stopped.json").write_text(json.dumps(record))
    rows = face_rows(tmp_path / "runs", tmp_path / "no_baseline_runs", None)
    assert rows[0]["collapsed"] is True and rows[0]["stopped_at"] == 150
    assert rows[0]["stop_message"] == record["message"]
