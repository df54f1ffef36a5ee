r"""Fully connected tensor product of node features with spherical harmonics, per-edge weights."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from e3nn import o3

from ._constants import Float64ConstantsModule
from ._irreps import IrrepsLike, as_irreps, entries, split_entries

__all__ = ["SphericalTensorProduct"]


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
    normalisations, computed differently:

    1. one matrix product contracts :math:`Y` with every Clebsch-Gordan block,
    2. one batched product per (input irrep, output degree) applies it to :math:`x`,
    3. one batched product per output degree applies the weights of *all*
       outputs :math:`t` of that degree together (keys and values share steps 1-2).

    The weights of an output are ordered, per output irrep, as a
    ``[K_c, W_c]`` block with rows ordered by (input irrep :math:`a`, channel
    :math:`u`, harmonic :math:`b`).

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
        if any(mul != 1 for mul, _ in self.irreps_sh):
            raise ValueError(f"irreps_sh must have multiplicity 1 everywhere, got {self.irreps_sh}")
        self._in = entries(self.irreps_in)
        sh = [(l, p) for _, (l, p) in self.irreps_sh]
        sh_offsets = [sum(2 * lb + 1 for lb, _ in sh[:b]) for b in range(len(sh))]

        # degrees (l, p) reachable from x (x) Y, in order of first appearance among the outputs
        self._groups: List[Tuple[int, int]] = []
        for out in self.irreps_outs:
            for _, l, p in entries(out):
                if (l, p) not in self._groups:
                    self._groups.append((l, p))
        # paths[g][a] = harmonics b with a (x) b -> g
        paths = [
            [[b for b, (lb, pb) in enumerate(sh) if pa * pb == p and abs(la - lb) <= l <= la + lb] for _, la, pa in self._in]
            for l, p in self._groups
        ]
        self._k = [sum(mul * len(bs) for (mul, _, _), bs in zip(self._in, paths[g])) for g in range(len(self._groups))]

        # Step 1 constant: [sh_dim, sum over (a, g) of (2la+1) * n_ag * (2l+1)], float64
        blocks, self._t_sizes, self._steps = [], [], []
        for a, (mul, la, _) in enumerate(self._in):
            for g, (l, _) in enumerate(self._groups):
                bs = paths[g][a]
                if not bs:
                    continue
                block = torch.zeros(self.irreps_sh.dim, 2 * la + 1, len(bs), 2 * l + 1, dtype=torch.float64)
                norm = math.sqrt((2 * l + 1) / self._k[g])
                for n, b in enumerate(bs):
                    lb = sh[b][0]
                    cg = o3.wigner_3j(la, lb, l, dtype=torch.float64)  # [2la+1, 2lb+1, 2l+1]
                    block[sh_offsets[b] : sh_offsets[b] + 2 * lb + 1, :, n, :] = norm * cg.transpose(0, 1)
                blocks.append(block.reshape(self.irreps_sh.dim, -1))
                self._t_sizes.append(block[0].numel())
                self._steps.append((a, g, 2 * la + 1, len(bs) * (2 * l + 1), mul * len(bs), 2 * l + 1))
        cg_all = torch.cat(blocks, dim=1) if blocks else torch.zeros(self.irreps_sh.dim, 0, dtype=torch.float64)
        self.register_constant("cg", cg_all)

        # weights: per output t, per output irrep c: [K_g, W_c]
        self._out_entries = [entries(out) for out in self.irreps_outs]
        self.weight_numel = [
            sum(self._k[self._groups.index((l, p))] * mul for mul, l, p in ents) for ents in self._out_entries
        ]
        # per group g: the (t, c) entries it feeds, in order
        self._group_members: Dict[int, List[Tuple[int, int]]] = {g: [] for g in range(len(self._groups))}
        for t, ents in enumerate(self._out_entries):
            for c, (_, l, p) in enumerate(ents):
                self._group_members[self._groups.index((l, p))].append((t, c))

    def forward(self, x: torch.Tensor, sh: torch.Tensor, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        num = x.shape[0]
        xs = split_entries(x, self._in)
        # 1. contract the harmonics with the Clebsch-Gordan blocks
        ts = (sh @ self.cg.to(sh.dtype)).split(self._t_sizes, dim=1)
        # 2. apply to the input channels: y[g] = [E, K_g, 2l+1]
        ys: List[List[torch.Tensor]] = [[] for _ in self._groups]
        for t, (a, g, da, cols, k_ag, dl) in zip(ts, self._steps):
            ys[g].append(torch.bmm(xs[a], t.reshape(num, da, cols)).reshape(num, k_ag, dl))
        # 3. apply the weights of every output of that degree at once
        w_split = [
            w.split([self._k[self._groups.index((l, p))] * mul for mul, l, p in ents], dim=1)
            for w, ents in zip(weights, self._out_entries)
        ]
        outs: List[List[torch.Tensor]] = [[x.new_zeros(0)] * len(ents) for ents in self._out_entries]
        for g, members in self._group_members.items():
            muls = [self._out_entries[t][c][0] for t, c in members]
            if not ys[g]:
                for (t, c), mul in zip(members, muls):
                    outs[t][c] = x.new_zeros(num, mul * (2 * self._groups[g][0] + 1))
                continue
            y = torch.cat(ys[g], dim=1) if len(ys[g]) > 1 else ys[g][0]
            w = [w_split[t][c].reshape(num, self._k[g], mul) for (t, c), mul in zip(members, muls)]
            w = torch.cat(w, dim=2) if len(w) > 1 else w[0]
            z = torch.bmm(w.transpose(1, 2), y)  # [E, sum W_c, 2l+1]
            for (t, c), part, mul in zip(members, z.split(muls, dim=1), muls):
                outs[t][c] = part.reshape(num, mul * y.shape[2])
        return [torch.cat(o, dim=1) if o else x.new_zeros(num, 0) for o in outs]

    def e3nn_weight_index(self, t: int) -> torch.Tensor:
        r"""Index ``i`` such that ``weights[t] = w_e3nn[:, i]`` for e3nn's ``FullyConnectedTensorProduct``.

        e3nn orders its weights by instruction ``(a, b, c)`` (input, harmonic,
        output irrep) with a ``[U_a, 1, W_c]`` block each; this maps them to the
        layout used here, so that results can be compared with e3nn.
        """
        sh = [(l, p) for _, (l, p) in self.irreps_sh]
        ents = self._out_entries[t]
        # e3nn offsets of each instruction (a, b, c)
        e3nn_offset, pos = {}, 0
        for a, (mul_a, la, pa) in enumerate(self._in):
            for b, (lb, pb) in enumerate(sh):
                for c, (mul_c, l, p) in enumerate(ents):
                    if pa * pb == p and abs(la - lb) <= l <= la + lb:
                        e3nn_offset[(a, b, c)] = pos
                        pos += mul_a * mul_c
        index = []
        for c, (mul_c, l, p) in enumerate(ents):
            rows = [
                (a, u, b)
                for a, (mul_a, la, pa) in enumerate(self._in)
                for u in range(mul_a)
                for b, (lb, pb) in enumerate(sh)
                if pa * pb == p and abs(la - lb) <= l <= la + lb
            ]
            for a, u, b in rows:
                for w in range(mul_c):
                    index.append(e3nn_offset[(a, b, c)] + u * mul_c + w)
        return torch.tensor(index, dtype=torch.long)
