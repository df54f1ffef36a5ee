r"""Fully connected tensor product of node features with spherical harmonics, per-edge weights."""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from e3nn import o3

from ._constants import Float64ConstantsModule
from ._irreps import IrrepsLike, as_irreps, entries

__all__ = ["SphericalTensorProduct"]

class _Step(NamedTuple):
    """Products of input irrep ``a`` with the harmonics that reach degree group ``g``."""

    a: int
    g: int
    dim_a: int  # 2 l_a + 1
    cols: int  # (number of harmonics b) * (2 l + 1)
    rows: int  # U_a * (number of harmonics b): rows of y_g
    dim_l: int  # 2 l + 1


class _Block(NamedTuple):
    """Weights of one output ``t`` into one degree group ``g``: a ``[k, width]`` block, output ``[width, dim_l]``."""

    g: int
    k: int  # K_g, the paths into the degree
    dim_l: int  # 2 l + 1
    width: int  # summed multiplicities of the output irreps of that degree
    members: Tuple[Tuple[int, int, int], ...]  # (multiplicity, first channel in the block, first output row)


class SphericalTensorProduct(Float64ConstantsModule):
    r"""Fully connected tensor products :math:`x \otimes Y` with per-sample weights, into several outputs at once.

    For every output :math:`t` (e.g. keys and values) and output irrep :math:`c`
    of multiplicity :math:`W_c` and degree :math:`l_c`:

    .. math::

        z^{(t)}_{c, w, k} = \sqrt{\frac{2 l_c + 1}{K_c}}
            \sum_{(a, b) \to c} \sum_{u=1}^{U_a} w^{(t)}_{a u b, w}
            \sum_{i, j} C^{l_a l_b l_c}_{i j k}\, x_{a, u, i}\, Y_{b, j}

    where :math:`x_a` (multiplicity :math:`U_a`) runs over the irreps of
    ``irreps_in``, :math:`Y_b` over the (multiplicity-one) irreps of
    ``irreps_sh``, :math:`C` are e3nn's Wigner 3j symbols, and
    :math:`K_c = \sum_{(a,b)\to c} U_a` counts the paths into :math:`c`. This
    is e3nn's ``FullyConnectedTensorProduct(irreps_in, irreps_sh, irreps_out,
    shared_weights=False)`` with its default ``"component"`` / ``"element"``
    normalisations, computed differently. Per sample, in a layout with the
    samples along the last (contiguous) axis:

    1. one matrix product contracts :math:`Y` with every Clebsch-Gordan block,
       :math:`T_{a} = C \cdot Y`,
    2. elementwise products over the few components :math:`i` of :math:`x_a`
       give :math:`y_{g} = \sum_i x_{a, \cdot, i} T_{a, i}`, the
       ``[K_g, 2l+1]`` inputs of every output degree :math:`g`, shared by all outputs,
    3. elementwise products with the weights sum over the paths :math:`K_g`.

    The weights of an output are ordered by degree (in the order the degrees
    first appear in that output), one ``[K_g, W]`` block per degree whose rows
    are ordered by (input irrep :math:`a`, channel :math:`u`, harmonic
    :math:`b`) and whose columns are the channels of the output irreps of that
    degree, in order (:meth:`e3nn_weight_index` maps e3nn's order to it).

    :meth:`forward_factored` takes weights that are a product
    :math:`w^{(t)} = h^{(t)} L^{(t)}` (the last linear layer of a radial
    network). :class:`~e3attn.node_contraction.NodeContraction` takes the
    same product, the keys and values of the attention, to the nodes on the
    compiled kernels of :mod:`e3attn.kernels`, reading its structure by name
    (``_spec``).

    Args:
        irreps_in: irreps of :math:`x`.
        irreps_sh: irreps of :math:`Y`, every multiplicity 1 (e.g. ``o3.Irreps.spherical_harmonics(3)``).
        irreps_outs: the output irreps, one per output.

    Shapes:
        ``x [E, irreps_in.dim]``, ``sh [E, irreps_sh.dim]``, weights ``[E, weight_numel[t]]``
        to a list of ``[E, irreps_outs[t].dim]``.

    Example::

        >>> tp = SphericalTensorProduct("4x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["3x0e + 1x1o"])
        >>> x, sh = torch.randn(7, 10), torch.randn(7, 9)
        >>> [z.shape for z in tp(x, sh, [torch.randn(7, n) for n in tp.weight_numel])]
        [torch.Size([7, 6])]
    """

    def __init__(self, irreps_in: IrrepsLike, irreps_sh: IrrepsLike, irreps_outs: Sequence[IrrepsLike]) -> None:
        super().__init__()
        self.irreps_in = as_irreps(irreps_in, "irreps_in")
        self.irreps_sh = as_irreps(irreps_sh, "irreps_sh")
        self.irreps_outs = [as_irreps(ir, "irreps_outs") for ir in irreps_outs]
        # plain ints: torch.compile cannot guard on Irreps
        self._dims = (self.irreps_in.dim, self.irreps_sh.dim)
        # the irreps as one string: names the structure to the custom operators (see ``_structure``)
        self._spec = _SEPARATOR.join(str(irreps) for irreps in (self.irreps_in, self.irreps_sh, *self.irreps_outs))
        if any(mul != 1 for mul, _ in self.irreps_sh):
            raise ValueError(f"irreps_sh must have multiplicity 1 everywhere, got {self.irreps_sh}")
        self._in = entries(self.irreps_in)
        self._sh = [(l, p) for _, (l, p) in self.irreps_sh]
        self._out_entries = [entries(out) for out in self.irreps_outs]

        # degrees (l, p) reachable from x (x) Y, in order of first appearance among the outputs
        self._groups: List[Tuple[int, int]] = []
        for ents in self._out_entries:
            for _, l, p in ents:
                if (l, p) not in self._groups:
                    self._groups.append((l, p))
        # paths[g][a] = harmonics b with a (x) b -> g
        paths = [[self._harmonics_into(a, l, p) for a in range(len(self._in))] for l, p in self._groups]
        self._k = [sum(mul * len(bs) for (mul, _, _), bs in zip(self._in, paths[g])) for g in range(len(self._groups))]

        # Step 1 constant: [sh_dim, sum over steps (a, g) of (2la+1) * n_ag * (2l+1)], float64
        sh_offsets = [sum(2 * lb + 1 for lb, _ in self._sh[:b]) for b in range(len(self._sh))]
        blocks, self._steps = [], []
        for a, (mul, la, _) in enumerate(self._in):
            for g, (l, _) in enumerate(self._groups):
                bs = paths[g][a]
                if not bs:
                    continue
                block = torch.zeros(self.irreps_sh.dim, 2 * la + 1, len(bs), 2 * l + 1, dtype=torch.float64)
                norm = math.sqrt((2 * l + 1) / self._k[g])
                for n, b in enumerate(bs):
                    lb = self._sh[b][0]
                    cg = o3.wigner_3j(la, lb, l, dtype=torch.float64)  # [2la+1, 2lb+1, 2l+1]
                    block[sh_offsets[b] : sh_offsets[b] + 2 * lb + 1, :, n, :] = norm * cg.transpose(0, 1)
                blocks.append(block.reshape(self.irreps_sh.dim, -1))
                self._steps.append(_Step(a, g, 2 * la + 1, len(bs) * (2 * l + 1), mul * len(bs), 2 * l + 1))
        cg_all = torch.cat(blocks, dim=1) if blocks else torch.zeros(self.irreps_sh.dim, 0, dtype=torch.float64)
        self.register_constant("cg", cg_all)

        # weights of output t: one [K_g, width] block per degree g of t
        self._blocks: List[List[_Block]] = []
        for ents in self._out_entries:
            members: Dict[int, List[Tuple[int, int, int]]] = {}
            row = 0
            for mul, l, p in ents:
                g = self._groups.index((l, p))
                ms = members.setdefault(g, [])
                ms.append((mul, sum(m for m, _, _ in ms), row))
                row += mul * (2 * l + 1)
            self._blocks.append([
                _Block(g, self._k[g], 2 * self._groups[g][0] + 1, sum(m for m, _, _ in ms), tuple(ms))
                for g, ms in members.items()
            ])
        # output t in the order of its irreps: (block, first channel in the block, multiplicity)
        self._pieces = [[(i, start, mul) for _, i, start, mul in sorted(
            (row, i, start, mul) for i, blk in enumerate(blocks_t) for mul, start, row in blk.members)]
            for blocks_t in self._blocks]
        self._block_numel = [[blk.k * blk.width for blk in blocks_t] for blocks_t in self._blocks]
        self._block_offsets = [[sum(sizes[:i]) for i in range(len(sizes))] for sizes in self._block_numel]
        self.weight_numel = [sum(sizes) for sizes in self._block_numel]
        _STRUCTURES.setdefault(self._spec, self)

    def _harmonics_into(self, a: int, l: int, p: int) -> List[int]:
        """The harmonics ``b`` with a path from input irrep ``a`` to degree ``(l, p)``."""
        _, la, pa = self._in[a]
        return [b for b, (lb, pb) in enumerate(self._sh) if pa * pb == p and abs(la - lb) <= l <= la + lb]

    # ------------------------------------------------------------------ public entry points

    def forward(self, x: torch.Tensor, sh: torch.Tensor, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        ys = self._products(x.T, sh.T, self.constant("cg", sh.dtype))
        return [self._contract(t, ys, w=w.T).T for t, w in enumerate(weights)]

    def forward_factored(
        self,
        x: torch.Tensor,
        sh: torch.Tensor,
        hidden: Sequence[torch.Tensor],
        linear: Sequence[torch.Tensor],
        *,
        index: Optional[torch.Tensor] = None,
        chunk_size: Optional[int] = None,
    ) -> List[torch.Tensor]:
        r"""The tensor products with weights :math:`w^{(t)} = h^{(t)} L^{(t)}` (e.g. a radial network's last layer).

        .. math::

            \mathrm{forward\_factored}(x, Y, h, L) = \mathrm{forward}\big(x, Y, [h^{(t)} L^{(t)}]_t\big)

        With ``index``, sample :math:`e` uses ``x[index[e]]`` (e.g. the source
        node of every edge). PyTorch operations on every device, differentiable
        to any order, as ``forward``: it forms the ``[E, weight_numel]``
        weights (the layer itself avoids them where its kernels run, see
        :class:`~e3attn.node_contraction.NodeContraction`).

        Args:
            x: ``[E, irreps_in.dim]``, or ``[N, irreps_in.dim]`` with ``index``.
            sh: ``[E, irreps_sh.dim]``.
            hidden: per output, ``[E, h_t]`` (e.g. the hidden layer of a radial network).
            linear: per output, ``[h_t, weight_numel[t]]``.
            index: optional ``[E]`` rows of ``x``.
            chunk_size: deprecated, without effect (it tiled the per-edge kernels, which the contraction at the
                nodes replaced); a ``DeprecationWarning`` says so.

        Returns:
            a list of ``[E, irreps_outs[t].dim]``.

        Example::

            >>> tp = SphericalTensorProduct("4x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["3x0e + 1x1o"])
            >>> x, sh, h = torch.randn(7, 10), torch.randn(7, 9), torch.randn(7, 5)
            >>> [z.shape for z in tp.forward_factored(x, sh, [h], [torch.randn(5, tp.weight_numel[0])])]
            [torch.Size([7, 6])]
        """
        if chunk_size is not None:
            warnings.warn("forward_factored(chunk_size=...) has no effect since the per-edge kernels were retired "
                          "and will be removed: drop the argument", DeprecationWarning, stacklevel=2)
        self._check_factored(x, sh, hidden, linear, index)
        x = x if index is None else x.index_select(0, index)
        return self.forward(x, sh, [h @ w for h, w in zip(hidden, linear)])

    def _check_factored(self, x, sh, hidden, linear, index) -> None:
        """Shapes of the arguments of :meth:`forward_factored`, with errors naming the argument."""
        n = len(self.irreps_outs)
        if len(hidden) != n or len(linear) != n:
            raise ValueError(f"hidden and linear need one tensor per output ({n})")
        dim_in, dim_sh = self._dims
        if sh.dim() != 2 or sh.shape[1] != dim_sh:
            raise ValueError(f"sh must have shape [E, {dim_sh}], got {list(sh.shape)}")
        num = sh.shape[0]
        if x.dim() != 2 or x.shape[1] != dim_in:
            raise ValueError(f"x must have shape [*, {dim_in}], got {list(x.shape)}")
        if index is None and x.shape[0] != num:
            raise ValueError(f"x must have one row per row of sh ({num}) when no index is given, got {x.shape[0]}")
        if index is not None and (index.dim() != 1 or index.shape[0] != num):
            raise ValueError(f"index must have shape [{num}] (one row of x per row of sh), got {list(index.shape)}")
        dtypes = {t.dtype for t in (x, sh, *hidden, *linear)}
        if len(dtypes) > 1 and not _autocast(sh.device):  # autocast mixes them on purpose
            raise ValueError(f"x, sh, hidden and linear must share one dtype, got {sorted(map(str, dtypes))}")
        for t, (h, w) in enumerate(zip(hidden, linear)):
            if h.dim() != 2 or h.shape[0] != num:
                raise ValueError(f"hidden[{t}] must have shape [{num}, h], got {list(h.shape)}")
            if w.dim() != 2 or w.shape[0] != h.shape[1] or w.shape[1] != self.weight_numel[t]:
                raise ValueError(
                    f"linear[{t}] must have shape [{h.shape[1]}, {self.weight_numel[t]}], got {list(w.shape)}")

    def e3nn_weight_index(self, t: int) -> torch.Tensor:
        r"""Index ``i`` such that ``weights[t] = w_e3nn[:, i]`` for e3nn's ``FullyConnectedTensorProduct``.

        e3nn orders its weights by instruction ``(a, b, c)`` (input, harmonic,
        output irrep) with a ``[U_a, 1, W_c]`` block each; this maps them to the
        layout used here, so that results can be compared with e3nn.
        """
        ents = self._out_entries[t]
        e3nn_offset, pos = {}, 0
        for a, (mul_a, _, _) in enumerate(self._in):
            for b in range(len(self._sh)):
                for c, (mul_c, l, p) in enumerate(ents):
                    if b in self._harmonics_into(a, l, p):
                        e3nn_offset[(a, b, c)] = pos
                        pos += mul_a * mul_c
        index = []
        for blk in self._blocks[t]:
            l, p = self._groups[blk.g]
            cs = [c for c, (_, lc, pc) in enumerate(ents) if (lc, pc) == (l, p)]
            rows = [(a, u, b) for a, (mul_a, _, _) in enumerate(self._in) for u in range(mul_a)
                    for b in self._harmonics_into(a, l, p)]
            for a, u, b in rows:
                for c in cs:
                    mul_c = ents[c][0]
                    index.extend(e3nn_offset[(a, b, c)] + u * mul_c + w for w in range(mul_c))
        return torch.tensor(index, dtype=torch.long)

    # ------------------------------------------------------------------ the computation, samples last
    # Every per-sample tensor below is laid out [features..., C] (samples along the contiguous last axis),
    # so that the products over the few components of an irrep are long vectorised elementwise operations.

    def _products(self, xT: torch.Tensor, shT: torch.Tensor, cg: torch.Tensor) -> List[Optional[torch.Tensor]]:
        r"""Steps 1-2: per degree, :math:`y_g` ``[K_g, 2l+1, C]`` (None if :math:`K_g = 0`)."""
        num = xT.shape[1]
        xs = self._split_input(xT)
        ts = cg.T @ shT
        parts: List[List[torch.Tensor]] = [[] for _ in self._groups]
        for s, t in zip(self._steps, self._split_steps(ts)):
            x = xs[s.a]
            y = x[:, 0, None] * t[0]
            for i in range(1, s.dim_a):
                y.addcmul_(x[:, i, None], t[i])
            parts[s.g].append(y.reshape(s.rows, s.dim_l, num))
        return [torch.cat(p, dim=0) if len(p) > 1 else (p[0] if p else None) for p in parts]

    def _split_input(self, xT: torch.Tensor) -> List[torch.Tensor]:
        """``[irreps_in.dim, C]`` to ``[U_a, 2l_a+1, C]`` views."""
        sizes = [mul * (2 * l + 1) for mul, l, _ in self._in]
        return [p.reshape(mul, 2 * l + 1, xT.shape[1]) for p, (mul, l, _) in zip(xT.split(sizes, dim=0), self._in)]

    def _split_steps(self, ts: torch.Tensor) -> List[torch.Tensor]:
        """``[cg columns, C]`` to ``[2l_a+1, cols, C]`` per step."""
        parts = ts.split([s.dim_a * s.cols for s in self._steps], dim=0)
        return [t.view(s.dim_a, s.cols, ts.shape[1]) for t, s in zip(parts, self._steps)]

    def _contract(self, t: int, ys: List[Optional[torch.Tensor]], w: torch.Tensor) -> torch.Tensor:
        r"""Step 3 for output ``t``: ``[dim, C]`` from :math:`y` and the weights ``w`` ``[weight_numel[t], C]``.

        .. math:: z_{w, m} = \sum_k w_{k, w}\, y_{k, m}
        """
        num = w.shape[1]
        zs = []
        for blk, start, size in zip(self._blocks[t], self._block_offsets[t], self._block_numel[t]):
            y = ys[blk.g]
            if y is None:  # no path reaches this degree
                zs.append(w.new_zeros(blk.width, blk.dim_l, num))
            else:
                zs.append((w[start : start + size].reshape(blk.k, blk.width, 1, num) * y[:, None]).sum(0))
        pieces = [zs[i][start : start + mul].flatten(0, 1) for i, start, mul in self._pieces[t]]
        return torch.cat(pieces, dim=0) if pieces else w.new_zeros(0, num)


def _autocast(device: torch.device) -> bool:
    """Whether autocast is on for ``device``."""
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


# ---------------------------------------------------------------------- the structure by name
# The node contraction's custom operators name a product by its irreps (``_spec``), so that they never touch a
# module's buffers; ``_structure`` finds the structure again (for e3attn.kernels.layout).

_SEPARATOR = " | "


# a live product of every spec, registered when built (so that tracing never has to build one)
_STRUCTURES: "weakref.WeakValueDictionary[str, SphericalTensorProduct]" = weakref.WeakValueDictionary()


def _structure(spec: str) -> "SphericalTensorProduct":
    """A tensor product named by ``spec`` (``SphericalTensorProduct._spec``): only its structure is used."""
    tp = _STRUCTURES.get(spec)
    if tp is None:  # none alive, e.g. a graph saved by another process
        irreps_in, irreps_sh, *irreps_outs = spec.split(_SEPARATOR)
        tp = SphericalTensorProduct(irreps_in, irreps_sh, irreps_outs)
    return tp
