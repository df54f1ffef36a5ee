r"""A complete equivariant transformer: attention blocks with gates, self-interactions and layer norms."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from e3nn import o3

from .._checks import (check_batch, check_dtype, check_edge_index, check_edge_vec, check_features, check_int, check_pos,
                       values_checked_by_caller)
from .._irreps import IrrepsLike, as_irreps
from .._tracing import traced_graphs
from ..attention import EquivariantAttention
from ..edge_geometry import Geometry, shared_edge_geometry
from ..graph import radius_graph
from ..heads import split_heads
from ..linear import IrrepsLinear
from ..scatter import scatter_sum
from ..spherical_harmonics import check_degree
from .gate import Gate
from .density import ANGULAR_CHANNELS, NeighbourDensity
from .norm import EquivariantLayerNorm

__all__ = ["EquivariantTransformer"]

REDUCTIONS = (None, "sum", "mean")
LAYER_NORMS = ("post", "pre", "none")
SELF_CONNECTIONS = ("identity", "node_attr")
_DATA_KEYS = ("pos", "x", "batch", "edge_index", "edge_vec", "node_attr")


class _Block(torch.nn.Module):
    """Attention (+ density) -> gate -> self-interaction -> residual (or self-connection) -> layer norm, on
    ``irreps`` features; ``irreps_skip``: the node attributes' irreps of a self-connection ``S(h, a)`` instead of the
    residual ``h``."""

    def __init__(
        self,
        irreps: o3.Irreps,
        irreps_key: o3.Irreps,
        max_radius: float,
        *,
        density_channels: int = 0,
        density_lmax: int = 0,
        density_angular_channels: Optional[int] = None,
        avg_num_neighbors: float = 1.0,
        layer_norm: str = "post",
        irreps_skip: Optional[o3.Irreps] = None,
        **attention_kwargs,
    ) -> None:
        super().__init__()
        self.gate = Gate(irreps)
        self.attention = EquivariantAttention(
            irreps, irreps_key, irreps_key, self.gate.irreps_in, max_radius, **attention_kwargs
        )
        self.density = self.density_mix = None
        if density_channels:
            radial = {k: v for k, v in attention_kwargs.items() if k in ("number_of_basis", "radial_neurons", "basis")}
            self.density = NeighbourDensity(
                irreps, density_channels, max_radius, avg_num_neighbors=avg_num_neighbors, lmax=density_lmax,
                angular_channels=density_angular_channels, **radial
            )
            self.density_mix = torch.nn.Sequential(
                torch.nn.Linear(self.density.num_features, density_channels),
                torch.nn.SiLU(),
                IrrepsLinear(f"{density_channels}x0e", self.gate.irreps_in),
            )
        self.self_interaction = IrrepsLinear(irreps, irreps)
        self.skip = None if irreps_skip is None else o3.FullyConnectedTensorProduct(irreps, irreps_skip, irreps)
        self.norm = EquivariantLayerNorm(irreps) if layer_norm != "none" else None
        self.pre_norm = layer_norm == "pre"

    def geometry_layers(self) -> List[torch.nn.Module]:
        """The modules that read the edge geometry, in the order :meth:`forward` takes their ``geometry``."""
        return [self.attention] + ([self.density] if self.density is not None else [])

    def forward(self, h, pos, edge_index, edge_vec, node_attr=None, geometry: Sequence[Optional[Geometry]] = (None, None)):
        x = self.norm(h) if self.pre_norm else h
        update = self.attention(x, pos, edge_index, edge_vec=edge_vec, geometry=geometry[0])
        if self.density is not None:
            update = update + self.density_mix(self.density(x, edge_index, edge_vec, geometry[1]))
        h = (h if self.skip is None else self.skip(h, node_attr)) + self.self_interaction(self.gate(update))
        return self.norm(h) if self.norm is not None and not self.pre_norm else h


class EquivariantTransformer(torch.nn.Module):
    r"""An O(3)-equivariant transformer for point clouds and molecules, built on :class:`~e3attn.EquivariantAttention`.

    With node inputs :math:`x_i` (``irreps_in``) and optional node attributes :math:`a_i`
    (``irreps_node_attr``, e.g. one-hot atom types), concatenated:

    .. math::

        h^{(0)}_i &= W_\mathrm{emb}\,(x_i \oplus a_i) \\
        h^{(t+1)}_i &= \mathrm{LN}\!\left(h^{(t)}_i + W^{(t)}\,
            \mathrm{Gate}\!\left(\mathrm{Attn}^{(t)}(h^{(t)}, \vec x)_i\right)\right), \quad t < T \\
        y_i &= W_\mathrm{out}\, h^{(T)}_i, \qquad
        Y_b = \sum_{i \in b} y_i \ \ (\texttt{reduce="sum"}) \quad\text{or}\quad
              \frac{1}{n_b}\sum_{i \in b} y_i \ \ (\texttt{"mean"})

    :math:`W` are equivariant linear maps (:class:`~e3attn.linear.IrrepsLinear`),
    :math:`\mathrm{Attn}^{(t)}` an :class:`~e3attn.EquivariantAttention` from
    ``irreps_hidden`` to the gate's input (the edges' harmonics and length embeddings computed once for all the
    blocks, :func:`~e3attn.edge_geometry.shared_edge_geometry`), :math:`\mathrm{Gate}` a gated
    nonlinearity (:class:`~e3attn.models.Gate`) and :math:`\mathrm{LN}` an
    :class:`~e3attn.models.EquivariantLayerNorm`. Every layer maps ``irreps_hidden`` to
    itself, so every layer has a residual connection. Odd outputs (e.g. ``0o``) need odd
    irreps in ``irreps_hidden`` (e.g. ``0o`` and ``1e``) to be reachable.

    The attention weights sum to one over the neighbours, and the layer norm rescales every
    node: neither tells a node how many neighbours it has or how close they are in total,
    which is what embedded-atom energies are built from. With ``density_channels`` :math:`K > 0`
    every block adds, next to the attention, :math:`K` learned neighbour densities
    :math:`\rho^{(t)}_i` (:class:`~e3attn.models.NeighbourDensity`, unnormalised cutoff-weighted
    sums over the neighbours; with ``density_lmax`` :math:`> 0` also the power spectrum of their angular moments,
    sums over pairs of neighbours of functions of their bond angles) through a one-hidden-layer MLP into the
    gate's scalar inputs,

    .. math::

        h^{(t+1)}_i = \mathrm{LN}\!\left(h^{(t)}_i + W^{(t)}\,
            \mathrm{Gate}\!\left(\mathrm{Attn}^{(t)}(h^{(t)}, \vec x)_i
            + W_\rho^{(t)}\, \mathrm{silu}\big(A^{(t)} \rho^{(t)}_i + b^{(t)}\big)\right)\right)

    and ``layer_norm`` moves or drops :math:`\mathrm{LN}`. With ``self_connection="node_attr"`` the
    residual :math:`h^{(t)}_i` of every block becomes a self-connection that depends on the node attributes;
    for scalar attributes :math:`a_i` (e.g. one-hot atom types),

    .. math::

        S^{(t)}(h_i, a_i)_{(w, l)} = \sum_{u, v} W^{(t, l)}_{u v w}\, (h_i)_{(u, l)}\, (a_i)_v

    (an e3nn ``FullyConnectedTensorProduct`` :math:`h \otimes a \to h`; with one-hot atom types :math:`a`,
    a learned linear map per element, as the self-connections of NequIP and MACE): the element of an atom then
    shapes every block, not only the embedding. The attention itself is unchanged
    (``sqrt_alpha`` aggregation). The defaults (no density, layer norm, identity residual) are the model of
    e3attn 0.1, so checkpoints written without these options load as they were saved.

    The model skips work that cannot change its output. The first block's input is embedded from ``x`` and
    the node attributes, so it is zero in every irrep of another degree or parity: that block's attention
    takes ``input_support`` = those irreps (and ``0e``), and runs none of the paths from the others (for scalar
    inputs, only the paths from its scalars, and only the keys of degree 0: the query is zero elsewhere). When
    the output is only even scalars (an energy), the last block's attention takes ``output_support="0e"``:
    the layer norm and the gate leave the even scalars independent of every other irrep, so only those values
    are computed and the others are zero (a forward hook on that block sees them zero). The model's outputs and
    all their derivatives are those of the whole computation (tested to rounding); the parameters are the same,
    so checkpoints are unaffected. The supports follow ``irreps_in``, ``irreps_node_attr`` and ``irreps_out`` when
    the model is built: to read other irreps of the last block (a new output head for vectors, say), build the
    model with those ``irreps_out`` and load the weights.

    The graph is built once per call (the radius graph of ``pos`` in each graph of
    ``batch``) unless ``edge_index`` (and for periodic systems ``edge_vec``, see
    :func:`~e3attn.radius_graph_pbc` and :func:`~e3attn.models.edge_vectors`) is given.

    Args:
        irreps_in: irreps of the node inputs ``x``.
        irreps_hidden: irreps of the hidden features; every multiplicity divisible by ``num_heads``.
        irreps_out: irreps of the outputs.
        max_radius: cutoff radius of the attention.
        num_layers: number of attention blocks :math:`T`.
        num_heads: number of attention heads.
        lmax: maximum degree of the spherical harmonics of the edges.
        number_of_basis: size of the radial embedding.
        radial_neurons: hidden size of the radial MLPs.
        irreps_key: irreps of the queries and keys (default ``irreps_hidden``).
        irreps_node_attr: irreps of the optional node attributes (``None``: none).
        reduce: ``None`` (per-node outputs), ``"sum"`` or ``"mean"`` over each graph of ``batch``
            (a graph index without nodes pools to zeros).
        density_channels: neighbour densities :math:`K` per block (0: none, attention only).
        density_lmax: largest degree of the densities' angular moments, whose power spectrum (three-body
            invariants, :class:`~e3attn.models.NeighbourDensity`) joins the densities (0: none; needs
            ``density_channels``).
        density_angular_channels: density channels with angular moments (default ``min(16, density_channels)``,
            16 being ``e3attn.models.density.ANGULAR_CHANNELS``); only with ``density_lmax`` :math:`> 0`.
        avg_num_neighbors: normalisation of the density sums (about the mean number of neighbours).
        basis: radial basis of the edge lengths, see :class:`~e3attn.radial.RadialEmbedding`.
        layer_norm: where the equivariant layer norm goes: ``"post"`` (after every block's residual
            sum, as above), ``"pre"`` (on every block's input, :math:`h^{(t+1)} = h^{(t)} +
            W^{(t)}\,\mathrm{Gate}(\mathrm{Attn}^{(t)}(\mathrm{LN}(h^{(t)})))`: the residual stream, and
            the output, keep their magnitude) or ``"none"``.
        self_connection: ``"identity"`` (the residual :math:`h^{(t)}`) or ``"node_attr"`` (the
            self-connection :math:`S^{(t)}(h^{(t)}, a)` above; needs ``irreps_node_attr``).

    Shapes:
        ``pos [N, 3]``, ``x [N, irreps_in.dim]``, ``node_attr [N, irreps_node_attr.dim]``,
        ``batch [N]``, ``edge_index [2, E]``, ``edge_vec [E, 3]`` to ``[N, irreps_out.dim]``, or
        ``[B, irreps_out.dim]`` with ``B = batch.max() + 1`` when ``reduce`` is set.

    Example::

        >>> model = EquivariantTransformer("1x0e", "8x0e + 2x0o + 2x1o + 2x1e", "1x0e + 1x0o", 1.5, reduce="sum")
        >>> pos, batch = torch.randn(10, 3), torch.tensor([0] * 4 + [1] * 6)
        >>> model(pos, batch=batch).shape
        torch.Size([2, 2])
        >>> model({"pos": pos, "batch": batch}).shape
        torch.Size([2, 2])
    """

    def __init__(
        self,
        irreps_in: IrrepsLike,
        irreps_hidden: IrrepsLike,
        irreps_out: IrrepsLike,
        max_radius: float,
        *,
        num_layers: int = 3,
        num_heads: int = 1,
        lmax: int = 2,
        number_of_basis: int = 10,
        radial_neurons: int = 16,
        irreps_key: Optional[IrrepsLike] = None,
        irreps_node_attr: Optional[IrrepsLike] = None,
        reduce: Optional[str] = None,
        density_channels: int = 0,
        density_lmax: int = 0,
        density_angular_channels: Optional[int] = None,
        avg_num_neighbors: float = 1.0,
        layer_norm: str = "post",
        basis: str = "smooth_finite",
        self_connection: str = "identity",
    ) -> None:
        super().__init__()
        self.irreps_in = as_irreps(irreps_in, "irreps_in")
        self.irreps_hidden = as_irreps(irreps_hidden, "irreps_hidden")
        self.irreps_out = as_irreps(irreps_out, "irreps_out")
        self.irreps_key = self.irreps_hidden if irreps_key is None else as_irreps(irreps_key, "irreps_key")
        self.irreps_node_attr = None if irreps_node_attr is None else as_irreps(irreps_node_attr, "irreps_node_attr")
        # read in forward as plain values (torch.compile cannot guard on e3nn Irreps): (dim, text) of x and node_attr
        self._x = (self.irreps_in.dim, str(self.irreps_in), all(ir == o3.Irrep("0e") for _, ir in self.irreps_in))
        self._attr = None if self.irreps_node_attr is None else (self.irreps_node_attr.dim, str(self.irreps_node_attr))
        num_layers, num_heads = check_int(num_layers, "num_layers", 1), check_int(num_heads, "num_heads", 1)
        lmax, number_of_basis = check_degree(lmax, "lmax"), check_int(number_of_basis, "number_of_basis", 1)
        radial_neurons = check_int(radial_neurons, "radial_neurons", 1)
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        if isinstance(density_channels, bool) or not isinstance(density_channels, int) or density_channels < 0:
            raise ValueError(f"density_channels must be a non-negative int, got {density_channels!r}")
        if not (isinstance(avg_num_neighbors, (int, float)) and avg_num_neighbors > 0):
            raise ValueError(f"avg_num_neighbors must be a positive number, got {avg_num_neighbors!r}")
        density_lmax = check_degree(density_lmax, "density_lmax")
        if density_lmax and not density_channels:
            raise ValueError(f"density_lmax={density_lmax} needs density_channels > 0 (the angular moments are "
                             "those of the density channels)")
        if density_angular_channels is not None:
            if check_int(density_angular_channels, "density_angular_channels", 1) > density_channels:
                raise ValueError(f"density_angular_channels must be at most density_channels ({density_channels}), "
                                 f"got {density_angular_channels}")
            if not density_lmax:
                raise ValueError(f"density_angular_channels={density_angular_channels} needs density_lmax > 0 (the "
                                 "angular moments' degrees)")
        elif density_lmax:  # the default, kept in the config as its value
            density_angular_channels = min(ANGULAR_CHANNELS, density_channels)
        if layer_norm not in LAYER_NORMS:
            raise ValueError(f"layer_norm must be one of {LAYER_NORMS}, got {layer_norm!r}")
        if self_connection not in SELF_CONNECTIONS:
            raise ValueError(f"self_connection must be one of {SELF_CONNECTIONS}, got {self_connection!r}")
        if self_connection == "node_attr" and self.irreps_node_attr is None:
            raise ValueError("self_connection='node_attr' needs irreps_node_attr (the node attributes it depends on)")
        split_heads(self.irreps_hidden, num_heads, "irreps_hidden")
        split_heads(self.irreps_key, num_heads, "irreps_key")
        self.reduce = reduce
        irreps_embed = self.irreps_in if self.irreps_node_attr is None else self.irreps_in + self.irreps_node_attr
        self.embedding = IrrepsLinear(irreps_embed, self.irreps_hidden)
        input_support, output_support = _supports(irreps_embed, self.irreps_out)
        self.layers = torch.nn.ModuleList(
            _Block(
                self.irreps_hidden, self.irreps_key, max_radius, num_heads=num_heads, lmax=lmax,
                number_of_basis=number_of_basis, radial_neurons=radial_neurons, basis=basis,
                density_channels=density_channels, density_lmax=density_lmax,
                density_angular_channels=density_angular_channels, avg_num_neighbors=avg_num_neighbors,
                layer_norm=layer_norm, irreps_skip=self.irreps_node_attr if self_connection == "node_attr" else None,
                input_support=input_support if t == 0 else None,
                output_support=output_support if t == num_layers - 1 else None,
            )
            for t in range(num_layers)
        )
        self.max_radius = self.layers[0].attention.max_radius
        self.output = IrrepsLinear(self.irreps_hidden, self.irreps_out)
        self.config: Dict[str, Any] = dict(
            irreps_in=str(self.irreps_in), irreps_hidden=str(self.irreps_hidden), irreps_out=str(self.irreps_out),
            max_radius=self.max_radius, num_layers=num_layers, num_heads=num_heads, lmax=lmax,
            number_of_basis=number_of_basis, radial_neurons=radial_neurons, irreps_key=str(self.irreps_key),
            irreps_node_attr=None if self.irreps_node_attr is None else str(self.irreps_node_attr), reduce=reduce,
            density_channels=density_channels, density_lmax=density_lmax,
            density_angular_channels=density_angular_channels, avg_num_neighbors=float(avg_num_neighbors),
            layer_norm=layer_norm,
            basis=basis, self_connection=self_connection,
        )

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_hidden} -> {self.irreps_out}, reduce={self.reduce!r}"

    def forward(
        self,
        pos: Any,
        x: Optional[torch.Tensor] = None,
        batch: Optional[torch.Tensor] = None,
        edge_index: Optional[torch.Tensor] = None,
        edge_vec: Optional[torch.Tensor] = None,
        *,
        node_attr: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Outputs per node, or per graph when ``reduce`` is set.

        ``pos`` may also be a mapping (e3nn style, ``{"pos": ..., "x": ..., "batch": ...}``)
        or an object with such attributes (a torch_geometric ``Data``/``Batch``); the keys
        ``pos``, ``x``, ``batch``, ``edge_index``, ``edge_vec`` and ``node_attr`` are read
        (missing ones are ``None``), and the other arguments must then be left out.
        ``x=None`` means ones, allowed when ``irreps_in`` holds only even scalars.
        """
        if not isinstance(pos, torch.Tensor):
            if any(a is not None for a in (x, batch, edge_index, edge_vec, node_attr)):
                raise ValueError("pass either a data object/mapping as pos, or tensors, not both")
            pos, x, batch, edge_index, edge_vec, node_attr = _unpack(pos)
        check_pos(pos)
        check_dtype(pos, "pos", self.output.weight.dtype, "the model")
        num_nodes = pos.shape[0]
        check_batch(batch, num_nodes)
        h = self.embedding(self._embedding_input(pos, x, node_attr))
        if edge_index is None:
            if edge_vec is not None:
                raise ValueError("edge_vec was given without edge_index: pass the edge_index it belongs to")
            edge_index = radius_graph(pos, self.max_radius, batch)
        else:
            check_edge_index(edge_index, num_nodes)
        if edge_vec is None:
            edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
        check_edge_vec(edge_vec, edge_index.shape[1])
        check_dtype(edge_vec, "edge_vec", pos.dtype, "the model")
        # the harmonics, the embedding of the lengths and the radial networks' first layers of every block: at once
        geometry = iter(shared_edge_geometry(edge_vec, [m for layer in self.layers for m in layer.geometry_layers()]))
        # checked above: the blocks do not check the same values again (while compiling no value is checked)
        with contextlib.nullcontext() if torch.compiler.is_compiling() else values_checked_by_caller():
            for layer in self.layers:
                h = layer(h, pos, edge_index, edge_vec, node_attr, [next(geometry) for _ in layer.geometry_layers()])
        out = self.output(h)
        if self.reduce is None:
            return out
        return self._pool(out, batch)

    def _embedding_input(self, pos: torch.Tensor, x: Optional[torch.Tensor], node_attr: Optional[torch.Tensor]):
        """``x`` (or ones) concatenated with the node attributes, validated."""
        num_nodes = pos.shape[0]
        x_dim, x_text, only_scalars = self._x
        if x is None:
            if not only_scalars:
                raise ValueError(f"x is required: irreps_in = {x_text} is not only even scalars")
            x = pos.new_ones(num_nodes, x_dim)
        check_features(x, x_dim, num_nodes, "x", x_text)
        check_dtype(x, "x", pos.dtype, "the model")
        if self._attr is None:
            if node_attr is not None:
                raise ValueError("node_attr was given but the model has no irreps_node_attr")
            return x
        if node_attr is None:
            raise ValueError(f"node_attr is required: the model has irreps_node_attr = {self._attr[1]}")
        check_features(node_attr, self._attr[0], num_nodes, "node_attr", self._attr[1])
        check_dtype(node_attr, "node_attr", pos.dtype, "the model")
        return torch.cat([x, node_attr], dim=1)

    def _pool(self, out: torch.Tensor, batch: Optional[torch.Tensor]) -> torch.Tensor:
        if batch is None:  # one graph: no read of the device for its number
            batch, num_graphs = torch.zeros(out.shape[0], dtype=torch.long, device=out.device), min(out.shape[0], 1)
        else:  # traced (make_fx): the number is not read from the data but given
            num_graphs = traced_graphs() or (int(batch.max()) + 1 if batch.numel() > 0 else 0)
        pooled = scatter_sum(out, batch.long(), num_graphs)
        if self.reduce == "mean":
            count = scatter_sum(torch.ones_like(out[:, :1]), batch.long(), num_graphs)
            pooled = pooled / count.clamp(min=1)
        return pooled


def _supports(irreps_embed: o3.Irreps, irreps_out: o3.Irreps) -> Tuple[o3.Irreps, Optional[o3.Irreps]]:
    """The irreps in which the first block's input can be non-zero, and those of the last block's attention that
    can reach the output (None: all).

    The embedding and every linear map keep the degree and parity, and the pre-norm adds only to even scalars:
    the first block's input is zero outside the irreps of the embedding's input and ``0e``. Even scalars of the
    output depend only on even scalars (the layer norm treats them apart from the rest, the gate's scalars do not
    read its gates): the output of an energy model reads only the ``0e`` of the last block's attention.
    """
    input_support = o3.Irreps([(1, ir) for _, ir in irreps_embed] + [(1, "0e")])
    only_even_scalars = all(ir == o3.Irrep("0e") for _, ir in irreps_out)
    return input_support, o3.Irreps("0e") if only_even_scalars else None


def _unpack(data: Any):
    """The tensors of ``_DATA_KEYS`` from a mapping or an object with attributes (``None`` when missing)."""
    if isinstance(data, Mapping):
        return tuple(data.get(key) for key in _DATA_KEYS)
    if not hasattr(data, "pos"):
        raise ValueError(
            f"pos must be a tensor [N, 3], a mapping with a 'pos' key or an object with a .pos attribute, "
            f"got {type(data).__name__}"
        )
    return tuple(getattr(data, key, None) for key in _DATA_KEYS)
