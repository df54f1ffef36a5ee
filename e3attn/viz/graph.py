r"""Attention as a directed graph: networkx export and centrality measures.

An edge ``src -> dst`` carries the weight with which ``dst`` attends to ``src``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence

import torch

from e3attn._checks import check_int, check_positive, check_real
from e3attn.viz._inputs import edge_weights, infer_num_nodes, require

if TYPE_CHECKING:
    import networkx

__all__ = ["attention_graph", "attention_centrality"]


def attention_graph(
    edge_index: torch.Tensor,
    alpha: torch.Tensor,
    num_nodes: Optional[int] = None,
    *,
    node_labels: Optional[Sequence[object]] = None,
) -> "networkx.DiGraph":
    r"""Export attention weights as a weighted :class:`networkx.DiGraph`.

    Edge ``src -> dst`` gets one attribute per head and their mean,

    .. math::

        w^{(h)}_{\mathrm{src}\to\mathrm{dst}} = \sum_{e:\ (\mathrm{src}_e, \mathrm{dst}_e) = (\mathrm{src}, \mathrm{dst})}
        \alpha_{e h}, \qquad
        w_{\mathrm{src}\to\mathrm{dst}} = \frac1H \sum_{h=1}^{H} w^{(h)}_{\mathrm{src}\to\mathrm{dst}},

    stored as ``weight_h{h}`` (``h = 0 .. H-1``) and ``weight``. Duplicate edges are
    summed (as in :func:`attention_matrix`), self-loops are kept, nodes ``0 .. N-1``
    are all present (also those without edges), ``G.graph["num_heads"] = H``.

    Args:
        edge_index: ``[2, E]`` integer tensor, rows ``(src, dst)``.
        alpha: ``[E]`` or ``[E, H]`` non-negative attention weights.
        num_nodes: number of nodes ``N``; by default ``len(node_labels)`` if labels
            are given, else one more than the largest index in ``edge_index``.
        node_labels: optional ``N`` labels (e.g. element symbols), stored as node
            attribute ``label``.

    Returns:
        ``networkx.DiGraph`` with nodes ``0 .. N-1``.

    Example::

        >>> edge_index = torch.tensor([[1, 2, 0], [0, 0, 1]])
        >>> alpha = torch.tensor([[0.25, 0.5], [0.75, 0.5], [1.0, 1.0]])
        >>> G = attention_graph(edge_index, alpha, node_labels=["O", "H", "H"])
        >>> G.edges[2, 0]
        {'weight_h0': 0.75, 'weight_h1': 0.5, 'weight': 0.625}
    """
    nx = require("networkx", "attention_graph")
    if num_nodes is None and node_labels is not None:
        num_nodes = len(node_labels)
    num_nodes = infer_num_nodes(edge_index, num_nodes)
    weights = edge_weights(edge_index, alpha, num_nodes).double()
    if node_labels is not None and len(node_labels) != num_nodes:
        raise ValueError(f"node_labels must have one label per node ({num_nodes}), got {len(node_labels)}")
    num_heads = weights.shape[1]
    pair = edge_index[1].long() * num_nodes + edge_index[0].long()
    pairs, slot = torch.unique(pair, return_inverse=True)
    summed = weights.new_zeros(len(pairs), num_heads).index_add(0, slot, weights)
    graph = nx.DiGraph(num_heads=num_heads)
    for node in range(num_nodes):
        graph.add_node(node, **({} if node_labels is None else {"label": node_labels[node]}))
    for key, row in zip(pairs.tolist(), summed.tolist()):
        attributes = {f"weight_h{h}": value for h, value in enumerate(row)}
        attributes["weight"] = sum(row) / num_heads
        graph.add_edge(key % num_nodes, key // num_nodes, **attributes)
    return graph


def _pagerank(
    src: torch.Tensor, dst: torch.Tensor, weight: torch.Tensor, num_nodes: int, damping: float, tol: float, max_iter: int
) -> torch.Tensor:
    """Power iteration of :func:`attention_centrality`, in float64."""
    out_weight = weight.new_zeros(num_nodes).index_add(0, src, weight)
    dangling = out_weight == 0
    transition = weight / out_weight[src]  # out_weight[src] > 0 wherever weight > 0
    transition = torch.where(weight > 0, transition, torch.zeros_like(transition))
    rank = weight.new_full((num_nodes,), 1.0 / num_nodes)
    for _ in range(max_iter):
        spread = rank.new_zeros(num_nodes).index_add(0, dst, rank[src] * transition)
        new_rank = damping * (spread + rank[dangling].sum() / num_nodes) + (1.0 - damping) / num_nodes
        change = float((new_rank - rank).abs().sum())
        rank = new_rank
        if change < num_nodes * tol:
            return rank
    raise RuntimeError(f"pagerank did not converge to tol={tol} in max_iter={max_iter} iterations")


def attention_centrality(
    edge_index: torch.Tensor,
    alpha: torch.Tensor,
    num_nodes: int,
    *,
    reverse: bool = False,
    damping: float = 0.85,
    tol: float = 1e-12,
    max_iter: int = 1000,
) -> Dict[str, torch.Tensor]:
    r"""PageRank and weighted in/out degree of the attention graph.

    With :math:`w_e` the head-averaged weight of edge :math:`e` (``src -> dst``):

    .. math::

        d^{\mathrm{in}}_i = \sum_{e:\ \mathrm{dst}_e = i} w_e, \qquad
        d^{\mathrm{out}}_i = \sum_{e:\ \mathrm{src}_e = i} w_e,

    so :math:`d^{\mathrm{in}}_i` is the total attention node :math:`i` pays and
    :math:`d^{\mathrm{out}}_i` the total attention it receives. PageRank is the fixed
    point, found by power iteration on the sparse edge list, of

    .. math::

        r_i = \frac{1 - d}{N} + d \Big( \sum_{e:\ \mathrm{dst}_e = i} r_{\mathrm{src}_e}
        \frac{w_e}{d^{\mathrm{out}}_{\mathrm{src}_e}} + \frac1N \sum_{j:\ d^{\mathrm{out}}_j = 0} r_j \Big),

    the same as ``networkx.pagerank(attention_graph(edge_index, alpha), alpha=d)``.
    With ``reverse=True`` every edge is reversed first: the walk then moves from a
    query to a key with probability proportional to its attention weight, and the rank
    measures how much a node serves as a source of information.

    Args:
        edge_index: ``[2, E]`` integer tensor, rows ``(src, dst)``.
        alpha: ``[E]`` or ``[E, H]`` non-negative attention weights (heads are averaged).
        num_nodes: number of nodes ``N``.
        reverse: rank on the reversed graph (``dst -> src``).
        damping: damping factor :math:`d`, in ``[0, 1)``.
        tol: stop when the L1 change of :math:`r` is below ``N * tol``.
        max_iter: maximum number of iterations (``RuntimeError`` beyond it).

    Returns:
        dict with ``"pagerank"``, ``"in_degree"`` and ``"out_degree"``, each ``[N]`` in the
        dtype of ``alpha``; the PageRank sums to 1 (it is empty for ``N = 0``).

    Example::

        >>> edge_index = torch.tensor([[1, 2, 0], [0, 0, 1]])
        >>> c = attention_centrality(edge_index, torch.tensor([0.5, 0.5, 1.0]), 3)
        >>> c["in_degree"], c["out_degree"]
        (tensor([1., 1., 0.]), tensor([1.0000, 0.5000, 0.5000]))
    """
    weight = edge_weights(edge_index, alpha, num_nodes).mean(dim=1)
    damping = check_real(damping, "damping", "in [0, 1)", lambda d: 0.0 <= d < 1.0)
    tol, max_iter = check_positive(tol, "tol"), check_int(max_iter, "max_iter", 1)
    src, dst = edge_index.long()
    in_degree = weight.new_zeros(num_nodes).index_add(0, dst, weight)
    out_degree = weight.new_zeros(num_nodes).index_add(0, src, weight)
    if reverse:
        src, dst = dst, src
    if num_nodes == 0:
        pagerank = weight.new_zeros(0)
    else:
        pagerank = _pagerank(src, dst, weight.double(), num_nodes, damping, tol, max_iter).to(weight.dtype)
    return {"pagerank": pagerank, "in_degree": in_degree, "out_degree": out_degree}
