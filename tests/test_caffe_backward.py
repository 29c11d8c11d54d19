"""``head_options.backward = "caffe"``: the A-Softmax backward of the authors' released Caffe layer.

The reference below re-implements that layer (``MarginInnerProductLayer`` of the SphereFace
repository's Caffe, types SINGLE/DOUBLE/TRIPLE/QUADRUPLE) in numpy, one sample and one class at a
time as its ``Forward_cpu`` / ``Backward_cpu`` loops do: sign blobs, the per-margin polynomials,
the normalised target coefficients and the plain inner-product weight gradient. The head with
``backward="caffe"`` must give the same logits and the same gradients on the features and the
classifier rows; the autograd head must give the same loss and a different feature gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from training.losses import ASoftmaxHead, SphereFacePlusHead, build_head, psi, psi_slope  # noqa: E402

MARGINS = (1, 2, 3, 4)
LAMBDA = 5.0
NORM = 20.0


# ----------------------------------------------------------------------------------------------
# The Caffe layer, literally (numpy, float64, loops over samples i and classes j)
# ----------------------------------------------------------------------------------------------


def _caffe_sign(v: float) -> float:
    """caffe_cpu_sign: (0 < v) - (v < 0)."""
    return float(v > 0) - float(v < 0)


def _caffe_target(m: int, c: float) -> tuple[float, float, float]:
    """(psi(c) as the layer's forward writes it, coeff_w, coeff_x * |x|) before normalisation."""
    sign_0 = _caffe_sign(c)
    if m == 2:
        value = 2.0 * sign_0 * c**2 - 1.0
        return value, 4.0 * sign_0 * c, -(2.0 * sign_0 * c**2 + 1.0)
    if m == 3:
        sign_1 = _caffe_sign(abs(c) - 0.5)
        sign_2 = sign_0 * (1.0 + sign_1) - 2.0
        value = sign_1 * (4.0 * c**3 - 3.0 * c) + sign_2
        return value, sign_1 * (12.0 * c**2 - 3.0), -(8.0 * sign_1 * c**3 - sign_2)
    sign_3 = sign_0 * _caffe_sign(2.0 * c**2 - 1.0)
    sign_4 = 2.0 * sign_0 + sign_3 - 3.0
    value = sign_3 * (8.0 * c**4 - 8.0 * c**2 + 1.0) + sign_4
    coeff_w = sign_3 * (32.0 * c**3 - 16.0 * c)
    coeff_x = -(sign_3 * (24.0 * c**4 - 8.0 * c**2 - 1.0) - sign_4)
    return value, coeff_w, coeff_x


def caffe_forward(x: np.ndarray, w: np.ndarray, labels: np.ndarray, lam: float, m: int) -> np.ndarray:
    """Top (M, N) of the layer for bottom ``x`` (M, K), unit rows ``w`` (N, K), at lambda ``lam``."""
    top = x @ w.T
    if m == 1:
        return top
    for i in range(x.shape[0]):
        x_norm = math.sqrt(float(x[i] @ x[i]))
        y = int(labels[i])
        c = float(x[i] @ w[y]) / x_norm
        top[i, y] = x_norm * _caffe_target(m, c)[0]
    top += lam * (x @ w.T)
    return top / (1.0 + lam)


def caffe_backward(
    top_diff: np.ndarray, x: np.ndarray, w: np.ndarray, labels: np.ndarray, lam: float, m: int
) -> tuple[np.ndarray, np.ndarray]:
    """(bottom_diff (M, K), weight_diff (N, K)) of the layer for ``top_diff`` (M, N)."""
    weight_diff = top_diff.T @ x
    if m == 1:
        return top_diff @ w, weight_diff
    bottom_diff = np.zeros_like(x)
    for i in range(x.shape[0]):
        x_norm = math.sqrt(float(x[i] @ x[i]))
        y = int(labels[i])
        for j in range(w.shape[0]):
            if j != y:
                bottom_diff[i] += top_diff[i, j] / (1.0 + lam) * w[j]
                continue
            c = float(x[i] @ w[j]) / x_norm
            _, coeff_w, coeff_x = _caffe_target(m, c)
            coeff_x = coeff_x / x_norm
            coeff_norm = math.sqrt(coeff_w * coeff_w + coeff_x * coeff_x)
            bottom_diff[i] += top_diff[i, j] / (1.0 + lam) * (coeff_w / coeff_norm) * w[j]
            bottom_diff[i] += top_diff[i, j] / (1.0 + lam) * (coeff_x / coeff_norm) * x[i]
    bottom_diff += lam / (1.0 + lam) * (top_diff @ w)
    return bottom_diff, weight_diff


def _softmax_loss_diff(top: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """SoftmaxWithLoss's bottom diff (normalised by the batch): (softmax - one-hot) / M."""
    shifted = np.exp(top - top.max(axis=1, keepdims=True))
    prob = shifted / shifted.sum(axis=1, keepdims=True)
    prob[np.arange(len(labels)), labels] -= 1.0
    return prob / len(labels)


# ----------------------------------------------------------------------------------------------
# Synthetic features: lambda = 5, ||x|| = 20, angle to the own class 20-60 degrees
# ----------------------------------------------------------------------------------------------


def synthetic_batch(
    n: int = 32, dim: int = 16, classes: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features (n, dim) of norm 20 at 20-60 degrees from their class row, unit rows (classes, dim),
    labels (n,)), float64."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.functional.normalize(torch.randn(classes, dim, generator=g, dtype=torch.float64), dim=1)
    labels = torch.randint(0, classes, (n,), generator=g)
    own = weight[labels]
    other = torch.randn(n, dim, generator=g, dtype=torch.float64)
    other = torch.nn.functional.normalize(other - (other * own).sum(1, keepdim=True) * own, dim=1)
    theta = torch.deg2rad(20.0 + 40.0 * torch.rand(n, 1, generator=g, dtype=torch.float64))
    features = NORM * (torch.cos(theta) * own + torch.sin(theta) * other)
    return features, weight, labels


def _head(m: int, backward: str, weight: torch.Tensor) -> ASoftmaxHead:
    head = ASoftmaxHead(weight.shape[1], weight.shape[0], m=m, lambda_schedule=LAMBDA, backward=backward)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def _head_gradients(m: int, backward: str, features, weight, labels):
    head = _head(m, backward, weight)
    x = features.clone().float().requires_grad_(True)
    out = head(x, labels)
    out.loss.backward()
    return out, x.grad.double(), head.weight.grad.double()


@pytest.mark.parametrize("m", MARGINS)
def test_caffe_backward_equals_the_released_layers_formulas(m: int) -> None:
    features, weight, labels = synthetic_batch()
    x, w, y = features.numpy(), weight.numpy(), labels.numpy()
    top = caffe_forward(x, w, y, LAMBDA, m)
    bottom_diff, weight_diff = caffe_backward(_softmax_loss_diff(top, y), x, w, y, LAMBDA, m)

    out, grad_x, grad_w = _head_gradients(m, "caffe", features, weight, labels)
    logits = _head(m, "caffe", weight).margin_logits(features.float(), labels)
    np.testing.assert_allclose(logits.detach().double().numpy(), top, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(grad_x.numpy(), bottom_diff, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad_w.numpy(), weight_diff, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m", MARGINS)
def test_caffe_backward_keeps_the_loss_and_prediction_logits(m: int) -> None:
    features, weight, labels = synthetic_batch(seed=1)
    caffe, _, _ = _head_gradients(m, "caffe", features, weight, labels)
    exact, _, _ = _head_gradients(m, "autograd", features, weight, labels)
    assert caffe.loss.item() == pytest.approx(exact.loss.item(), rel=1e-6)
    torch.testing.assert_close(caffe.logits, exact.logits)


def gradient_ratio(m: int, seed: int = 0) -> tuple[float, float]:
    """(||autograd feature gradient|| / ||Caffe feature gradient||, their cosine) over a synthetic batch."""
    features, weight, labels = synthetic_batch(n=256, dim=64, classes=100, seed=seed)
    _, exact, _ = _head_gradients(m, "autograd", features, weight, labels)
    _, caffe, _ = _head_gradients(m, "caffe", features, weight, labels)
    ratio = (exact.norm() / caffe.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(exact.flatten(), caffe.flatten(), dim=0).item()
    return ratio, cosine


def test_m1_caffe_backward_is_the_exact_gradient() -> None:
    ratio, cosine = gradient_ratio(1)
    assert ratio == pytest.approx(1.0, abs=1e-5)
    assert cosine == pytest.approx(1.0, abs=1e-5)


#: (ratio low, ratio high, cosine low, cosine high) of the exact feature gradient against the Caffe
#: layer's over seeds 0-3 (measured: m = 2 1.14-1.15 / 0.996-0.997, m = 3 0.65-0.87 / 0.65-0.87,
#: m = 4 1.23-1.28 / 0.957-0.966; docs/results/loss-comparison.md).
EXPECTED_RATIOS = {2: (1.1, 1.2, 0.99, 1.0), 3: (0.5, 0.95, 0.5, 0.95), 4: (1.2, 1.5, 0.9, 0.98)}


@pytest.mark.parametrize("m", (2, 3, 4))
def test_exact_gradient_against_caffes_on_synthetic_features(m: int) -> None:
    """lambda = 5, ||x|| = 20, theta 20-60 degrees: for m = 4 the exact feature gradient is 1.2-1.5x
    the Caffe layer's at a cosine below 0.98; for m = 3 it is the smaller one (the layer divides by
    ``|psi'|``, which vanishes at theta = 60 degrees)."""
    low, high, cos_low, cos_high = EXPECTED_RATIOS[m]
    for seed in range(4):
        ratio, cosine = gradient_ratio(m, seed)
        assert low < ratio < high
        assert cos_low < cosine <= cos_high


def test_psi_slope_is_the_derivative_of_psi() -> None:
    c = torch.linspace(-0.999, 0.999, 2001, dtype=torch.float64, requires_grad=True)
    for m in MARGINS:
        (expected,) = torch.autograd.grad(psi(c, m).sum(), c)
        torch.testing.assert_close(psi_slope(c, m), expected)


def test_backward_option_reaches_the_heads_and_is_checked() -> None:
    head = build_head("sphereface_plus", 8, 5, m=4, backward="caffe")
    assert isinstance(head, SphereFacePlusHead) and head.backward == "caffe"
    assert build_head("asoftmax", 8, 5).backward == "autograd"
    with pytest.raises(ValueError, match="backward"):
        build_head("asoftmax", 8, 5, backward="cafe")
