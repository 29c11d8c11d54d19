"""SphereFace-4/10/20/36/64 definitions (paper Table 2.7) and the network registry."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402  (needs torch)

from models.nets import NETWORKS, build_network  # noqa: E402
from models.nets.mobilefacenet import MobileFaceNet  # noqa: E402
from models.nets.sphereface import SPHEREFACE_UNITS, ResidualUnit, SphereFaceNet  # noqa: E402

DEPTHS = (4, 10, 20, 36, 64)

#: Conv weight counts derived from Table 2.7 (3x3 kernels, biases and PReLU slopes left out).
PAPER_CONV_WEIGHTS = {4: 1.55e6, 10: 4.20e6, 20: 11.65e6, 36: 21.75e6, 64: 37.16e6}
FC1_WEIGHTS = 512 * 7 * 6 * 512  # 11,010,048


@pytest.fixture(scope="module")
def nets() -> dict[int, SphereFaceNet]:
    torch.manual_seed(0)
    return {depth: SphereFaceNet(depth).eval() for depth in DEPTHS}


def _convs(net: nn.Module) -> list[nn.Conv2d]:
    return [m for m in net.modules() if isinstance(m, nn.Conv2d)]


def _input(batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (batch, 3, 112, 96), generator=generator).float()
    return (pixels - 127.5) / 128


@pytest.mark.parametrize("depth", DEPTHS)
def test_forward_maps_112x96_faces_to_512_features(nets: dict[int, SphereFaceNet], depth: int) -> None:
    batch = 1 if depth == 64 else 2
    with torch.no_grad():
        out = nets[depth](_input(batch))
    assert out.shape == (batch, 512)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("depth", DEPTHS)
def test_conv_layer_count_equals_depth(nets: dict[int, SphereFaceNet], depth: int) -> None:
    assert len(_convs(nets[depth])) == depth
    assert nets[depth].depth == depth
    assert 4 + 2 * sum(SPHEREFACE_UNITS[depth]) == depth


@pytest.mark.parametrize("depth", DEPTHS)
def test_has_no_batchnorm(nets: dict[int, SphereFaceNet], depth: int) -> None:
    norms = [m for m in nets[depth].modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms == []


@pytest.mark.parametrize("depth", DEPTHS)
def test_every_conv_is_followed_by_a_per_channel_prelu(nets: dict[int, SphereFaceNet], depth: int) -> None:
    modules = [m for m in nets[depth].modules() if isinstance(m, (nn.Conv2d, nn.PReLU))]
    prelus = [m for m in modules if isinstance(m, nn.PReLU)]
    assert len(prelus) == len(_convs(nets[depth]))
    # Registration order is call order here: conv, PReLU, conv, PReLU, ...
    for conv, prelu in zip(modules[::2], modules[1::2], strict=True):
        assert isinstance(conv, nn.Conv2d)
        assert isinstance(prelu, nn.PReLU)
        assert prelu.num_parameters == conv.out_channels
        assert torch.allclose(prelu.weight, torch.full_like(prelu.weight, 0.25))


def test_fc1_is_the_last_layer_with_no_activation_after_it(nets: dict[int, SphereFaceNet]) -> None:
    net = nets[20]
    x = _input(2)
    called: list[nn.Module] = []
    leaves = [m for m in net.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(lambda m, i, o: called.append(m)) for m in leaves]
    try:
        with torch.no_grad():
            out = net(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert called[-1] is net.fc1
    with torch.no_grad():
        assert torch.equal(out, net.fc1(torch.flatten(net.stages(x), 1)))
    assert (out < 0).any()


def test_stage_output_is_512x7x6(nets: dict[int, SphereFaceNet]) -> None:
    with torch.no_grad():
        feature_map = nets[10].stages(_input(2))
    assert feature_map.shape == (2, 512, 7, 6)
    assert nets[10].fc1.in_features == 21504


@pytest.mark.parametrize("depth", DEPTHS)
def test_conv_weight_counts_match_the_paper(nets: dict[int, SphereFaceNet], depth: int) -> None:
    conv_weights = sum(conv.weight.numel() for conv in _convs(nets[depth]))
    assert conv_weights == pytest.approx(PAPER_CONV_WEIGHTS[depth], rel=0.01)
    assert nets[depth].fc1.weight.numel() == FC1_WEIGHTS


def test_residual_convs_are_bias_free_gaussian_0_01(nets: dict[int, SphereFaceNet]) -> None:
    units = [m for m in nets[20].modules() if isinstance(m, ResidualUnit)]
    assert len(units) == sum(SPHEREFACE_UNITS[20])
    for unit in units:
        for conv in (unit.conv1, unit.conv2):
            assert conv.bias is None
            assert conv.weight.std().item() == pytest.approx(0.01, rel=0.1)
            assert abs(conv.weight.mean().item()) < 0.001


def _assert_caffe_xavier(weight: torch.Tensor) -> None:
    """Caffe's xavier filler: U(±sqrt(3 / fan_in)), i.e. variance 1 / fan_in (not PyTorch's bound)."""
    fan_in = weight[0].numel()
    bound = (3.0 / fan_in) ** 0.5
    assert weight.abs().max().item() <= bound * (1 + 1e-6)  # float32 rounding
    assert weight.abs().max().item() > 0.95 * bound
    assert weight.var().item() == pytest.approx(1.0 / fan_in, rel=0.1)


def test_stage_opening_convs_have_zero_bias_and_caffe_xavier_weights(nets: dict[int, SphereFaceNet]) -> None:
    for stage in nets[20].stages:
        conv = stage.conv
        assert conv.stride == (2, 2)
        assert conv.bias is not None and torch.equal(conv.bias, torch.zeros_like(conv.bias))
        _assert_caffe_xavier(conv.weight)


def test_fc1_has_caffe_xavier_weights_and_zero_bias(nets: dict[int, SphereFaceNet]) -> None:
    fc1 = nets[4].fc1
    _assert_caffe_xavier(fc1.weight)
    assert torch.equal(fc1.bias, torch.zeros_like(fc1.bias))


def test_embedding_size_is_configurable() -> None:
    net = SphereFaceNet(4, embedding_size=128)
    assert net.embedding_size == 128
    assert net.input_size == (112, 96)
    with torch.no_grad():
        assert net(_input(1)).shape == (1, 128)


def test_unsupported_depth_raises_value_error_naming_allowed_depths() -> None:
    with pytest.raises(ValueError, match="4, 10, 20, 36, 64"):
        SphereFaceNet(depth=5)


@pytest.mark.parametrize("depth", (4, 20))
def test_build_network_returns_sphereface_nets(depth: int) -> None:
    net = build_network(f"sphereface{depth}")
    assert isinstance(net, SphereFaceNet)
    assert (net.depth, net.embedding_size) == (depth, 512)
    assert build_network(f"sphereface{depth}", embedding_size=256).embedding_size == 256


def test_build_network_returns_mobilefacenet_with_128_features_by_default() -> None:
    net = build_network("mobilefacenet")
    assert isinstance(net, MobileFaceNet)
    assert net.embedding_size == 128
    assert build_network("mobilefacenet", embedding_size=64).embedding_size == 64


def test_registry_lists_every_sphereface_depth_and_mobilefacenet() -> None:
    assert NETWORKS == tuple(f"sphereface{d}" for d in DEPTHS) + ("mobilefacenet",)


def test_build_network_rejects_unknown_names_listing_networks() -> None:
    with pytest.raises(ValueError, match="sphereface20.*mobilefacenet"):
        build_network("resnet50")
    with pytest.raises(ValueError):
        build_network("sphereface5")
