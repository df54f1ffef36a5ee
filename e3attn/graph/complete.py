r"""The complete graph: every ordered pair of nodes inside each graph of a batch."""
from __future__ import annotations

from numbers import Integral
from typing import Optional

import torch

from e3attn._checks import check_batch
from e3attn.graph.cells import ragged_arange

__all__ = ["complete_graph"]


def complete_graph(num_nodes: int, batch: Optional[torch.Tensor] = None, *, loop: bool = True) -> torch.Tensor:
    r"""All ordered pairs of nodes inside each graph.

    .. math:: \mathcal{E} = \{(s, d) : \mathrm{batch}_s = \mathrm{batch}_d\}
        \quad (\text{minus } s = d \text{ when } \texttt{loop=False})

    The dense attention of a transformer is attention on this graph. It has
    :math:`\sum_g n_g^2` edges for graphs of :math:`n_g` nodes.

    Args:
        num_nodes: number of nodes :math:`N \ge 0`.
        batch: ``[N]`` integer graph index of every node (any order), or ``None`` for one graph.
        loop: keep the self-loops :math:`(i, i)`.

    Returns:
        ``edge_index``: ``[2, E]`` int64 rows ``(src, dst)`` sorted by ``dst`` then ``src``,
        on ``batch.device`` (CPU when ``batch`` is ``None``).

    Example::

        >>> import torch
        >>> complete_graph(3, torch.tensor([0, 1, 0]), loop=False)
        tensor([[2, 0],
                [0, 2]])
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, Integral) or num_nodes < 0:
        raise ValueError(f"num_nodes must be a non-negative int, got {num_nodes!r}")
    check_batch(batch, num_nodes)
    if batch is None:
        batch = torch.zeros(num_nodes, dtype=torch.long)
    _, graph, counts = torch.unique(batch.long(), return_inverse=True, return_counts=True)
    members = torch.sort(graph, stable=True).indices  # the nodes of every graph, ascending
    first = torch.cumsum(counts, 0) - counts
    dst, position = ragged_arange(first[graph], counts[graph])
    src = members[position]
    if not loop:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    return torch.stack([src, dst])
