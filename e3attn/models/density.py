r"""A density channel: the unnormalised, cutoff-weighted neighbour sum that attention normalises away."""
from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ..kernels import moments
from .._constants import Float64ConstantsModule
from .._checks import check_dtype, check_edge_index, check_edge_vec, check_features, check_int
from .._irreps import IrrepsLike, as_irreps
from .._tracing import sorted_by_destination
from ..edge_geometry import SCALARS, Geometry, edge_geometry
from ..linear import IrrepsLinear
from ..radial import RadialEmbedding, RadialMLP, cutoff_weight
from ..scatter import scatter_sum
from ..spherical_harmonics import SphericalHarmonics, check_degree

__all__ = ["NeighbourDensity"]

ANGULAR_CHANNELS = 16
"""The default number of density channels with angular moments (fewer where there are fewer channels)."""


class NeighbourDensity(Float64ConstantsModule):
    r"""Learned, species-aware neighbour densities: invariant sums over the edges, not normalised by their number,
    and, with ``lmax`` :math:`L > 0`, their angular moments' power spectrum (three-body terms).

    For every edge :math:`e = (j \to i)` with vector :math:`\vec r_e`, length :math:`r_e` and every channel
    :math:`k`:

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

    With ``lmax`` :math:`L \ge 1`, the first :math:`K_a` (``angular_channels``) channels also take the moments of
    degree :math:`1 \le l \le L` of the same sums, with the spherical harmonics :math:`Y^l` of the edges
    (``"component"`` normalisation) and radial functions of their own, and return their power spectrum, the
    rotation-invariant squared norm of every moment over its :math:`2l + 1` components (no square root: smooth
    where a moment vanishes):

    .. math::

        A_{i,k,lm} &= \frac{1}{\nu} \sum_{e = (j \to i)} c(r_e)\, R_{k,l}(r_e)\, s_{j,k}\, Y^l_m(\hat r_e) \\
        P_{i,k,l} &= \frac{1}{2l + 1} \sum_{m=-l}^{l} A_{i,k,lm}^2
            = \frac{1}{\nu^2} \sum_{e, e' \to i} w_{e,k,l}\, w_{e',k,l}\, P_l(\hat r_e \cdot \hat r_{e'})

    (:math:`w_{e,k,l} = c(r_e) R_{k,l}(r_e) s_{j,k}`, :math:`P_l` the Legendre polynomials, by the addition
    theorem): a sum over pairs of neighbours of a function of their bond angle, the three-body descriptor of
    SOAP and of ACE's products, learned per channel. The output is :math:`[\rho_i, P_i]`, ``num_channels +
    angular_channels * lmax`` invariants per node; ``lmax=0`` is the density alone. Their cost grows with
    :math:`K_a`; a few channels carry the angles. On the CPU in eager mode, for edges sorted by destination, the
    moments and all their derivatives are summed at the nodes by one compiled kernel
    (:mod:`e3attn.kernels.moments_ops`); elsewhere by PyTorch operations on the edges' terms
    ``[E, (L + 1)^2 - 1, K_a]``.

    Every term is invariant (lengths, scalars and norms of the moments), so the output is O(3)-invariant;
    :math:`c`, the embedding and hence every edge's contribution vanish smoothly at the cutoff, so it is smooth
    as neighbours cross it.

    Args:
        irreps_in: irreps of the node features :math:`f` (must hold even scalars).
        num_channels: number of densities :math:`K`.
        max_radius: cutoff radius.
        number_of_basis: size of the radial embedding.
        radial_neurons: hidden size of the radial MLP.
        basis: radial basis, see :class:`~e3attn.radial.RadialEmbedding`.
        avg_num_neighbors: :math:`\nu`, the sums' normalisation.
        lmax: largest degree :math:`L` of the angular moments (0: the densities alone).
        angular_channels: channels :math:`K_a \le` ``num_channels`` with angular moments (default
            ``ANGULAR_CHANNELS``, 16, or ``num_channels`` if fewer); only with ``lmax`` :math:`> 0`.

    Shapes:
        ``f [N, irreps_in.dim]``, ``edge_index [2, E]``, ``edge_vec [E, 3]`` to ``[N, num_features]``,
        ``num_features = num_channels + angular_channels * lmax``.

    Example::

        >>> density = NeighbourDensity("4x0e + 2x1o", 8, max_radius=2.0)
        >>> pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.5, 0.0]])
        >>> edge_index = torch.tensor([[1, 2, 0, 0], [0, 0, 1, 2]])
        >>> rho = density(torch.randn(3, 10), edge_index, pos[edge_index[0]] - pos[edge_index[1]])
        >>> rho.shape
        torch.Size([3, 8])
        >>> angular = NeighbourDensity("4x0e + 2x1o", 8, max_radius=2.0, lmax=2, angular_channels=4)
        >>> angular(torch.randn(3, 10), edge_index, pos[edge_index[0]] - pos[edge_index[1]]).shape  # 8 + 4 * 2
        torch.Size([3, 16])
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
        lmax: int = 0,
        angular_channels: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.irreps_in = as_irreps(irreps_in, "irreps_in")
        self.lmax = check_degree(lmax, "lmax")
        if isinstance(num_channels, bool) or not isinstance(num_channels, int) or num_channels < 1:
            raise ValueError(f"num_channels must be a positive int, got {num_channels!r}")
        if self.irreps_in.count("0e") == 0:
            raise ValueError(f"irreps_in must hold even scalars (0e) to weight the neighbours, got {self.irreps_in}")
        if not (isinstance(avg_num_neighbors, (int, float)) and avg_num_neighbors > 0):
            raise ValueError(f"avg_num_neighbors must be a positive number, got {avg_num_neighbors!r}")
        self.num_channels = num_channels
        if angular_channels is not None:
            if check_int(angular_channels, "angular_channels", 1) > num_channels:
                raise ValueError(f"angular_channels must be at most num_channels ({num_channels}), got "
                                 f"{angular_channels}")
            if not self.lmax:
                raise ValueError(f"angular_channels={angular_channels} needs lmax > 0 (the angular moments' degrees)")
        elif self.lmax:
            angular_channels = min(ANGULAR_CHANNELS, num_channels)
        else:
            angular_channels = 0  # no moments
        self.angular_channels = int(angular_channels)
        self.num_features = num_channels + self.angular_channels * self.lmax
        self.avg_num_neighbors = float(avg_num_neighbors)
        self.embedding = RadialEmbedding(number_of_basis, max_radius, basis)
        self.max_radius = self.embedding.max_radius
        self.radial = RadialMLP(number_of_basis, radial_neurons, [self.num_features])
        # the harmonics of degree 1..lmax: a layer with harmonics (shared_edge_geometry computes them once)
        self.sh = SphericalHarmonics(self.lmax) if self.lmax else None
        degrees = [l for l in range(1, self.lmax + 1) for _ in range(2 * l + 1)]
        self.register_buffer("_degree", torch.tensor(degrees, dtype=torch.long) - 1, persistent=False)  # l - 1 of every m
        mean = torch.zeros(len(degrees), self.lmax, dtype=torch.float64)  # the mean over m of each degree l >= 1
        for m, l in enumerate(degrees):
            mean[m, l - 1] = 1.0 / (2 * l + 1)
        self.register_constant("mean", mean)
        # the radial network's columns, reordered so that the angular ones run degree-major ([E, lmax, K_a] rows)
        columns = list(range(num_channels)) + [num_channels + c * self.lmax + l for l in range(self.lmax)
                                               for c in range(self.angular_channels)]
        self.register_buffer("_columns", torch.tensor(columns, dtype=torch.long), persistent=False)
        self.source = IrrepsLinear(self.irreps_in, f"{num_channels}x0e")
        self._input = (self.irreps_in.dim, str(self.irreps_in))  # plain values for forward (torch.compile)

    def extra_repr(self) -> str:
        angular = f", lmax={self.lmax}, angular_channels={self.angular_channels}" if self.lmax else ""
        return f"{self.irreps_in} -> {self.num_features}x0e, avg_num_neighbors={self.avg_num_neighbors}{angular}"

    def forward(self, f: torch.Tensor, edge_index: torch.Tensor, edge_vec: torch.Tensor,
                geometry: Optional[Geometry] = None) -> torch.Tensor:
        """The densities and the power spectrum ``[N, num_features]``; ``geometry``: the module's
        :func:`~e3attn.edge_geometry.edge_geometry` ``(Y, p, r)`` of the edges, computed beforehand
        (:func:`~e3attn.edge_geometry.shared_edge_geometry`; only the harmonics of degree 1 to ``lmax`` of ``Y`` are
        read, none when ``lmax`` is 0), instead of from ``edge_vec``."""
        num_nodes = f.shape[0] if isinstance(f, torch.Tensor) else 0
        check_features(f, self._input[0], num_nodes, "f", self._input[1])
        check_edge_index(edge_index, num_nodes)
        src, dst = edge_index[0].long(), edge_index[1].long()
        check_edge_vec(edge_vec, src.shape[0])
        check_dtype(edge_vec, "edge_vec", self.radial.weight1.dtype, "the module")
        if geometry is None:
            harmonics = SCALARS if self.sh is None else self.sh
            geometry = edge_geometry(edge_vec, self.radial.input_layer(), harmonics, self.embedding, self._plain_geometry)
        else:  # computed elsewhere: it must fit (what the module computes itself does)
            width = self.radial.weight1.shape[1]
            if geometry[1].shape != (src.shape[0], width) or geometry[2].shape != (src.shape[0],):
                raise ValueError(f"geometry must hold p [{src.shape[0]}, {width}] and r [{src.shape[0]}] for the "
                                 f"edges, got {list(geometry[1].shape)} and {list(geometry[2].shape)}")
            components = (self.lmax + 1) ** 2
            if self.lmax and (geometry[0].dim() != 2 or geometry[0].shape[0] != src.shape[0]
                              or geometry[0].shape[1] < components):
                raise ValueError(f"geometry must hold the harmonics Y [{src.shape[0]}, {components}] (degrees 0 to "
                                 f"lmax={self.lmax}) for the edges, got {list(geometry[0].shape)}")
        y, pre, r = geometry
        output = self.radial.output_layers()[0]
        if self.lmax:
            output = output.index_select(1, self._columns)
        radial = self.radial.activate(pre)[0] @ output
        weight = radial * (cutoff_weight(r, self.max_radius) / self.avg_num_neighbors)[:, None]
        source = self.source(f).index_select(0, src)
        k = self.num_channels
        rho = scatter_sum(weight[:, :k] * source, dst, num_nodes)
        if self.lmax == 0:
            return rho
        channels, components = self.angular_channels, self._degree.shape[0]
        a = weight[:, k:].view(-1, self.lmax, channels) * source[:, None, :channels]  # [E, lmax, K_a]
        moments = self._moments(a, y[:, 1 : components + 1], dst, num_nodes)  # [N, (lmax + 1)^2 - 1, K_a]
        power = torch.matmul(self.constant("mean", moments.dtype).T, moments.pow(2))  # [N, lmax, K_a]
        return torch.cat([rho, power.transpose(1, 2).reshape(num_nodes, channels * self.lmax)], dim=1)

    def _moments(self, a: torch.Tensor, y: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> torch.Tensor:
        """The moments :math:`A_{i, lm, k}` ``[N, (lmax + 1)^2 - 1, K_a]`` of ``a [E, lmax, K_a]`` (the edges'
        weights :math:`c R s` per degree and channel) and the harmonics ``y [E, (lmax + 1)^2 - 1]``: on the kernel
        of :mod:`e3attn.kernels.moments_ops` for edges sorted by destination where the layer's kernels run in eager
        mode, else in PyTorch operations."""
        if kernels.fused_enabled(a.device, a.dtype) and kernels.eager_on_cpu(a, y) and sorted_by_destination(dst):
            from ..kernels import moments_ops  # imports numba: only where the kernels run

            rowptr = torch.searchsorted(dst.contiguous(), torch.arange(num_nodes + 1, device=dst.device))
            return moments_ops.angular_moments_csr(a, y, rowptr, self._degree)
        return self._plain_moments(a, y, dst, num_nodes)

    def _plain_moments(self, a: torch.Tensor, y: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> torch.Tensor:
        """:meth:`_moments` in PyTorch operations, on every edge's terms."""
        return moments.contract("g", a, y, None, dst, num_nodes, self._degree)

    def _plain_geometry(self, edge_vec: torch.Tensor, first_layer: torch.Tensor):
        """What :func:`~e3attn.edge_geometry.edge_geometry` computes, in PyTorch operations: the harmonics up to
        ``lmax`` (with ``lmax`` 0 the constant, unused harmonic of degree 0), the radial network's first layer
        ``embedding(r) @ first_layer`` and the lengths."""
        r = edge_vec.norm(dim=-1)
        y = edge_vec.new_ones(edge_vec.shape[0], 1) if self.sh is None else self.sh(edge_vec)
        return y, self.embedding(r) @ first_layer, r

