r"""Fully connected tensor product of node features with spherical harmonics, per-edge weights."""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from e3nn import o3

from . import kernels
from ._constants import Float64ConstantsModule
from ._irreps import IrrepsLike, as_irreps, entries

__all__ = ["SphericalTensorProduct"]

# Floats of per-sample temporaries one chunk of ``SphericalTensorProduct.forward_factored`` may hold, per thread.
_CHUNK_FLOATS = 1 << 20
# The same on a GPU, where chunks only bound the memory.
_CHUNK_FLOATS_GPU = 1 << 28
_MIN_CHUNK = 256
# Elementwise products up to this many floats are formed at once, larger ones one component m at a time.
_PRODUCT_FLOATS = 1 << 20
# Inner chunks per outer chunk (see ``_factored_product``).
_OUTER = 4


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
    network) and never stores the ``[E, weight_numel]`` weights: it works
    through the samples in cache-sized chunks, with a hand-written backward
    that recomputes the weights of each chunk; for scalar outputs it skips
    them altogether, :math:`z_w = \sum_{h, k} L_{h, k w}\, (h_h y_k)` being a
    single matrix product.

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
        self._dims = (self.irreps_in.dim, self.irreps_sh.dim)  # plain ints: torch.compile cannot guard on Irreps
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
        return self._forward_weights(x, sh, weights, self.constant("cg", sh.dtype))

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
        r"""The tensor products with weights :math:`w^{(t)} = h^{(t)} L^{(t)}`, never stored for all samples.

        .. math::

            \mathrm{forward\_factored}(x, Y, h, L) = \mathrm{forward}\big(x, Y, [h^{(t)} L^{(t)}]_t\big)

        With ``index``, sample :math:`e` uses ``x[index[e]]`` (e.g. the source
        node of every edge), gathered chunk by chunk. The samples are processed in
        chunks of ``chunk_size`` (default :meth:`default_chunk_size`); the
        backward recomputes every intermediate chunk by chunk, so that only the
        inputs are kept for it. Twice differentiable (a second derivative, e.g.
        training on forces, goes through plain autograd). It runs as the custom
        operator ``torch.ops.e3attn.factored_product`` (with its backward
        ``e3attn.factored_product_backward``), so that ``torch.compile`` keeps
        the same chunked computation in its graph; under autocast and
        ``torch.func`` transforms it runs as plain tensor operations. With
        :func:`e3attn.kernels.set_fused_kernels` it runs the fused kernels
        instead (CPU, float32 and float64; ``chunk_size`` is then the tile).

        Args:
            x: ``[E, irreps_in.dim]``, or ``[N, irreps_in.dim]`` with ``index``.
            sh: ``[E, irreps_sh.dim]``.
            hidden: per output, ``[E, h_t]`` (e.g. the hidden layer of a radial network).
            linear: per output, ``[h_t, weight_numel[t]]``.
            index: optional ``[E]`` rows of ``x``.
            chunk_size: samples per chunk.

        Returns:
            a list of ``[E, irreps_outs[t].dim]``.

        Example::

            >>> tp = SphericalTensorProduct("4x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["3x0e + 1x1o"])
            >>> x, sh, h = torch.randn(7, 10), torch.randn(7, 9), torch.randn(7, 5)
            >>> [z.shape for z in tp.forward_factored(x, sh, [h], [torch.randn(5, tp.weight_numel[0])])]
            [torch.Size([7, 6])]
        """
        self._check_factored(x, sh, hidden, linear, index)
        cg = self.constant("cg", sh.dtype)
        if _plain_operations_only(sh.device.type):
            return self._forward_plain(x, sh, hidden, linear, index, cg)
        dtypes = {t.dtype for t in (x, sh, *hidden, *linear)}
        if len(dtypes) > 1:
            raise ValueError(f"x, sh, hidden and linear must share one dtype, got {sorted(map(str, dtypes))}")
        if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if kernels.fused_enabled(sh.device, sh.dtype):  # opt-in: e3attn.kernels.set_fused_kernels(True)
            index = index.long() if index is not None else None
            return kernels.fused_factored_product(self._spec, x, sh, hidden, linear, index, chunk_size or 0)
        # 0: the default, chosen where the product runs (torch.compile cannot see the number of threads)
        return _factored_product(self._spec, chunk_size or 0, index, x, sh, cg, [*hidden, *linear])

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
        for t, (h, w) in enumerate(zip(hidden, linear)):
            if h.dim() != 2 or h.shape[0] != num:
                raise ValueError(f"hidden[{t}] must have shape [{num}, h], got {list(h.shape)}")
            if w.dim() != 2 or w.shape[0] != h.shape[1] or w.shape[1] != self.weight_numel[t]:
                raise ValueError(
                    f"linear[{t}] must have shape [{h.shape[1]}, {self.weight_numel[t]}], got {list(w.shape)}")

    def _forward_weights(self, x, sh, weights, cg: torch.Tensor) -> List[torch.Tensor]:
        """:meth:`forward` with the constant ``cg`` given (on the device and in the dtype of ``sh``)."""
        _, ys = self._products(x.T, sh.T, cg)
        return [self._contract(t, ys, w=w.T).T for t, w in enumerate(weights)]

    def _forward_plain(self, x, sh, hidden, linear, index, cg: torch.Tensor) -> List[torch.Tensor]:
        """:meth:`forward_factored` as plain differentiable tensor operations."""
        x = x if index is None else x.index_select(0, index)
        return self._forward_weights(x, sh, [h @ w for h, w in zip(hidden, linear)], cg)

    def default_chunk_size(self, device: Optional[torch.device] = None) -> int:
        """Samples per chunk of :meth:`forward_factored` on ``device`` (default: the CPU).

        On the CPU, the largest temporaries of a chunk (its weights and one
        elementwise product per weight block) take about 4 MB per thread in
        float32 (up to 4 threads), so that they stay in cache; a chunk has at
        least 256 samples, so that every operation runs on long contiguous rows.
        On a GPU, where every operation is a kernel launch, chunks only bound the
        memory: about 1 GB of temporaries in float32.
        """
        per_sample = 1 + sum(self.weight_numel) + max([n for sizes in self._block_numel for n in sizes], default=0)
        if device is not None and torch.device(device).type != "cpu":
            return max(_MIN_CHUNK, _CHUNK_FLOATS_GPU // per_sample)
        return max(_MIN_CHUNK, _CHUNK_FLOATS * min(torch.get_num_threads(), 4) // per_sample)

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

    def _products(
        self, xT: torch.Tensor, shT: torch.Tensor, cg: torch.Tensor
    ) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]]]:
        r"""Steps 1-2: :math:`T` ``[cg columns, C]`` and, per degree, :math:`y_g` ``[K_g, 2l+1, C]`` (None if :math:`K_g = 0`)."""
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
        return ts, [torch.cat(p, dim=0) if len(p) > 1 else (p[0] if p else None) for p in parts]

    def _products_backward(
        self, xT: torch.Tensor, ts: torch.Tensor, gys: List[Optional[torch.Tensor]], cg: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Gradients of steps 1-2: of :math:`x` ``[irreps_in.dim, C]`` and of :math:`Y` ``[irreps_sh.dim, C]``."""
        num = xT.shape[1]
        xs = self._split_input(xT)
        gxs = [torch.zeros_like(x) for x in xs]
        gts = torch.zeros_like(ts)
        gy_parts = [list(gy.split([s.rows for s in self._steps if s.g == g])) if gy is not None else None
                    for g, gy in enumerate(gys)]
        for s, t, gt in zip(self._steps, self._split_steps(ts), self._split_steps(gts)):
            if gy_parts[s.g] is None:
                continue
            gy = gy_parts[s.g].pop(0).reshape(xs[s.a].shape[0], 1, s.cols, num)  # [U, 1, cols, C]
            gxs[s.a] += (gy * t).sum(2)
            torch.sum(xs[s.a][:, :, None] * gy, dim=0, out=gt)
        gx = torch.cat([g.flatten(0, 1) for g in gxs], dim=0) if gxs else xT.new_zeros(0, num)
        return gx, cg @ gts

    def _split_input(self, xT: torch.Tensor) -> List[torch.Tensor]:
        """``[irreps_in.dim, C]`` to ``[U_a, 2l_a+1, C]`` views."""
        sizes = [mul * (2 * l + 1) for mul, l, _ in self._in]
        return [p.reshape(mul, 2 * l + 1, xT.shape[1]) for p, (mul, l, _) in zip(xT.split(sizes, dim=0), self._in)]

    def _split_steps(self, ts: torch.Tensor) -> List[torch.Tensor]:
        """``[cg columns, C]`` to ``[2l_a+1, cols, C]`` per step."""
        parts = ts.split([s.dim_a * s.cols for s in self._steps], dim=0)
        return [t.view(s.dim_a, s.cols, ts.shape[1]) for t, s in zip(parts, self._steps)]

    def _contract(
        self,
        t: int,
        ys: List[Optional[torch.Tensor]],
        w: Optional[torch.Tensor] = None,
        factors: Optional[Tuple[torch.Tensor, torch.Tensor, List[Optional[torch.Tensor]]]] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        r"""Step 3 for output ``t``: ``[dim, C]`` from :math:`y` and the weights.

        .. math:: z_{w, m} = \sum_k w_{k, w}\, y_{k, m}

        The weights are ``w`` ``[weight_numel[t], C]``, or ``factors`` :math:`(h^T, L)`
        (``[hidden, C]``, ``[hidden, weight_numel[t]]``, :math:`w = L^T h^T`) with
        :meth:`_outer_weights` of :math:`L`, formed one block at a time, or for the blocks of
        :meth:`_outer_form` never formed:
        :math:`z_{w, m} = \sum_{h, k} L_{h, k, w}\, (h_h\, y_{k, m})`, one matrix product.
        Written into ``out`` when given (no autograd), else built with differentiable operations.
        """
        like = w if w is not None else factors[0]
        num = like.shape[1]
        zs = []
        for i, blk in enumerate(self._blocks[t]):
            y = ys[blk.g]
            target = None
            if out is not None and len(blk.members) == 1:  # write straight into the output rows
                row = blk.members[0][2]
                target = out[row : row + blk.width * blk.dim_l].view(blk.width, blk.dim_l, num)
            if y is None:
                zs.append(like.new_zeros(blk.width, blk.dim_l, num) if target is None else target.zero_())
            elif factors is not None and factors[2][i] is not None:
                z = torch.mm(factors[2][i], _outer(factors[0], y), out=None if target is None else target.view(blk.width, -1))
                zs.append(z.view(blk.width, blk.dim_l, num))
            else:
                wg = self._block_weights(t, i, w, factors)
                zs.append(_product_sum(wg.reshape(blk.k, blk.width, 1, num), y[:, None], 0, target))
        if out is None:
            pieces = [zs[i][start : start + mul].flatten(0, 1) for i, start, mul in self._pieces[t]]
            return torch.cat(pieces, dim=0) if pieces else like.new_zeros(0, num)
        for blk, z in zip(self._blocks[t], zs):
            if len(blk.members) > 1:
                for mul, start, row in blk.members:
                    out[row : row + mul * blk.dim_l] = z[start : start + mul].flatten(0, 1)
        return out

    def _contract_backward(
        self, t: int, ys: List[Optional[torch.Tensor]], gout: torch.Tensor,
        factors: Tuple[torch.Tensor, torch.Tensor, List[Optional[torch.Tensor]]],
        gh: torch.Tensor, gl: torch.Tensor, gys: List[Optional[torch.Tensor]], first: List[bool],
    ) -> None:
        """Gradients of step 3 with factored weights: writes ``gh`` ``[hidden, C]``, adds to ``gl`` and to ``gys``.

        ``first[g]``: ``gys[g]`` is still to be overwritten rather than added to. ``gys`` of None: the
        gradients of :math:`y` are not needed (neither ``x`` nor ``sh`` requires a gradient).
        """
        hT, lin, outer_weights = factors
        gh.zero_()
        for i, blk in enumerate(self._blocks[t]):
            y, gy_out = ys[blk.g], (gys[blk.g] if gys is not None else None)
            if y is None:
                continue
            gz = self._block_gradient(blk, gout)
            cols = slice(self._block_offsets[t][i], self._block_offsets[t][i] + blk.k * blk.width)
            weights = outer_weights[i]  # [W, h K] or None
            if weights is not None:
                hidden = hT.shape[0]
                outer = _outer(hT, y)  # [h K, (2l+1) C]
                gz = gz.flatten(1)
                gl[:, cols] += (gz @ outer.T).view(blk.width, hidden, blk.k).permute(1, 2, 0).reshape(hidden, -1)
                g_outer = (weights.T @ gz).view(hidden, blk.k, blk.dim_l, -1)
                gh += (g_outer * y).sum((1, 2))
                if gy_out is None:
                    continue
                gy = (g_outer * hT[:, None, None]).sum(0)
            else:
                num = hT.shape[1]
                wg = self._block_weights(t, i, None, factors).view(blk.k, blk.width, 1, num)
                gwg = torch.empty_like(wg[:, :, 0])
                if blk.dim_l == 1 or blk.k * blk.width * blk.dim_l * num <= _PRODUCT_FLOATS:
                    torch.sum(y[:, None] * gz, dim=2, out=gwg)
                else:  # one component m at a time: temporaries no larger than the weights
                    torch.mul(y[:, None, 0], gz[None, :, 0], out=gwg)
                    for m in range(1, blk.dim_l):
                        gwg.addcmul_(y[:, None, m], gz[None, :, m])
                gwg = gwg.flatten(0, 1)
                gh.addmm_(lin[:, cols], gwg)
                gl[:, cols].addmm_(hT, gwg.T)
                if gy_out is None:
                    continue
                gy = _product_sum(wg, gz, 1, gy_out if first[blk.g] else None)
            if first[blk.g]:
                if gy is not gy_out:
                    gy_out.copy_(gy)
                first[blk.g] = False
            else:
                gy_out += gy

    def _outer_form(self, blk: _Block, hidden: int) -> bool:
        r"""Whether block ``blk`` is contracted through :math:`h \otimes y` (measured faster for scalar outputs
        at least half as wide as the hidden layer: one matrix product less in the backward, no weights)."""
        return blk.dim_l == 1 and hidden <= 2 * blk.width

    def _block_weights(self, t, i, w, factors) -> torch.Tensor:
        """The weights ``[K W, C]`` of block ``i`` of output ``t``: a slice of ``w``, or :math:`L^T h^T`."""
        start, size = self._block_offsets[t][i], self._block_numel[t][i]
        if w is not None:
            return w[start : start + size]
        hT, lin = factors[:2]
        return lin[:, start : start + size].T @ hT

    def _outer_weights(self, t: int, lin: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """Per block of output ``t``: :math:`L` ``[hidden, weight_numel[t]]`` as ``[W, hidden K]`` for the blocks
        of :meth:`_outer_form`, else None."""
        hidden, out = lin.shape[0], []
        for blk, start in zip(self._blocks[t], self._block_offsets[t]):
            block = lin[:, start : start + blk.k * blk.width].reshape(hidden, blk.k, blk.width)
            out.append(block.permute(2, 0, 1).reshape(blk.width, -1) if self._outer_form(blk, hidden) else None)
        return out

    def _block_gradient(self, blk: _Block, gout: torch.Tensor) -> torch.Tensor:
        """The rows of the output gradient ``[dim, C]`` that belong to ``blk``, as ``[width, 2l+1, C]``."""
        num = gout.shape[1]
        parts = [gout[row : row + mul * blk.dim_l].reshape(mul, blk.dim_l, num) for mul, _, row in blk.members]
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _product_sum(a: torch.Tensor, b: torch.Tensor, dim: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(a * b).sum(dim)`` of operands ``[..., 2l+1, C]``; into ``out`` one component at a time if the product is large."""
    if out is None or _broadcast_numel(a.shape, b.shape) <= _PRODUCT_FLOATS:
        return torch.sum(a * b, dim=dim, out=out)
    for m in range(out.shape[-2]):
        a_m, b_m = (x.narrow(-2, m if x.shape[-2] > 1 else 0, 1) for x in (a, b))
        torch.sum(a_m * b_m, dim=dim, out=out.narrow(-2, m, 1))
    return out


def _plain_operations_only(device_type: str) -> bool:
    """Whether autocast or a ``torch.func`` transform is active: the hand-written backward supports neither."""
    return torch.is_autocast_enabled(device_type) or torch._C._are_functorch_transforms_active()


def _broadcast_numel(a: torch.Size, b: torch.Size) -> int:
    """Number of elements of the broadcast of shapes ``a`` and ``b`` (``torch.broadcast_shapes`` is slow in a hot loop)."""
    if len(a) < len(b):
        a, b = b, a
    b = (1,) * (len(a) - len(b)) + tuple(b)
    return math.prod(max(x, y) for x, y in zip(a, b))


def _outer(hT: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r""":math:`h_h\, y_{k, m}` as ``[hidden K, (2l+1) C]``, from ``hT`` ``[hidden, C]`` and ``y`` ``[K, 2l+1, C]``."""
    return (hT[:, None, None] * y).flatten(0, 1).flatten(1)


def _chunks(num: int, size: int) -> List[slice]:
    """Consecutive slices of at most ``size`` covering ``range(num)``."""
    return [slice(start, min(start + size, num)) for start in range(0, num, size)]


# ---------------------------------------------------------------------- forward_factored as an operator
# ``e3attn::factored_product`` and its backward are custom operators: eager mode and ``torch.compile``
# (to which they are opaque calls with known output shapes) run the same chunked code. They receive the
# irreps as a string and the Clebsch-Gordan constant as a tensor (on the inputs' device, in their dtype);
# the rest of the structure comes from ``_structure``.

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


@torch.library.custom_op("e3attn::factored_product", mutates_args=())
def _factored_product(spec: str, chunk: int, index: Optional[torch.Tensor], x: torch.Tensor, sh: torch.Tensor,
                      cg: torch.Tensor, factors: List[torch.Tensor]) -> List[torch.Tensor]:
    """:meth:`SphericalTensorProduct.forward_factored` (``factors``: the hidden, then the linear), chunked.

    Steps 1-2 (few operations, small per sample) run on outer chunks of ``_OUTER`` inner chunks;
    the weights and step 3 (many floats per sample) on inner chunks that stay in cache.
    """
    tp = _structure(spec)
    n, num = len(tp.irreps_outs), sh.shape[0]
    chunk = chunk or tp.default_chunk_size(sh.device)
    xT, shT = x.T.contiguous(), sh.T.contiguous()
    hT = [h.T.contiguous() for h in factors[:n]]
    outs = [xT.new_empty(out.dim, num) for out in tp.irreps_outs]
    outer_weights = [tp._outer_weights(t, w) for t, w in enumerate(factors[n:])]
    for outer in _chunks(num, chunk * _OUTER):
        _, ys = tp._products(_columns(xT, outer, index), shT[:, outer], cg)
        for inner in _chunks(outer.stop - outer.start, chunk):
            cols = slice(outer.start + inner.start, outer.start + inner.stop)
            ys_c = [y[..., inner] if y is not None else None for y in ys]
            for t, (h, w) in enumerate(zip(hT, factors[n:])):
                tp._contract(t, ys_c, factors=(h[:, cols], w, outer_weights[t]), out=outs[t][:, cols])
    return [out.T.contiguous() for out in outs]


@_factored_product.register_fake
def _(spec, chunk, index, x, sh, cg, factors):
    return [sh.new_empty(sh.shape[0], out.dim) for out in _structure(spec).irreps_outs]


@torch.library.custom_op("e3attn::factored_product_backward", mutates_args=())
def _factored_product_backward(spec: str, chunk: int, index: Optional[torch.Tensor], x: torch.Tensor,
                               sh: torch.Tensor, cg: torch.Tensor, factors: List[torch.Tensor],
                               grads: List[torch.Tensor], inputs_needed: bool) -> List[torch.Tensor]:
    """The gradients of ``x`` and ``sh`` (empty unless ``inputs_needed``) and of every factor.

    Hand-written and chunked like the forward, recomputing every intermediate chunk by chunk.
    """
    tp = _structure(spec)
    n, num = len(tp.irreps_outs), sh.shape[0]
    chunk = chunk or tp.default_chunk_size(sh.device)
    hidden, linear = factors[:n], factors[n:]
    xT, shT = x.T.contiguous(), sh.T.contiguous()
    hT = [h.T.contiguous() for h in hidden]
    gT = [g.T.contiguous() for g in grads]
    if inputs_needed:  # steps 1-2 backward
        gx = torch.zeros_like(xT) if index is not None else x.new_empty(x.shape[1], num)  # [D, N] or [D, E]
        gsh = sh.new_empty(sh.shape[1], num)
    ghs = [h.new_empty(h.shape[1], num) for h in hidden]
    gls = [torch.zeros_like(w) for w in linear]
    outer_weights = [tp._outer_weights(t, w) for t, w in enumerate(linear)]
    for outer in _chunks(num, chunk * _OUTER):
        xc = _columns(xT, outer, index)
        ts, ys = tp._products(xc, shT[:, outer], cg)
        gys = [torch.empty_like(y) if y is not None else None for y in ys] if inputs_needed else None
        for inner in _chunks(outer.stop - outer.start, chunk):
            cols = slice(outer.start + inner.start, outer.start + inner.stop)
            ys_c = [y[..., inner] if y is not None else None for y in ys]
            gys_c = [g[..., inner] if g is not None else None for g in gys] if inputs_needed else None
            first = [True] * len(ys)
            for t, (h, w) in enumerate(zip(hT, linear)):
                factors_c = (h[:, cols], w, outer_weights[t])
                tp._contract_backward(t, ys_c, gT[t][:, cols], factors_c, ghs[t][:, cols], gls[t], gys_c, first)
            for g, unused in zip(gys_c or [], first):
                if g is not None and unused:
                    g.zero_()
        if not inputs_needed:
            continue
        gxc, gsh[:, outer] = tp._products_backward(xc, ts, gys, cg)
        if index is None:
            gx[:, outer] = gxc
        else:
            gx.index_add_(1, index[outer], gxc)
    # the samples-last buffers as transposed views: the layout that ``register_fake`` declares
    inputs = [gx.T, gsh.T] if inputs_needed else [x.new_empty(0), x.new_empty(0)]
    return [*inputs, *[g.T for g in ghs], *gls]


@_factored_product_backward.register_fake
def _(spec, chunk, index, x, sh, cg, factors, grads, inputs_needed):
    n = len(factors) // 2
    inputs = [x, sh] if inputs_needed else []
    samples_last = [t.new_empty(t.shape[1], t.shape[0]).T for t in (*inputs, *factors[:n])]
    empty = [x.new_empty(0) for _ in range(2 - len(inputs))]
    return empty + samples_last + [w.new_empty(w.shape) for w in factors[n:]]


def _setup_context(ctx, inputs, output) -> None:
    spec, chunk, index, x, sh, cg, factors = inputs
    ctx.spec, ctx.chunk = spec, chunk
    ctx.save_for_backward(index, x, sh, cg, *factors)
    # output t depends on x, sh and its own hidden[t], linear[t] only
    n = len(output)
    shared = x.requires_grad or sh.requires_grad
    ctx.mark_non_differentiable(*[out for out, h, w in zip(output, factors[:n], factors[n:])
                                  if not (shared or h.requires_grad or w.requires_grad)])


def _backward(ctx, grads: List[Optional[torch.Tensor]]):
    index, x, sh, cg, *factors = ctx.saved_tensors
    needed = [ctx.needs_input_grad[3], ctx.needs_input_grad[4], *ctx.needs_input_grad[6]]
    tp = _structure(ctx.spec)
    if torch.is_grad_enabled():  # create_graph: differentiate the plain formulation, twice differentiable
        found = _plain_gradients(tp, index, x, sh, cg, factors, grads, needed)
    else:
        grads = [g if g is not None else sh.new_zeros(sh.shape[0], out.dim) for g, out in zip(grads, tp.irreps_outs)]
        found = _factored_product_backward(ctx.spec, ctx.chunk, index, x, sh, cg, factors, grads,
                                           needed[0] or needed[1])
        found = [g if need else None for g, need in zip(found, needed)]
    return None, None, None, found[0], found[1], None, list(found[2:])


_factored_product.register_autograd(_backward, setup_context=_setup_context)


def _columns(xT: torch.Tensor, cols: slice, index: Optional[torch.Tensor]) -> torch.Tensor:
    """Columns ``cols`` of ``xT`` (samples last), or the columns ``index[cols]``."""
    return xT[:, cols] if index is None else xT.index_select(1, index[cols])


def _plain_gradients(tp, index, x, sh, cg, factors, grads, needed) -> Tuple[Optional[torch.Tensor], ...]:
    """Gradients of ``forward_factored`` through plain autograd, differentiable for higher derivatives."""
    n = len(tp.irreps_outs)
    inputs = (x, sh, *factors)
    wanted = [t for t, need in zip(inputs, needed) if need]
    outs = tp._forward_plain(x, sh, factors[:n], factors[n:], index, cg)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if not pairs:  # no output depends on an input that needs a gradient
        return tuple(None for _ in needed)
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                     allow_unused=True))
    return tuple(next(found) if need else None for need in needed)
