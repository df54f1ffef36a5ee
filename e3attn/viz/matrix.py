r"""Dense attention matrices and attention rollout across layers.

Convention used throughout :mod:`e3attn.viz`: an edge ``(src, dst)`` of ``edge_index``
carries the weight :math:`\alpha_{e}` with which node ``dst`` (the query) attends to
node ``src`` (the key). In matrix form the weight sits in row ``dst``, column ``src``,
so that a layer computes :math:`f'_i = \sum_j A_{ij} v_j`.
"""
from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch

from e3attn.viz._inputs import check_num_nodes, edge_weights

__all__ = ["attention_matrix", "attention_rollout"]


def attention_matrix(edge_index: torch.Tensor, alpha: torch.Tensor, num_nodes: int) -> torch.Tensor:
    r"""Scatter per-edge attention weights into one dense matrix per head.

    .. math::

        A^{(h)}_{ij} = \sum_{e:\ \mathrm{dst}_e = i,\ \mathrm{src}_e = j} \alpha_{e h}

    Row :math:`i` is the query (destination) node, column :math:`j` the key (source)
    node; duplicate edges are summed, so row :math:`i` sums to the total weight node
    :math:`i` receives (1 for softmax attention over a non-empty neighbourhood).

    Args:
        edge_index: ``[2, E]`` integer tensor, rows ``(src, dst)``.
        alpha: ``[E]`` (one head) or ``[E, H]`` non-negative attention weights.
        num_nodes: number of nodes ``N``.

    Returns:
        ``[H, N, N]`` tensor (``H = 1`` for a 1-D ``alpha``) on the device and dtype of ``alpha``.

    Example::

        >>> edge_index = torch.tensor([[1, 2, 0], [0, 0, 1]])
        >>> attention_matrix(edge_index, torch.tensor([0.25, 0.75, 1.0]), 3)[0]
        tensor([[0.0000, 0.2500, 0.7500],
                [1.0000, 0.0000, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    num_nodes = check_num_nodes(num_nodes)
    weights = edge_weights(edge_index, alpha, num_nodes)
    src, dst = edge_index.long()
    out = weights.new_zeros(weights.shape[1], num_nodes * num_nodes)
    return out.index_add(1, dst * num_nodes + src, weights.t()).view(weights.shape[1], num_nodes, num_nodes)


def _layer(item: object, position: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index, alpha)`` of one layer, given as a pair or as a record with those fields."""
    if hasattr(item, "edge_index") and hasattr(item, "alpha"):
        return item.edge_index, item.alpha
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise ValueError(
        f"attentions[{position}] must be an (edge_index, alpha) pair or a record with edge_index and alpha fields, "
        f"got {type(item).__name__}"
    )


def rollout_steps(attentions: Sequence[object], num_nodes: int, residual: bool = True) -> Iterator[torch.Tensor]:
    """Yield the rollout after each layer; see :func:`attention_rollout`."""
    num_nodes = check_num_nodes(num_nodes)
    layers = []
    for position, item in enumerate(attentions):
        edge_index, alpha = _layer(item, position)
        weights = edge_weights(edge_index, alpha, num_nodes, name=f"attentions[{position}] alpha")
        layers.append((edge_index.long(), weights.mean(dim=1)))
    dtype = torch.float32
    for _, weight in layers:
        dtype = torch.promote_types(dtype, weight.dtype)
    device = layers[0][1].device if layers else None
    rollout = torch.eye(num_nodes, dtype=dtype, device=device)
    for edge_index, weight in layers:
        weight = weight.to(dtype)
        # A[dst, src] as a sparse matrix: A @ rollout costs O(E N) and never builds a dense A.
        sparse = torch.sparse_coo_tensor(edge_index.flip(0), weight, (num_nodes, num_nodes), check_invariants=False)
        mixed = torch.sparse.mm(sparse, rollout)
        row_sum = rollout.new_zeros(num_nodes).index_add(0, edge_index[1], weight)
        if residual:
            mixed = 0.5 * mixed + 0.5 * rollout
            row_sum = 0.5 * row_sum + 0.5
        rollout = mixed / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum)).unsqueeze(1)
        yield rollout


def attention_rollout(attentions: Sequence[object], num_nodes: int, *, residual: bool = True) -> torch.Tensor:
    r"""Attention rollout (Abnar & Zuidema, 2020) through a stack of attention layers.

    Every layer :math:`l` contributes its head-averaged matrix :math:`A_l`
    (:func:`attention_matrix`, mean over heads). With ``residual=True`` it is mixed
    with the identity to account for the skip connection, then rows are renormalised:

    .. math::

        \tilde A_l = \tfrac12 A_l + \tfrac12 I, \qquad
        A'_l = D_l^{-1} \tilde A_l,\quad (D_l)_{ii} = \sum_j (\tilde A_l)_{ij}, \qquad
        R = A'_L A'_{L-1} \cdots A'_1

    (``residual=False`` uses :math:`\tilde A_l = A_l`). :math:`R_{ij}` is how much of the
    input of node :math:`j` reaches the output of node :math:`i`; rows sum to 1,
    except, with ``residual=False``, for nodes that attend to nothing, whose rows stay
    zero. Every product :math:`A'_l R` is computed from the sparse edge list, so the
    cost is :math:`O(E N)` per layer; only the result is dense. Layers may use different
    graphs and numbers of heads. An empty list gives the identity.

    Args:
        attentions: per layer, in the order they run, an ``(edge_index, alpha)`` pair
            (``edge_index [2, E_l]``, ``alpha [E_l]`` or ``[E_l, H_l]``) or a record with
            ``edge_index`` and ``alpha`` fields, such as those of :func:`record_attention`.
        num_nodes: number of nodes ``N``.
        residual: mix each layer with the identity before renormalising.

    Returns:
        ``[N, N]`` rollout, float32 or wider.

    Example::

        >>> edge_index = torch.tensor([[1, 0], [0, 1]])
        >>> layer = (edge_index, torch.ones(2))
        >>> attention_rollout([layer, layer], 2)
        tensor([[0.5000, 0.5000],
                [0.5000, 0.5000]])
    """
    rollout = torch.eye(check_num_nodes(num_nodes))
    for rollout in rollout_steps(attentions, num_nodes, residual):
        pass
    return rollout
