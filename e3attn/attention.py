r"""The equivariant graph attention layer."""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable, Optional, Tuple, Union

import torch
import torch.utils.hooks
from e3nn import o3

from . import kernels
from ._checks import (
    check_batch,
    check_dtype,
    check_edge_index,
    check_edge_vec,
    check_features,
    check_int,
    check_pos,
    check_radius_fits,
)
from ._irreps import IrrepsLike, as_irreps, support
from ._tracing import sorted_by_destination
from .edge_geometry import Geometry, edge_geometry
from .graph import radius_graph
from .heads import MultiHeadDot, scale_heads, split_heads
from .linear import IrrepsLinear
from .node_contraction import NodeContraction
from .radial import RadialEmbedding, RadialMLP, log_soft_unit_step
from .scatter import gather_rows, scatter_sum, segment_softmax
from .spherical_harmonics import SphericalHarmonics, check_degree
from .tensor_product import SphericalTensorProduct

__all__ = ["EquivariantAttention"]

AttentionHook = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], None]


class EquivariantAttention(torch.nn.Module):
    r"""SE(3)/O(3)-equivariant multi-head graph attention (formula (1) of SE(3)-Transformers, as in e3nn's guide).

    For every edge :math:`e = (j \to i)` (``edge_index = [src, dst]``) with
    :math:`\vec r_e = \vec x_j - \vec x_i`, :math:`r_e = |\vec r_e|`:

    .. math::

        q_i &= W_Q f_i \\
        k_e &= \left(f_j \otimes Y(\hat r_e)\right)_{w = \mathrm{MLP}_K(\mathrm{emb}(r_e))} \qquad
        v_e = \left(f_j \otimes Y(\hat r_e)\right)_{w = \mathrm{MLP}_V(\mathrm{emb}(r_e))} \\
        s_{e,h} &= \mathrm{Dot}_h(q_i, k_e) \qquad
        c_e = u\!\left(10\left(1 - r_e / r_\mathrm{max}\right)\right) \\
        \alpha_{e,h} &= \frac{c_e\, \exp(s_{e,h} - m_{i,h})}{\sum_{e' \to i} c_{e'} \exp(s_{e',h} - m_{i,h})} \\
        f'_i &= \sum_{e \to i} \sqrt{\alpha_{e, h(\cdot)}}\; v_e

    :math:`Y` are the spherical harmonics up to ``lmax`` (``"component"``
    normalisation), :math:`\otimes` a fully connected tensor product with
    per-edge weights from radial MLPs (:class:`~e3attn.tensor_product.SphericalTensorProduct`,
    :class:`~e3attn.radial.RadialMLP`), :math:`\mathrm{emb}` a
    :class:`~e3attn.radial.RadialEmbedding`, :math:`u` the
    :func:`~e3attn.radial.soft_unit_step`, :math:`\mathrm{Dot}_h` a learned
    scalar product (:class:`~e3attn.heads.MultiHeadDot`) and
    :math:`m_{i,h} = \max_{e \to i} (s_{e,h} + \log c_e)` the per-node maximum,
    which cancels exactly but keeps every exponent :math:`\le 0`: the softmax
    never overflows. A node without neighbours (normaliser 0) gets
    :math:`\alpha = 0` and a zero output. Every output channel belongs to one
    head :math:`h(\cdot)` (:func:`~e3attn.heads.head_index`). With
    ``aggregation="alpha"`` the values are weighted by :math:`\alpha` instead
    of :math:`\sqrt{\alpha}`.

    The cutoff :math:`c_e` and the embedding vanish smoothly at
    :math:`r_\mathrm{max}`, so the output is a smooth function of the
    positions even as edges appear and disappear. The one exception is two
    coincident points (:math:`r_e = 0`): :math:`c_e` is linear in :math:`r_e`
    there and :math:`r_e = |\vec x_j - \vec x_i|` has a kink, so first
    derivatives (forces) are finite but second derivatives in the positions
    (training on forces, Hessians) are NaN, as in the e3nn guide.

    On the CPU (float32 and float64), and on CUDA where
    :func:`e3attn.kernels.set_cuda_kernels` says (Triton kernels: in calls recorded as
    CUDA graphs by default, in every call after ``set_cuda_kernels(True)``), the
    layer computes exactly this without forming :math:`k_e`, :math:`v_e` or
    their weights on any edge: the radial networks' last layers are contracted
    at the nodes (:class:`~e3attn.node_contraction.NodeContraction`), except under autocast,
    inside ``torch.func`` transforms and after
    :func:`e3attn.kernels.set_fused_kernels` ``(False)``
    (:func:`e3attn.kernels.segments_enabled`); :meth:`dense` always forms them.

    Inputs must share the dtype of the parameters (an error names the
    argument otherwise), and ``max_radius`` must have a finite square in that
    dtype (up to about :math:`9 \times 10^{18}` in float32).

    Args:
        irreps_input: irreps of the node features :math:`f`.
        irreps_query: irreps of the queries (split evenly into heads).
        irreps_key: irreps of the keys (split evenly into heads).
        irreps_output: irreps of the values and the output (split evenly into heads).
        max_radius: cutoff radius :math:`r_\mathrm{max}`.
        number_of_basis: size of the radial embedding.
        lmax: maximum degree of the spherical harmonics.
        radial_neurons: hidden size of the radial MLPs.
        num_heads: number of heads :math:`H`; every multiplicity of the query,
            key and output irreps must be divisible by it.
        basis: radial basis, see :class:`~e3attn.radial.RadialEmbedding`.
        aggregation: ``"sqrt_alpha"`` (default) or ``"alpha"``.
        input_support: the degrees and parities (irreps; multiplicities are ignored) in which the input can
            be non-zero, e.g. ``"0e"`` for features embedded from scalars. The layer takes :math:`f` as zero in
            its other irreps; where the kernels run it skips their paths and the keys that only a zero query
            would read (:class:`~e3attn.node_contraction.NodeContraction`). Default: all of ``irreps_input``.
        output_support: the degrees and parities of the output in use, e.g. ``"0e"`` where only scalars are
            read; the output is zero in the other irreps, whose values are not computed where the kernels run.
            Default: all of ``irreps_output``.

    Shapes:
        ``f [N, irreps_input.dim]``, ``pos [N, 3]``, ``edge_index [2, E]``,
        ``batch [N]``, ``edge_vec [E, 3]`` to ``out [N, irreps_output.dim]``
        and, with ``return_attention=True``, ``alpha [E, num_heads]``.

    Example::

        >>> layer = EquivariantAttention("10x0e + 5x1o", "11x0e + 4x1o", "12x0e + 3x1o", "14x0e + 6x1o", max_radius=1.3)
        >>> pos, f = torch.randn(20, 3), layer.irreps_input.randn(20, -1)
        >>> out, alpha = layer(f, pos, return_attention=True)
        >>> out.shape, alpha.shape[1]
        (torch.Size([20, 32]), 1)
    """

    AGGREGATIONS = ("sqrt_alpha", "alpha")

    def __init__(
        self,
        irreps_input: IrrepsLike,
        irreps_query: IrrepsLike,
        irreps_key: IrrepsLike,
        irreps_output: IrrepsLike,
        max_radius: float,
        *,
        number_of_basis: int = 10,
        lmax: int = 3,
        radial_neurons: int = 16,
        num_heads: int = 1,
        basis: str = "smooth_finite",
        aggregation: str = "sqrt_alpha",
        input_support: Optional[IrrepsLike] = None,
        output_support: Optional[IrrepsLike] = None,
    ) -> None:
        super().__init__()
        self.irreps_input = as_irreps(irreps_input, "irreps_input")
        self.irreps_query = as_irreps(irreps_query, "irreps_query")
        self.irreps_key = as_irreps(irreps_key, "irreps_key")
        self.irreps_output = as_irreps(irreps_output, "irreps_output")
        lmax = check_degree(lmax, "lmax")
        num_heads = check_int(num_heads, "num_heads", 1)
        if aggregation not in self.AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {self.AGGREGATIONS}, got {aggregation!r}")
        for name, irreps in [("irreps_query", self.irreps_query), ("irreps_key", self.irreps_key),
                             ("irreps_output", self.irreps_output)]:
            split_heads(irreps, num_heads, name)
        self.num_heads = num_heads
        self.aggregation = aggregation
        self.irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        # plain Python values for forward: torch.compile cannot guard on e3nn's Irreps
        self._input = (self.irreps_input.dim, str(self.irreps_input))

        self.embedding = RadialEmbedding(number_of_basis, max_radius, basis)
        self.max_radius = self.embedding.max_radius
        check_radius_fits(self.max_radius, torch.float64)
        self.sh = SphericalHarmonics(lmax)
        self.tp = SphericalTensorProduct(self.irreps_input, self.irreps_sh, [self.irreps_key, self.irreps_output])
        self.radial = RadialMLP(number_of_basis, radial_neurons, self.tp.weight_numel)
        self.query = IrrepsLinear(self.irreps_input, self.irreps_query)
        self.dot = MultiHeadDot(self.irreps_query, self.irreps_key, num_heads)
        self.input_support = support(input_support, "input_support", self.irreps_input)
        self.output_support = support(output_support, "output_support", self.irreps_output)
        # where the plain formulation zeroes f and the output outside the supports (bool: kept by .to(dtype))
        for name, irreps, kept in (("_input_off", self.irreps_input, self.input_support),
                                   ("_output_off", self.irreps_output, self.output_support)):
            off = None if kept is None else torch.tensor(
                [(ir.l, ir.p) not in kept for mul, ir in irreps for _ in range(mul * ir.dim)], dtype=torch.bool)
            self.register_buffer(name, off, persistent=False)
        self.nodes = NodeContraction(self.tp, self.dot, num_heads, self.radial.hidden,
                                     input_support=self.input_support, output_support=self.output_support)
        self._output_sizes = [mul * ir.dim for mul, ir in self.irreps_output]
        self._attention_hooks: "OrderedDict[int, AttentionHook]" = OrderedDict()

    def extra_repr(self) -> str:
        supports = "".join(f", {name}={o3.Irreps([(1, ir) for ir in sorted(support)])}" for name, support in (
            ("input_support", self.input_support), ("output_support", self.output_support)) if support is not None)
        return (
            f"{self.irreps_input} -> {self.irreps_output}, query={self.irreps_query}, key={self.irreps_key}, "
            f"max_radius={self.max_radius}, num_heads={self.num_heads}, aggregation={self.aggregation!r}{supports}"
        )

    def register_attention_hook(self, hook: AttentionHook) -> torch.utils.hooks.RemovableHandle:
        """Call ``hook(module, edge_index, alpha)`` after every forward (``alpha`` detached, ``[E, num_heads]``).

        Returns a handle whose ``remove()`` unregisters the hook. Used by
        :func:`e3attn.viz.record_attention`.
        """
        handle = torch.utils.hooks.RemovableHandle(self._attention_hooks)
        self._attention_hooks[handle.id] = hook
        return handle

    def forward(
        self,
        f: torch.Tensor,
        pos: torch.Tensor,
        edge_index: Optional[torch.Tensor] = None,
        *,
        batch: Optional[torch.Tensor] = None,
        edge_vec: Optional[torch.Tensor] = None,
        geometry: Optional[Geometry] = None,
        return_attention: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Attend over the edges (the radius graph of ``pos`` when ``edge_index`` is None).

        ``edge_vec`` overrides ``pos[src] - pos[dst]`` (e.g. periodic images);
        it needs an explicit ``edge_index``. ``geometry``: the layer's :func:`~e3attn.edge_geometry.edge_geometry`
        ``(Y, p, r)`` of these edges, computed beforehand (:func:`~e3attn.edge_geometry.shared_edge_geometry`,
        once for all the blocks of :class:`~e3attn.models.EquivariantTransformer`); it needs an explicit
        ``edge_index``.
        """
        num_nodes = self._check_inputs(f, pos, batch)
        if edge_index is None:
            if edge_vec is not None or geometry is not None:
                given = "edge_vec" if edge_vec is not None else "geometry"
                raise ValueError(f"{given} was given without edge_index: pass the edge_index it belongs to")
            edge_index = radius_graph(pos, self.max_radius, batch)
        else:
            check_edge_index(edge_index, num_nodes)
        src, dst = edge_index[0].long(), edge_index[1].long()
        if edge_vec is None:
            edge_vec = _edge_vectors(pos, src, dst)
        else:
            check_edge_vec(edge_vec, src.shape[0])
            check_dtype(edge_vec, "edge_vec", pos.dtype, "the layer")
        if geometry is not None:
            self._check_geometry(geometry, src.shape[0])

        if kernels.segments_enabled(pos.device, pos.dtype):
            out, alpha = self._attend_at_nodes(f, edge_vec, src, dst, num_nodes, geometry)
        else:
            q, k, v, log_c = self._edge_terms(f, f, edge_vec, src, geometry)
            logits = (q.index_select(0, dst) * k).sum(-1) + log_c[:, None]  # [E, H]
            alpha, weight = self._attention_weights(logits, dst, num_nodes)
            out = self._supported_output(scatter_sum(scale_heads(v, weight, self._output_sizes), dst, num_nodes))

        for hook in self._attention_hooks.values():
            hook(self, edge_index, alpha.detach())
        if return_attention:
            return out, alpha
        return out

    def _check_inputs(self, f: torch.Tensor, pos: torch.Tensor, batch: Optional[torch.Tensor]) -> int:
        """Validate ``f``, ``pos`` and ``batch`` (shapes, and dtypes against the parameters); the number of nodes."""
        check_pos(pos)
        num_nodes = pos.shape[0]
        check_features(f, self._input[0], num_nodes, "f", self._input[1])
        dtype = self.radial.weight1.dtype
        check_dtype(f, "f", dtype, "the layer")
        check_dtype(pos, "pos", dtype, "the layer")
        check_radius_fits(self.max_radius, dtype)
        check_batch(batch, num_nodes)
        return num_nodes

    def _check_geometry(self, geometry: Geometry, num_edges: int) -> None:
        """``geometry`` must be ``(Y [E, sh], p [E, first layer], r [E])`` (in any floating dtype: under autocast
        it is that of the autocast)."""
        widths = ((self.sh.lmax + 1) ** 2, self.radial.weight1.shape[1])
        if not (isinstance(geometry, (tuple, list)) and len(geometry) == 3
                and all(isinstance(t, torch.Tensor) for t in geometry)):
            raise ValueError("geometry must be a tuple (Y, p, r) of tensors, from e3attn.edge_geometry")
        expected = [(num_edges, widths[0]), (num_edges, widths[1]), (num_edges,)]
        if [tuple(t.shape) for t in geometry] != expected:
            raise ValueError(f"geometry must have the shapes {expected} for {num_edges} edges, "
                             f"got {[tuple(t.shape) for t in geometry]}")

    def _attention_weights(self, logits: torch.Tensor, dst: torch.Tensor, num_nodes: int,
                           rowptr: Optional[torch.Tensor] = None):
        r"""The attention :math:`\alpha` and the weights of the values (:math:`\sqrt{\alpha}` or :math:`\alpha`);
        with ``rowptr`` (edges sorted by destination, where the node kernels run) on
        :mod:`e3attn.kernels.softmax_ops` in eager mode."""
        plain = functools.partial(segment_softmax, index=dst, num_segments=num_nodes, return_sqrt=True)
        if rowptr is not None and kernels.eager_on_cpu(logits):
            from .kernels import softmax_ops  # imports numba: only where the kernels run

            alpha, sqrt_alpha = softmax_ops.segment_softmax_csr(logits, rowptr, plain)
        else:
            alpha, sqrt_alpha = plain(logits)
        return alpha, sqrt_alpha if self.aggregation == "sqrt_alpha" else alpha

    def _geometry(self, edge_vec: torch.Tensor, geometry: Optional[Geometry] = None):
        """The spherical harmonics, the first layers' outputs of the radial networks and the log cutoff weights of
        every edge, from ``geometry`` or :func:`~e3attn.edge_geometry.edge_geometry` (:meth:`_plain_geometry`, or the
        same on the kernels of :mod:`e3attn.kernels.geometry_ops` where the node kernels run)."""
        if geometry is None:
            geometry = edge_geometry(edge_vec, self.radial.input_layer(), self.sh, self.embedding, self._plain_geometry)
        sh, pre, r = geometry
        return sh, pre, log_soft_unit_step(10.0 * (1.0 - r / self.max_radius))

    def _plain_geometry(self, edge_vec: torch.Tensor, first_layer: torch.Tensor):
        """The spherical harmonics, the radial networks' first layers ``embedding(r) @ first_layer`` and the
        lengths ``r`` of the edges."""
        r = edge_vec.norm(dim=-1)
        return self.sh(edge_vec), self.embedding(r) @ first_layer, r

    def _edge_terms(
        self, f: torch.Tensor, f_src: torch.Tensor, edge_vec: torch.Tensor, src: Optional[torch.Tensor] = None,
        geometry: Optional[Geometry] = None,
    ):
        """Projected queries per node, keys and values per edge, and the log cutoff weights.

        ``f_src`` are the source features of every edge, or with ``src`` the node features ``f_src[src]``; both
        zero outside ``input_support``.
        """
        if self._input_off is not None:
            same = f_src is f
            f = f.masked_fill(self._input_off, 0.0)
            f_src = f if same else f_src.masked_fill(self._input_off, 0.0)
        sh, pre, log_c = self._geometry(edge_vec, geometry)
        k, v = self.tp.forward_factored(f_src, sh, self.radial.activate(pre), self.radial.output_layers(), index=src)
        q = self.dot.project_query(self.query(f))
        return q, self.dot.key_heads(k), v, log_c

    def _attend_at_nodes(self, f: torch.Tensor, edge_vec: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                         num_nodes: int, geometry: Optional[Geometry] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The output and the attention (in the order of the edges) by :class:`~e3attn.node_contraction.NodeContraction`,
        on the edges sorted by destination."""
        order = None
        if not sorted_by_destination(dst):
            order = _destination_order(dst)
            src, dst, edge_vec = src.index_select(0, order), dst.index_select(0, order), gather_rows(edge_vec, order)
            if geometry is not None:
                geometry = (gather_rows(geometry[0], order), gather_rows(geometry[1], order),
                            geometry[2].index_select(0, order))
        rowptr = torch.searchsorted(dst.contiguous(), torch.arange(num_nodes + 1, device=dst.device))
        sh, pre, log_c = self._geometry(edge_vec, geometry)
        hidden = self.radial.activate(pre, normalise=False)  # c folded into the last layers
        linear = self.radial.output_layers(fold_activation_norm=True)
        out, alpha = self.nodes.attend(
            f, src, sh, hidden, linear, self.dot.project_query(self.query(f)),
            log_c, rowptr, lambda logits: self._attention_weights(logits, dst, num_nodes, rowptr))
        if order is not None:
            alpha = torch.zeros_like(alpha).index_copy(0, order, alpha)
        return out, alpha

    def dense(self, f: torch.Tensor, pos: torch.Tensor, batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        r"""The same attention evaluated densely over all :math:`N \times N` pairs.

        Pairs :math:`(j \to i)` with :math:`i \ne j` in the same graph of
        ``batch`` are scored like edges; pairs beyond the cutoff get weight
        exactly 0 through :math:`c_e`. A masked row softmax over :math:`j`
        replaces the segment softmax. Equal to ``self(f, pos, batch=batch)``
        (tested to 1e-10 in float64) at :math:`O(N^2)` time and memory; it
        exists to make the equivalence of the dense (transformer) and sparse
        (graph) forms concrete and to measure where each wins.

        Shapes:
            ``f [N, irreps_input.dim]``, ``pos [N, 3]``, ``batch [N]`` to ``[N, irreps_output.dim]``.
        """
        n = self._check_inputs(f, pos, batch)
        edge_vec = (pos[None, :, :] - pos[:, None, :]).reshape(n * n, 3)  # row i (dst), column j (src)
        q, k, v, log_c = self._edge_terms(f, f, edge_vec, torch.arange(n, device=pos.device).repeat(n))
        h = self.num_heads
        logits = (q[:, None] * k.reshape(n, n, h, k.shape[-1])).sum(-1) + log_c.reshape(n, n, 1)
        allowed = ~torch.eye(n, dtype=torch.bool, device=pos.device)
        if batch is not None:
            allowed = allowed & (batch[:, None] == batch[None, :])
        logits = logits.masked_fill(~allowed[:, :, None], float("-inf"))
        m = logits.detach().amax(dim=1, keepdim=True) if n > 0 else logits
        m = torch.where(torch.isfinite(m), m, 0.0)
        numerator = (logits - m).exp()
        z = numerator.sum(dim=1, keepdim=True)
        z = torch.where(z > 0, z, 1.0)
        weight = numerator / z if self.aggregation == "alpha" else (0.5 * (logits - m)).exp() * z.rsqrt()
        weighted = scale_heads(v, weight.reshape(n * n, h), self._output_sizes)
        return self._supported_output(weighted.reshape(n, n, weighted.shape[1]).sum(dim=1))

    def _supported_output(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` zero outside ``output_support`` (the plain formulation computes every value)."""
        return out if self._output_off is None else out.masked_fill(self._output_off, 0.0)


def _edge_vectors(pos: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    r"""``pos[src] - pos[dst]`` ``[E, 3]`` (rows gathered by ``e3attn.scatter.gather_rows``)."""
    return gather_rows(pos, src) - gather_rows(pos, dst)


@torch.library.custom_op("e3attn::destination_order", mutates_args=())
def _destination_order(dst: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(dst, stable=True)``, opaque to ``torch.compile``: inductor's own sort specialises on the
    length (one recompilation when the number of edges crosses 32,766)."""
    return torch.argsort(dst, stable=True)


@_destination_order.register_fake
def _(dst):
    return torch.empty_like(dst, dtype=torch.long)
