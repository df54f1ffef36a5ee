r"""A density channel: the unnormalised, cutoff-weighted neighbour sum that attention normalises away."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_dtype, check_edge_index, check_edge_vec, check_features
from .._irreps import IrrepsLike, as_irreps
from ..edge_geometry import SCALARS, Geometry, edge_geometry
from ..linear import IrrepsLinear
from ..radial import RadialEmbedding, RadialMLP, cutoff_weight
from ..scatter import scatter_sum

__all__ = ["NeighbourDensity"]


class NeighbourDensity(torch.nn.Module):
    r"""Learned, species-aware neighbour densities: invariant sums over the edges, not normalised by their number.

    For every edge :math:`e = (j \to i)` with length :math:`r_e` and every channel :math:`k`:

    .. math::

        s_j &= W_s\, f_j^{(0e)} \\
        \rho_{i,k} &= \frac{1}{\nu} \sum_{e = (j \to i)} c(r_e)\, R_k(r_e)\, s_{j,k}

    :math:`f^{(0e)}` are the even scalars of the node features and :math:`W_s` an
    :class:`~e3attn.linear.IrrepsLinear` to ``num_channels`` scalars, :math:`R` a
    :class:`~e3attn.radial.RadialMLP` of the :class:`~e3attn.radial.RadialEmbedding` of
    :math:`r_e`, :math:`c` the :func:`~e3attn.radial.cutoff_weight` and :math:`\nu`
    ``avg_num_neighbors``. This is the embedded-atom density of EAM/EMT potentials,
    learned: unlike the attention weights :math:`\alpha` (which sum to one over the
    neighbours whatever their number), :math:`\rho` grows with the number of neighbours.

    Every term is invariant (lengths and scalars), so :math:`\rho` is O(3)-invariant;
    :math:`c`, the embedding and hence every edge's contribution vanish smoothly at the
    cutoff, so :math:`\rho` is smooth as neighbours cross it.

    Args:
        irreps_in: irreps of the node features :math:`f` (must hold even scalars).
        num_channels: number of densities :math:`K`.
        max_radius: cutoff radius.
        number_of_basis: size of the radial embedding.
        radial_neurons: hidden size of the radial MLP.
        basis: radial basis, see :class:`~e3attn.radial.RadialEmbedding`.
        avg_num_neighbors: :math:`\nu`, the sums' normalisation.

    Shapes:
        ``f [N, irreps_in.dim]``, ``edge_index [2, E]``, ``edge_vec [E, 3]`` to ``[N, num_channels]``.

    Example::

        >>> density = NeighbourDensity("4x0e + 2x1o", 8, max_radius=2.0)
        >>> pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.5, 0.0]])
        >>> edge_index = torch.tensor([[1, 2, 0, 0], [0, 0, 1, 2]])
        >>> rho = density(torch.randn(3, 10), edge_index, pos[edge_index[0]] - pos[edge_index[1]])
        >>> rho.shape
        torch.Size([3, 8])
    """

    def __init__(
        self,
        irreps_in: IrrepsLike,
        num_channels: int,
        max_radius: float,
        *,
        number_of_basis: int = 10,
        radial_neurons: int = 16,
        basis: str = "smooth_finite",
        avg_num_neighbors: float = 1.0,
    ) -> None:
        super().__init__()
        self.irreps_in = as_irreps(irreps_in, "irreps_in")
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"num_channels must be a positive int, got {num_channels!r}")
        if self.irreps_in.count("0e") == 0:
            raise ValueError(f"irreps_in must hold even scalars (0e) to weight the neighbours, got {self.irreps_in}")
        if not (isinstance(avg_num_neighbors, (int, float)) and avg_num_neighbors > 0):
            raise ValueError(f"avg_num_neighbors must be a positive number, got {avg_num_neighbors!r}")
        self.num_channels = num_channels
        self.avg_num_neighbors = float(avg_num_neighbors)
        self.embedding = RadialEmbedding(number_of_basis, max_radius, basis)
        self.max_radius = self.embedding.max_radius
        self.radial = RadialMLP(number_of_basis, radial_neurons, [num_channels])
        self.source = IrrepsLinear(self.irreps_in, f"{num_channels}x0e")
        self._input = (self.irreps_in.dim, str(self.irreps_in))  # plain values for forward (torch.compile)

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.num_channels}x0e, avg_num_neighbors={self.avg_num_neighbors}"

    def forward(self, f: torch.Tensor, edge_index: torch.Tensor, edge_vec: torch.Tensor,
                geometry: Optional[Geometry] = None) -> torch.Tensor:
        """The densities ``[N, num_channels]``; ``geometry``: the module's :func:`~e3attn.edge_geometry.edge_geometry`
        ``(Y, p, r)`` of the edges, computed beforehand (:func:`~e3attn.edge_geometry.shared_edge_geometry`; ``Y`` is
        not used), instead of from ``edge_vec``."""
        num_nodes = f.shape[0] if isinstance(f, torch.Tensor) else 0
        check_features(f, self._input[0], num_nodes, "f", self._input[1])
        check_edge_index(edge_index, num_nodes)
        src, dst = edge_index[0].long(), edge_index[1].long()
        check_edge_vec(edge_vec, src.shape[0])
        check_dtype(edge_vec, "edge_vec", self.radial.weight1.dtype, "the module")
        if geometry is None:
            geometry = edge_geometry(edge_vec, self.radial.input_layer(), SCALARS, self.embedding, self._plain_geometry)
        else:  # computed elsewhere: it must fit (what the module computes itself does)
            width = self.radial.weight1.shape[1]
            if geometry[1].shape != (src.shape[0], width) or geometry[2].shape != (src.shape[0],):
                raise ValueError(f"geometry must hold p [{src.shape[0]}, {width}] and r [{src.shape[0]}] for the "
                                 f"edges, got {list(geometry[1].shape)} and {list(geometry[2].shape)}")
        _, pre, r = geometry
        radial = self.radial.activate(pre)[0] @ self.radial.output_layers()[0]
        weight = radial * (cutoff_weight(r, self.max_radius) / self.avg_num_neighbors)[:, None]
        return scatter_sum(weight * self.source(f).index_select(0, src), dst, num_nodes)

    def _plain_geometry(self, edge_vec: torch.Tensor, first_layer: torch.Tensor):
        """What :func:`~e3attn.edge_geometry.edge_geometry` computes, in PyTorch operations: the (constant, unused)
        harmonic of degree 0, the radial network's first layer ``embedding(r) @ first_layer`` and the lengths."""
        r = edge_vec.norm(dim=-1)
        return edge_vec.new_ones(edge_vec.shape[0], 1), self.embedding(r) @ first_layer, r

