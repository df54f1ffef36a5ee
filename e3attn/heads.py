r"""Attention heads: splitting irreps into heads and the per-head query-key dot product."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from e3nn import o3

from ._block_matrix import BlockMatrix
from ._checks import check_dtype, check_int
from ._irreps import IrrepsLike, as_irreps, entries, entry_starts, split_entries, starts

__all__ = ["split_heads", "head_index", "scale_heads", "head_dot", "head_outer", "head_sum", "MultiHeadDot"]


def split_heads(irreps: IrrepsLike, num_heads: int, name: str = "irreps") -> o3.Irreps:
    r"""Irreps of one head: every multiplicity divided by ``num_heads``.

    ``8x0e + 4x1o`` with 2 heads gives ``4x0e + 2x1o`` per head.

    Raises:
        ValueError: naming ``name`` when a multiplicity is not divisible by ``num_heads``.
    """
    irreps = as_irreps(irreps, name)
    num_heads = check_int(num_heads, "num_heads", 1)
    bad = [f"{mul}x{ir}" for mul, ir in irreps if mul % num_heads]
    if bad:
        raise ValueError(
            f"{name} = {irreps} cannot be split into {num_heads} heads: "
            f"the multiplicities of {', '.join(bad)} are not divisible by {num_heads}"
        )
    return o3.Irreps([(mul // num_heads, ir) for mul, ir in irreps])


def head_index(irreps: IrrepsLike, num_heads: int) -> torch.Tensor:
    r"""Head of every component of ``irreps`` (``LongTensor [irreps.dim]``).

    The channels of each irrep are split into ``num_heads`` contiguous blocks:
    channel :math:`u` of an irrep of multiplicity :math:`U` belongs to head
    :math:`\lfloor u H / U \rfloor`.
    """
    irreps = split_heads(irreps, num_heads)
    index = [
        torch.arange(num_heads).repeat_interleave(mul * ir.dim) for mul, ir in irreps
    ]
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.long)


def scale_heads(x: torch.Tensor, weight: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    r"""Multiply every channel of ``x`` by the weight of its head, without expanding the weights.

    .. math:: y_{e, c} = w_{e, h(c)}\, x_{e, c}

    with :math:`h(c)` the head of channel :math:`c` (:func:`head_index`): ``x``
    is a concatenation of irreps of sizes ``sizes`` (``mul * (2l + 1)``), each
    split into ``H`` contiguous blocks, one per head.

    Args:
        x: ``[E, sum(sizes)]``.
        weight: ``[E, H]``.
        sizes: the dimensions of the irreps of ``x`` (``mul * (2l + 1)``, ``mul`` divisible by ``H``).

    Returns:
        ``[E, sum(sizes)]``.

    Example::

        >>> scale_heads(torch.ones(1, 10), torch.tensor([[1.0, 2.0]]), [4, 6])
        tensor([[1., 1., 2., 2., 1., 1., 1., 2., 2., 2.]])
    """
    num, heads = weight.shape
    if heads == 1:
        return x * weight
    parts = [(p.reshape(num, heads, size // heads) * weight[:, :, None]).reshape(num, size)
             for p, size in zip(x.split(list(sizes), dim=1), sizes)]
    return torch.cat(parts, dim=1) if parts else x * 0


def head_dot(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    r"""Per head, the dot product of a block of ``t`` with ``h``: :math:`s_{e, a} = \sum_k t_{e, a K + k}\, h_{e, k}`.

    With :func:`head_outer` and :func:`head_sum` these are the three contractions of the trilinear form
    :math:`\sum_{e, a, k} t_{e, a K + k}\, b_{e, a}\, h_{e, k}` (each is the others' derivative): the heads'
    logits and values of :class:`~e3attn.node_contraction.NodeContraction`.

    Args:
        t: ``[E, heads * K]``; h: ``[E, K]``.

    Returns:
        ``[E, heads]``.

    Example::

        >>> t, h = torch.randn(5, 6), torch.randn(5, 3)
        >>> bool(torch.allclose(head_dot(t, h)[:, 1], (t[:, 3:] * h).sum(1)))
        True
    """
    return (t.reshape(t.shape[0], t.shape[1] // h.shape[1], h.shape[1]) * h[:, None, :]).sum(-1)


def head_outer(b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    r"""Every head's weight times ``h``: :math:`t_{e, a K + k} = b_{e, a}\, h_{e, k}`, ``b [E, heads]``,
    ``h [E, K]`` to ``[E, heads * K]`` (see :func:`head_dot`).

    Example::

        >>> b, h = torch.randn(5, 2), torch.randn(5, 3)
        >>> bool(torch.allclose(head_outer(b, h)[:, 3:], b[:, 1:] * h))
        True
    """
    return (b[:, :, None] * h[:, None, :]).reshape(h.shape[0], b.shape[1] * h.shape[1])


def head_sum(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    r"""The blocks of ``t`` summed over the heads with the weights ``b``: :math:`h_{e, k} = \sum_a b_{e, a}\,
    t_{e, a K + k}`, ``b [E, heads]``, ``t [E, heads * K]`` to ``[E, K]`` (see :func:`head_dot`).

    Example::

        >>> b, t = torch.randn(5, 2), torch.randn(5, 6)
        >>> bool(torch.allclose(head_sum(b, t), b[:, :1] * t[:, :3] + b[:, 1:] * t[:, 3:]))
        True
    """
    return (b[:, :, None] * t.reshape(t.shape[0], b.shape[1], t.shape[1] // b.shape[1])).sum(1)


class MultiHeadDot(torch.nn.Module):
    r"""Learned, per-head scalar product of queries and keys (e3nn's ``FullyConnectedTensorProduct(q, k, "0e")`` per head).

    For head :math:`h`, with :math:`a` running over the irreps of the head's
    query and :math:`b` over those of its key that are the same irrep :math:`l`:

    .. math::

        s_h = \frac{1}{\sqrt{P_h}} \sum_{(a, b)} \sum_{u, v} W^{(h, ab)}_{uv}\,
              \sum_{m} C^{l l 0}_{mm0}\ q_{h, a, u, m}\, k_{h, b, v, m}

    with :math:`C^{ll0}_{mm0} = \pm 1/\sqrt{2l+1}` e3nn's Wigner 3j symbol and
    :math:`P_h = \sum_{(a, b)} U_a V_b` the number of weights of the head.
    The weights act on the queries per node (cheap; for small irreps as one dense matrix product,
    like :class:`~e3attn.linear.IrrepsLinear`), then one elementwise product per edge gives the logits.

    Args:
        irreps_query: query irreps (all heads).
        irreps_key: key irreps (all heads).
        num_heads: number of heads :math:`H`.

    Shapes:
        :meth:`project_query`: ``[N, irreps_query.dim]`` to ``[N, H, D]``;
        :meth:`key_heads`: ``[E, irreps_key.dim]`` to ``[E, H, D]``, with
        ``D = irreps_key.dim // H``; the logits are ``(q[dst] * k).sum(-1)``.

    Example::

        >>> dot = MultiHeadDot("8x0e + 4x1o", "4x0e + 2x1o", num_heads=2)
        >>> q, k = dot.project_query(torch.randn(3, 20)), dot.key_heads(torch.randn(5, 10))
        >>> (q[torch.tensor([0, 0, 1, 2, 2])] * k).sum(-1).shape
        torch.Size([5, 2])
    """

    def __init__(self, irreps_query: IrrepsLike, irreps_key: IrrepsLike, num_heads: int = 1) -> None:
        super().__init__()
        self.num_heads = num_heads = check_int(num_heads, "num_heads", 1)
        self.irreps_query = as_irreps(irreps_query, "irreps_query")
        self.irreps_key = as_irreps(irreps_key, "irreps_key")
        self._q = entries(self.irreps_query)
        self._k = entries(self.irreps_key)
        split_heads(self.irreps_query, num_heads, "irreps_query")
        split_heads(self.irreps_key, num_heads, "irreps_key")
        self._paths = [
            (a, b)
            for a, (_, la, pa) in enumerate(self._q)
            for b, (_, lb, pb) in enumerate(self._k)
            if (la, pa) == (lb, pb)
        ]
        self._sizes = [(self._q[a][0] // num_heads) * (self._k[b][0] // num_heads) for a, b in self._paths]
        numel = sum(self._sizes)
        self.weight = torch.nn.Parameter(torch.randn(num_heads, numel))
        # e3nn: sqrt(1 / number of weights) times the Wigner 3j symbol C^{l l 0}_{m m 0}
        self._coeff = [
            float(o3.wigner_3j(self._q[a][1], self._q[a][1], 0, dtype=torch.float64)[0, 0, 0]) / math.sqrt(numel)
            for a, _ in self._paths
        ]
        # the same map as one [query dim, H D] matrix: head h reads its channels of every query block and writes the
        # h-th row of the [H, D] layout of the keys (see key_heads)
        q_starts, k_starts = entry_starts(self._q), entry_starts(self._k)
        self._head_dim = head_dim = self.irreps_key.dim // num_heads
        self._matrix = BlockMatrix(self.irreps_query.dim, self.irreps_key.dim, [
            (h * numel + offset, self._q[a][0] // num_heads, self._k[b][0] // num_heads, 2 * self._q[a][1] + 1,
             q_starts[a] + h * (self._q[a][0] // num_heads) * (2 * self._q[a][1] + 1),
             h * head_dim + k_starts[b] // num_heads, c)
            for h in range(num_heads) for offset, (a, b), c in zip(starts(self._sizes), self._paths, self._coeff)])

    def project_query(self, q: torch.Tensor) -> torch.Tensor:
        """Apply the weights to the queries, in the layout of :meth:`key_heads`."""
        check_dtype(q, "q", self.weight.dtype, "the module")
        n, h = q.shape[0], self.num_heads
        if self._matrix.dense:  # small irreps: one matrix product (e3attn._block_matrix); q's dtype under autocast
            return (q @ self._matrix.matrix(self.weight)).to(q.dtype).view(n, h, self._head_dim)
        qs = [x.reshape(n, h, x.shape[1] // h, x.shape[2]) for x in split_entries(q, self._q)]
        outs = [q.new_zeros(n, h, mul // h, 2 * l + 1) for mul, l, _ in self._k]
        for (a, b), w, c in zip(self._paths, self.weight.split(self._sizes, dim=1), self._coeff):
            w = w.reshape(h, self._q[a][0] // h, self._k[b][0] // h) * c
            outs[b] = outs[b] + torch.einsum("nhum,huv->nhvm", qs[a], w)
        return self._flat(outs, q)

    def key_heads(self, k: torch.Tensor) -> torch.Tensor:
        """Rearrange keys ``[E, irreps_key.dim]`` to ``[E, H, D]``."""
        e, h = k.shape[0], self.num_heads
        ks = [x.reshape(e, h, x.shape[1] // h, x.shape[2]) for x in split_entries(k, self._k)]
        return self._flat(ks, k)

    def _flat(self, parts, like: torch.Tensor) -> torch.Tensor:
        if not parts:
            return like.new_zeros(like.shape[0], self.num_heads, 0)
        return torch.cat([p.flatten(2) for p in parts], dim=2)
