r"""Pruning of attention graphs to their strongest edges."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from e3attn._checks import check_int, check_real
from e3attn.viz._inputs import edge_weights, infer_num_nodes

__all__ = ["sparsify"]


def _rank_within_dst(score: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Rank ``0, 1, ...`` of every edge among the edges of its ``dst``, by decreasing score.

    Ties keep the order of ``edge_index``.
    """
    by_score = torch.sort(score, descending=True, stable=True).indices
    order = by_score[torch.sort(dst[by_score], stable=True).indices]
    counts = torch.bincount(dst, minlength=num_nodes)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=dst.device) - first[dst[order]]
    return rank


def sparsify(
    edge_index: torch.Tensor,
    alpha: torch.Tensor,
    *,
    threshold: Optional[float] = None,
    top_k: Optional[int] = None,
    renormalize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Keep only the strongest attention edges.

    Edges are scored by their head-averaged weight :math:`w_e = \frac1H \sum_h \alpha_{eh}`
    and kept when :math:`w_e \ge` ``threshold`` and (with ``top_k``) :math:`e` is among
    the ``top_k`` highest-scoring edges entering its ``dst`` (ties broken by edge order);
    given both, an edge must pass both. With ``renormalize=True`` the kept weights of
    every node and head are rescaled to the total that node received before pruning,

    .. math::

        \alpha'_{eh} = \alpha_{eh} \,
        \frac{\sum_{e':\ \mathrm{dst}_{e'} = \mathrm{dst}_e} \alpha_{e'h}}
             {\sum_{e' \in \mathrm{kept}:\ \mathrm{dst}_{e'} = \mathrm{dst}_e} \alpha_{e'h}},

    so softmax attention stays normalised to 1 per query. A node and head whose kept
    weights are all zero keep zeros; a node whose edges are all dropped has none left.

    Args:
        edge_index: ``[2, E]`` integer tensor, rows ``(src, dst)``.
        alpha: ``[E]`` or ``[E, H]`` non-negative attention weights.
        threshold: minimum head-averaged weight of a kept edge.
        top_k: number of strongest edges kept per destination node, ``>= 0``.
        renormalize: rescale the kept weights as above (else return them unchanged).

    Returns:
        ``(edge_index [2, E'], alpha [E'] or [E', H])`` of the kept edges, in their original order.

    Example::

        >>> edge_index = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 1]])
        >>> alpha = torch.tensor([0.5, 0.3, 0.2, 1.0])
        >>> sparsify(edge_index, alpha, top_k=1)
        (tensor([[1, 0],
                [0, 1]]), tensor([1., 1.]))
    """
    if threshold is None and top_k is None:
        raise ValueError("sparsify needs threshold or top_k (or both), got neither")
    threshold = None if threshold is None else check_real(threshold, "threshold")
    top_k = None if top_k is None else check_int(top_k, "top_k")
    num_nodes = infer_num_nodes(edge_index, None)
    weights = edge_weights(edge_index, alpha, num_nodes)
    dst = edge_index[1].long()
    score = weights.mean(dim=1)
    keep = torch.ones_like(score, dtype=torch.bool)
    if threshold is not None:
        keep &= score >= threshold
    if top_k is not None:
        keep &= _rank_within_dst(score, dst, num_nodes) < top_k
    kept = weights[keep]
    if renormalize:
        total = weights.new_zeros(num_nodes, weights.shape[1]).index_add(0, dst, weights)
        remaining = weights.new_zeros(num_nodes, weights.shape[1]).index_add(0, dst[keep], kept)
        scale = torch.where(remaining > 0, total / remaining, torch.ones_like(total))
        kept = kept * scale[dst[keep]]
    return edge_index[:, keep], kept.reshape((-1,) + tuple(alpha.shape[1:]))
