"""PyTorch network definitions.

Imported only by training, export and import commands: nothing in the serving path (``service/``,
``models.embedder``) may import this package, because it needs torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from models.nets.hyperspherical import HypersphericalSettings
    from models.nets.opt import OPTSettings

#: Names accepted by :func:`build_network`.
NETWORKS: tuple[str, ...] = (
    "sphereface4",
    "sphereface10",
    "sphereface20",
    "sphereface36",
    "sphereface64",
    "mobilefacenet",
)


def build_network(
    name: str,
    embedding_size: int | None = None,
    operator: HypersphericalSettings | None = None,
    opt: OPTSettings | None = None,
) -> torch.nn.Module:
    """A freshly initialised network by name (one of :data:`NETWORKS`).

    ``sphereface<depth>`` -> :class:`~models.nets.sphereface.SphereFaceNet` (default embedding
    size 512); ``mobilefacenet`` -> :class:`~models.nets.mobilefacenet.MobileFaceNet` (default
    128). ``operator``: hyperspherical operators in place of the convolutions (and the fully
    connected layers when it says so), :mod:`models.nets.hyperspherical`. ``opt``: orthogonal
    over-parameterised layers (:mod:`models.nets.opt`). Raises ValueError for an unknown name.
    """
    net = _build_plain_network(name, embedding_size)
    if operator is not None:
        net = operator.apply(net)
    return opt.apply(net) if opt is not None else net


def _build_plain_network(name: str, embedding_size: int | None) -> torch.nn.Module:
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; expected one of: {', '.join(NETWORKS)}")
    # Imported here so that importing this package does not pull in torch or cause cycles.
    if name == "mobilefacenet":
        from models.nets.mobilefacenet import MobileFaceNet

        return MobileFaceNet(embedding_size or 128)
    from models.nets.sphereface import SphereFaceNet

    return SphereFaceNet(int(name.removeprefix("sphereface")), embedding_size or 512)
