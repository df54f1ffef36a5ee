r"""Neighbour-search backends: candidate pairs closer than a radius, inside the same graph.

Three interchangeable backends return the same pair sets (up to pairs whose distance
rounds to the radius, which callers settle with an exact test):

- ``"kdtree"``: :class:`scipy.spatial.cKDTree` (compiled, CPU). The graph index is a
  fourth coordinate spaced :math:`2r` apart, so one tree serves a whole batch.
- ``"torch_cluster"``: the optional ``torch_cluster.radius`` (used on CUDA when installed).
- ``"cells"``: the plain-PyTorch cell list of :mod:`e3attn._cells` (any device).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from e3attn._cells import cell_list_pairs

__all__ = ["BACKENDS", "has_torch_cluster", "default_backend", "half_pairs", "cross_pairs"]

BACKENDS = ("kdtree", "cells", "torch_cluster")

Batch = Optional[torch.Tensor]

# first per-query cap handed to torch_cluster (its CUDA kernel allocates queries x cap)
_CLUSTER_CAP = 64


def has_torch_cluster() -> bool:
    """Whether the optional ``torch_cluster`` package can be imported."""
    try:
        import torch_cluster  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device: torch.device) -> str:
    r"""The backend used for tensors on ``device``.

    .. math:: \text{cpu} \mapsto \texttt{kdtree},\quad
        \text{other} \mapsto \texttt{torch\_cluster} \text{ if installed, else } \texttt{cells}

    Args:
        device: the device holding the positions.

    Returns:
        one of :data:`BACKENDS`.

    Example::

        >>> default_backend(torch.device("cpu"))
        'kdtree'
    """
    if device.type == "cpu":
        return "kdtree"
    return "torch_cluster" if has_torch_cluster() else "cells"


def _tree(x: torch.Tensor, batch: Batch, r: float) -> "scipy.spatial.cKDTree":  # noqa: F821
    from scipy.spatial import cKDTree

    points = x.detach().cpu().double().numpy()
    if batch is not None:  # graphs 2r apart along a fourth axis never meet
        points = np.concatenate([points, batch.cpu().double().numpy()[:, None] * (2.0 * r)], axis=1)
    return cKDTree(points, leafsize=16, balanced_tree=False)


def _cluster_pairs(query: torch.Tensor, source: torch.Tensor, r: float, query_batch: Batch, source_batch: Batch):
    import torch_cluster

    if query_batch is None or source_batch is None:
        query_batch = query.new_zeros(query.shape[0], dtype=torch.long)
        source_batch = source.new_zeros(source.shape[0], dtype=torch.long)
    # torch_cluster wants points grouped by graph, and graph indices 0, 1, ... (it allocates per index)
    graph = torch.unique(torch.cat([query_batch, source_batch]), return_inverse=True)[1]
    query_batch, source_batch = graph[: query.shape[0]], graph[query.shape[0] :]
    query_batch, query_order = torch.sort(query_batch, stable=True)
    source_batch, source_order = torch.sort(source_batch, stable=True)
    y, x = query[query_order].contiguous(), source[source_order].contiguous()
    cap = min(_CLUSTER_CAP, x.shape[0])
    while True:  # grow the per-query cap until no query fills it: nothing is truncated
        q, s = torch_cluster.radius(x, y, r, source_batch, query_batch, max_num_neighbors=cap)
        if q.numel() == 0 or cap >= x.shape[0] or int(torch.bincount(q).max()) < cap:
            return query_order[q], source_order[s]
        cap = min(4 * cap, x.shape[0])


def cross_pairs(
    query: torch.Tensor,
    source: torch.Tensor,
    r: float,
    query_batch: Optional[torch.Tensor],
    source_batch: Optional[torch.Tensor],
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""All (query, source) pairs of the same graph within ``r``, in no particular order.

    .. math:: \{(q, s) : \mathrm{batch}_q = \mathrm{batch}_s,\ \|x_q - y_s\| \le r\}

    up to pairs at distance :math:`r` within rounding.

    Args:
        query: ``[Nq, 3]`` positions.
        source: ``[Ns, 3]`` positions, same dtype and device.
        r: search radius.
        query_batch: ``[Nq]`` int64 graph indices, or ``None`` (one graph).
        source_batch: ``[Ns]`` int64 graph indices, or ``None``.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(q, s)``: int64 tensors ``[P]`` on the device of ``query``.

    Example::

        >>> x = torch.tensor([[0.0, 0, 0], [0.5, 0, 0]])
        >>> sorted(zip(*(t.tolist() for t in cross_pairs(x, x[:1], 1.0, None, None, "kdtree"))))
        [(0, 0), (1, 0)]
    """
    if query.shape[0] == 0 or source.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=query.device)
        return empty, empty
    if backend == "cells":
        return cell_list_pairs(query, source, r, query_batch, source_batch)
    if backend == "torch_cluster":
        return _cluster_pairs(query, source, r, query_batch, source_batch)
    found = _tree(query, query_batch, r).sparse_distance_matrix(
        _tree(source, source_batch, r), r, output_type="ndarray"
    )
    q = torch.from_numpy(found["i"].astype(np.int64)).to(query.device)
    s = torch.from_numpy(found["j"].astype(np.int64)).to(query.device)
    return q, s


def half_pairs(pos: torch.Tensor, r: float, batch: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    r"""Every unordered pair of distinct points of the same graph within ``r``, once.

    .. math:: \{(i, j) : i < j,\ \mathrm{batch}_i = \mathrm{batch}_j,\ \|x_i - x_j\| \le r\}

    up to pairs at distance :math:`r` within rounding. The KD-tree finds each pair once
    (``query_pairs``); the other backends search all ordered pairs and keep one orientation.

    Args:
        pos: ``[N, 3]`` positions (``N > 0``).
        r: search radius.
        batch: ``[N]`` int64 graph indices, or ``None``.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``[P, 2]`` int64 rows ``(i, j)`` with ``i < j``, in no particular order.

    Example::

        >>> x = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [3.0, 0, 0]])
        >>> half_pairs(x, 1.0, None, "cells")
        tensor([[0, 1]])
    """
    if backend != "kdtree":
        q, s = cross_pairs(pos, pos, r, batch, batch, backend)
        keep = s < q
        return torch.stack([s[keep], q[keep]], dim=1)
    pairs = _tree(pos, batch, r).query_pairs(r, output_type="ndarray")
    return torch.from_numpy(pairs.astype(np.int64, copy=False)).reshape(-1, 2).to(pos.device)
