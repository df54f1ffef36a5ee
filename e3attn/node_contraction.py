r"""Attention with the radial networks' last layers contracted at the nodes instead of on every edge."""
from __future__ import annotations

from typing import Callable, List, Optional, Set, Tuple

import torch

from .heads import MultiHeadDot, head_dot, head_index, head_outer
from .kernels import eager_on_cpu
from .kernels.layout import layout_for, padded_paths, restricted_spec
from .tensor_product import SphericalTensorProduct

__all__ = ["NodeContraction"]


class NodeContraction(torch.nn.Module):
    r"""Keys and values of :class:`~e3attn.attention.EquivariantAttention` contracted with their weights per node.

    The weights of an edge are :math:`w^{(t)}_e = h^{(t)}_e L^{(t)}`, linear in the few hidden features
    :math:`h_e` of its radial network, and keys and values are linear in :math:`w` and in the path
    features :math:`y_e = P(f_{\mathrm{src}(e)}, Y_e)` (:class:`~e3attn.tensor_product.SphericalTensorProduct`,
    degree group :math:`g`, path :math:`k`, component :math:`m`). So both sides of the attention can take
    the sum over the weights' columns :math:`w` at the nodes, once per node instead of once per edge. For
    the logits, with :math:`\tilde q_i` the projected query of node :math:`i` in the layout of the keys:

    .. math::

        s_{e, a} = \sum_h h^{(k)}_{e, h} \sum_p y_{e, p}\, Q_{i, a h p}, \qquad
        Q_{i, a h (g k m)} = \sum_{w \in a} L^{(k)}_{h, (g k w)}\, \tilde q_{i, (g w m)}

    and for the output, with :math:`\beta_{e, a}` the attention weight of head :math:`a`
    (:math:`\sqrt{\alpha}` or :math:`\alpha`):

    .. math::

        U_{i, a h p} = \sum_{e \to i} \beta_{e, a}\, h^{(v)}_{e, h}\, y_{e, p}, \qquad
        f'_{i, (g w m)} = \sum_{h, k} L^{(v)}_{h, (g k w)}\, U_{i, a(w) h (g k m)}

    Per node :math:`i`, :math:`Q_i` and :math:`U_i` (``[heads * hidden, paths]``) are built in cache by the
    kernels of :mod:`e3attn.kernels.segment_ops` and never stored: ``node_expand`` builds :math:`Q_i` and
    contracts it with the path features of the node's incoming edges, ``node_outer`` sums :math:`U_i` over them
    and contracts it with :math:`L^{(v)}`. Two operators, each the other's derivative, do all the work of keys and
    values, to any order of derivative. For the e3nn guide's layer that is 2.8x (forward) and 3.4x (backward)
    fewer operations than forming the weights :math:`w_e` of every edge, and no per-edge keys, values or
    weights are stored, only the path features :math:`y_e` (their columns padded with zeros to a multiple of 8,
    :func:`~e3attn.kernels.layout.padded_paths`). The edges must be sorted by destination
    (``rowptr``, the CSR layout of the layer's graph). The module holds only index tensors (non-persistent
    buffers; the block tables stay on the CPU on every device): the layout of the keys and values per block of
    the product.

    Both sums run over the paths :math:`p` of the product, and the work per edge grows with their number. Two
    sets of degrees and parities :math:`(l, p)` leave some of them out (the layer's ``input_support`` and
    ``output_support``). With ``input_support``, the paths from the other input irreps are dropped (those
    inputs are taken as zero), and so are the keys' degrees outside it: the query, linear in :math:`f`, is
    zero there, and so is :math:`Q_i`. With ``output_support``, the values of only those degrees are
    computed; the output's other columns are zero. Each side then runs on the path features of its own
    degrees (:func:`~e3attn.kernels.layout.restricted_spec`, ``specs``); every kept path keeps its
    coefficient and its weights.

    Args:
        tp: the layer's product, outputs ``[keys, values]``.
        dot: the layer's query-key product (its head layout of the keys).
        num_heads: number of heads.
        hidden: hidden size of the radial networks.
        input_support: ``(l, p)`` of the input irreps that can be non-zero (None: all).
        output_support: ``(l, p)`` of the output irreps to compute (None: all).

    Example::

        >>> tp = SphericalTensorProduct("4x0e + 2x1o", "1x0e + 1x1o", ["2x0e + 2x1o", "2x0e + 2x1o"])
        >>> nodes = NodeContraction(tp, MultiHeadDot("2x0e + 2x1o", "2x0e + 2x1o"), num_heads=1, hidden=8)
        >>> nodes.num_paths  # per edge: 4 + 2 paths into 0e, (4 + 2) x 3 components into 1o
        24
        >>> scalar_input = NodeContraction(tp, MultiHeadDot("2x0e + 2x1o", "2x0e + 2x1o"), num_heads=1, hidden=8,
        ...                                input_support={(0, 1)})
        >>> [layout_for(spec).num_paths for spec in scalar_input.specs]  # keys: 4 into 0e; values: also 4 x 3 into 1o
        [4, 16]
    """

    def __init__(self, tp: SphericalTensorProduct, dot: MultiHeadDot, num_heads: int, hidden: int, *,
                 input_support: Optional[Set[Tuple[int, int]]] = None,
                 output_support: Optional[Set[Tuple[int, int]]] = None) -> None:
        super().__init__()
        self.spec, self.num_heads, self.hidden = tp._spec, num_heads, hidden
        self.num_paths = layout_for(tp._spec).num_paths
        # the path features of each side: from the inputs that can be non-zero, into the degrees that the side
        # reads (the keys: where the query can be non-zero; the values: the outputs in use)
        inputs = [a for a, (_, l, p) in enumerate(tp._in) if input_support is None or (l, p) in input_support]
        sides = [input_support, output_support]
        self.specs = tuple(
            tp._spec if len(inputs) == len(tp._in) and support is None else restricted_spec(
                tp._spec, inputs, [g for g, lp in enumerate(tp._groups) if support is None or lp in support])
            for support in sides)
        key_dim = tp.irreps_outs[0].dim
        # position of every key column in the flattened [heads, D] layout of ``dot.key_heads``
        columns = dot.key_heads(torch.arange(key_dim, dtype=torch.float64)[None])[0].long().reshape(-1)
        key_position = torch.empty(key_dim, dtype=torch.long)
        key_position[columns] = torch.arange(key_dim)
        heads_of = [key_position // max(1, key_dim // num_heads), head_index(tp.irreps_outs[1], num_heads)]
        self._dims = []
        for t, name in enumerate(("key", "value")):
            layout = layout_for(self.specs[t])
            table: List[List[int]] = []
            z_index: List[torch.Tensor] = []
            l_index: List[torch.Tensor] = []
            row = 0
            for side, poff, k, dim_l, width, woff, coff in layout.blocks.tolist():
                rows = torch.as_tensor(layout.rows[row : row + k])
                row += k
                if side != t:
                    continue
                first = torch.as_tensor(layout.channels[coff : coff + width]) - layout.out_offsets[t]
                order = torch.argsort(heads_of[t][first] * width + torch.arange(width)).reshape(num_heads, -1)
                cols = first[order][..., None] + torch.arange(dim_l)  # [heads, W / heads, 2l+1]
                table.append([poff, k, dim_l, width // num_heads, sum(map(len, l_index)), sum(map(len, z_index))])
                z_index.append((key_position[cols] if t == 0 else cols).reshape(-1))
                # L[h, woff + row(k) W + w] at [heads, W / heads, hidden, K]
                numel = layout.weight_numel[t]
                l_index.append((torch.arange(hidden)[:, None] * numel + woff + rows[None, :] * width
                                + order[:, :, None, None]).reshape(-1))
            if t == 1:  # the output's columns of no block (outside output_support) last: no block writes them
                covered = torch.zeros(tp.irreps_outs[1].dim, dtype=torch.bool)
                for ix in z_index:
                    covered[ix] = True
                z_index.append(torch.nonzero(~covered)[:, 0])
            cat = [torch.cat(ix) if ix else torch.zeros(0, dtype=torch.long) for ix in (z_index, l_index)]
            self.register_buffer(f"_{name}_columns", cat[0], persistent=False)
            self.register_buffer(f"_{name}_weights", cat[1], persistent=False)
            self.register_buffer(f"_{name}_blocks", torch.tensor(table, dtype=torch.long).reshape(-1, 6),
                                 persistent=False)
            self._dims.append([num_heads, hidden, padded_paths(layout.num_paths), cat[0].numel(), cat[1].numel()])
        self.register_buffer("_value_order", torch.argsort(self._value_columns), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Move or cast the index buffers, except the block tables: they stay on the CPU whatever the module's
        device (the kernels read them as Python integers, without a copy from a GPU per call)."""
        tables = self._key_blocks, self._value_blocks
        super()._apply(fn, recurse)
        self._key_blocks, self._value_blocks = tables
        return self

    def attend(self, f: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, hidden: List[torch.Tensor],
               linear: List[torch.Tensor], q: torch.Tensor, log_c: torch.Tensor, rowptr: torch.Tensor,
               weight_fn: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The output ``[N, out]`` and the attention ``[E, heads]`` for edges sorted by destination (``rowptr``):
        ``f [N, in]``, ``index [E]`` (source nodes), ``sh [E, sh]``, the radial networks' ``hidden [E, h]``
        and last layers ``linear [h, weight_numel]`` (keys, values), ``q [N, heads, D]`` the projected
        queries, ``log_c [E]``, and ``weight_fn(logits) -> (alpha, beta)`` the segment softmax, which must
        group the edges by the same destinations as ``rowptr`` (the kernels check ``rowptr`` itself, not that)."""
        from .kernels import segment_ops  # imports numba: only where the kernels run

        call = segment_ops.call
        y = call(segment_ops.path_features, self.specs[0], f, index, sh)
        zk = q.flatten(1).index_select(1, self._key_columns)
        lk = linear[0].reshape(-1).index_select(0, self._key_weights)
        t = call(segment_ops.node_expand, y, None, zk, lk, self._key_blocks, rowptr, self._dims[0])[0]  # [E, J]
        dot, outer = head_dot, head_outer
        if eager_on_cpu(t, hidden[0]):
            from .kernels import heads_ops  # imports numba: only where the kernels run

            dot, outer = heads_ops.head_dot, heads_ops.head_outer
        logits = dot(t, hidden[0]) + log_c[:, None]
        alpha, beta = weight_fn(logits)
        a = outer(beta, hidden[1])
        if self.specs[1] != self.specs[0]:
            y = call(segment_ops.path_features, self.specs[1], f, index, sh)
        lv = linear[1].reshape(-1).index_select(0, self._value_weights)
        out = call(segment_ops.node_outer, a, y, lv, None, self._value_blocks, rowptr, self._dims[1])[0]
        return out.index_select(1, self._value_order), alpha
