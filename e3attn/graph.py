r"""Neighbour graphs for point clouds: radius graphs (open and periodic) and complete graphs.

Edges are ``edge_index = (src, dst)``, ``[2, E]`` int64; messages flow ``src -> dst``
(the torch_cluster / PyG convention) and every graph here is sorted by ``dst``, then
``src`` (then the periodic shift), so each node's incoming edges form one contiguous,
ordered block (CSR order).

Two points are neighbours when their squared distance, evaluated in the dtype of
``pos``, is strictly below ``r_max**2``. The search never builds an ``N x N`` matrix: on
CPU it runs a compiled KD-tree (SciPy), on other devices ``torch_cluster`` when installed
and otherwise a cell list written in PyTorch; a final exact test makes every backend
return the same edges.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Optional, Tuple

import numpy as np
import torch

from e3attn._cells import ragged_arange, squared_norm
from e3attn._checks import check_batch, check_pos
from e3attn._search import cross_pairs, default_backend, half_pairs

__all__ = ["radius_graph", "radius_graph_pbc", "complete_graph"]


def _check_r_max(r_max) -> float:
    if isinstance(r_max, torch.Tensor) and r_max.numel() == 1:
        r_max = r_max.item()
    if isinstance(r_max, bool) or not isinstance(r_max, Real) or not (0.0 < float(r_max) < math.inf):
        raise ValueError(f"r_max must be a positive finite number, got {r_max!r}")
    return float(r_max)


def _graph_index(batch: Optional[torch.Tensor], pos: torch.Tensor) -> Optional[torch.Tensor]:
    check_batch(batch, pos.shape[0])
    if batch is None:
        return None
    if batch.device != pos.device:
        raise ValueError(f"batch must be on the device of pos ({pos.device}), got {batch.device}")
    return batch.long()


def _search_radius(r: float, dtype: torch.dtype) -> float:
    """A radius safely above ``r``: the backends' candidates then include every exact edge."""
    return r * (1.0 + max(1e-4, 64 * torch.finfo(dtype).eps))


def _shorter_than(pos: torch.Tensor, pairs: torch.Tensor, r: float) -> torch.Tensor:
    """The exact test of every row ``(i, j)`` of ``pairs``: ``|pos[i] - pos[j]|^2 < r^2`` in ``pos.dtype``."""
    ends = pos.index_select(0, pairs.reshape(-1)).reshape(-1, 2, 3)
    return squared_norm(ends[:, 0] - ends[:, 1]) < r * r


def _csr_edges(pairs: torch.Tensor, valid: torch.Tensor, num_nodes: int, loop: bool) -> torch.Tensor:
    """Both orientations of the ``valid`` rows of ``pairs`` ``[P, 2]`` (and the self-loops), as ``[2, E]``
    sorted by ``dst`` then ``src``.

    Every edge is packed into one int64 key ``dst << bits | src`` (``N < 2**31``) and the keys are
    sorted by value (NumPy's SIMD sort on CPU): no argsort, no payload. Invalid pairs get a key
    above all others and are cut off after the sort.
    """
    num_pairs, bits = pairs.shape[0], max(1, (num_nodes - 1).bit_length())
    keys = torch.empty(2 * num_pairs + (num_nodes if loop else 0), dtype=torch.long, device=pairs.device)
    i, j = pairs[:, 0], pairs[:, 1]
    torch.bitwise_left_shift(j, bits, out=keys[:num_pairs]).bitwise_or_(i)
    torch.bitwise_left_shift(i, bits, out=keys[num_pairs : 2 * num_pairs]).bitwise_or_(j)
    if loop:
        nodes = torch.arange(num_nodes, device=pairs.device)
        torch.bitwise_left_shift(nodes, bits, out=keys[2 * num_pairs :]).bitwise_or_(nodes)
    invalid = ~valid
    keys[:num_pairs].masked_fill_(invalid, torch.iinfo(torch.long).max)
    keys[num_pairs : 2 * num_pairs].masked_fill_(invalid, torch.iinfo(torch.long).max)
    if keys.device.type == "cpu":
        keys.numpy().sort()  # in place
    else:
        keys = torch.sort(keys).values
    keys = keys[: keys.numel() - 2 * int(invalid.sum())]
    edge_index = torch.empty(2, keys.numel(), dtype=torch.long, device=keys.device)
    torch.bitwise_and(keys, (1 << bits) - 1, out=edge_index[0])
    torch.bitwise_right_shift(keys, bits, out=edge_index[1])
    return edge_index


def _check_num_neighbors(dst: torch.Tensor, num_nodes: int, max_num_neighbors: Optional[int]) -> None:
    if max_num_neighbors is None or dst.numel() == 0:
        return
    degree = torch.bincount(dst, minlength=num_nodes)
    node = int(degree.argmax())
    if int(degree[node]) > max_num_neighbors:
        raise ValueError(
            f"node {node} has {int(degree[node])} incoming edges within r_max, more than "
            f"max_num_neighbors={max_num_neighbors}; raise the cap or pass None (no cap)"
        )


def _radius_graph(
    pos: torch.Tensor,
    r: float,
    batch: Optional[torch.Tensor],
    loop: bool,
    max_num_neighbors: Optional[int],
    backend: str,
) -> torch.Tensor:
    """:func:`radius_graph` on validated input, with an explicit search backend."""
    num_nodes = pos.shape[0]
    if num_nodes == 0:
        return torch.zeros(2, 0, dtype=torch.long, device=pos.device)
    pairs = half_pairs(pos, _search_radius(r, pos.dtype), batch, backend)
    edge_index = _csr_edges(pairs, _shorter_than(pos, pairs, r), num_nodes, loop)
    _check_num_neighbors(edge_index[1], num_nodes, max_num_neighbors)
    return edge_index


def radius_graph(
    pos: torch.Tensor,
    r_max: float,
    batch: Optional[torch.Tensor] = None,
    *,
    loop: bool = False,
    max_num_neighbors: Optional[int] = None,
) -> torch.Tensor:
    r"""Directed edges between all points closer than ``r_max`` within the same graph.

    .. math::

        \mathcal{E} = \{(s, d) : \mathrm{batch}_s = \mathrm{batch}_d,\ s \ne d,\
        \|x_s - x_d\|^2 < r_{\max}^2\}

    (plus every :math:`(i, i)` once when ``loop=True``). The squared distance is
    :math:`\Delta_x^2 + \Delta_y^2 + \Delta_z^2` evaluated in ``pos.dtype``; the test is
    strict, and coincident points (distance 0) are neighbours. The graph is symmetric:
    :math:`(s, d) \in \mathcal{E} \Leftrightarrow (d, s) \in \mathcal{E}`.

    Cost is :math:`O(N \log N + E)` time and :math:`O(N + E)` memory: a SciPy KD-tree on
    CPU, ``torch_cluster`` on other devices when installed, else a PyTorch cell list.
    The result is produced in CSR order by sorting packed ``dst << bits | src`` keys by
    value. Nothing is truncated: ``max_num_neighbors`` only guards against surprises.

    Args:
        pos: ``[N, 3]`` finite floating positions, :math:`N < 2^{31}`.
        r_max: cutoff radius, a positive finite number.
        batch: ``[N]`` integer graph index of every point (any order, need not be
            contiguous), or ``None`` for a single graph.
        loop: also add the self-loop :math:`(i, i)` of every node.
        max_num_neighbors: ``None`` (no cap), or raise :class:`ValueError` when a node
            has more incoming edges than this (its self-loop included).

    Returns:
        ``edge_index``: ``[2, E]`` int64 on ``pos.device``, rows ``(src, dst)``, sorted by
        ``dst`` then ``src``.

    Raises:
        ValueError: on malformed ``pos``, ``r_max``, ``batch`` or ``max_num_neighbors``,
            or when a node exceeds ``max_num_neighbors``.

    Example::

        >>> pos = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [0.0, 1.5, 0]])
        >>> radius_graph(pos, 1.2)
        tensor([[1, 0],
                [0, 1]])
    """
    r = _check_r_max(r_max)
    check_pos(pos)
    if pos.shape[0] >= 2**31:
        raise ValueError(f"pos must have fewer than 2**31 points, got {pos.shape[0]}")
    batch = _graph_index(batch, pos)
    if max_num_neighbors is not None and (
        isinstance(max_num_neighbors, bool) or not isinstance(max_num_neighbors, Integral) or max_num_neighbors < 0
    ):
        raise ValueError(f"max_num_neighbors must be None or a non-negative int, got {max_num_neighbors!r}")
    pos = pos.detach()
    return _radius_graph(pos, r, batch, bool(loop), max_num_neighbors, default_backend(pos.device))


def _check_cell(cell: torch.Tensor, pbc, pos: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cell`` as ``[B, 3, 3]`` and ``pbc`` as bool ``[B, 3]`` (one of them may be shared, B = 1)."""
    if not isinstance(cell, torch.Tensor):
        raise TypeError(f"cell must be a torch.Tensor of shape [3, 3] or [B, 3, 3], got {type(cell).__name__}")
    if cell.shape[-2:] != (3, 3) or cell.dim() not in (2, 3):
        raise ValueError(f"cell must have shape [3, 3] or [B, 3, 3] (rows = lattice vectors), got {list(cell.shape)}")
    if cell.dtype != pos.dtype or cell.device != pos.device:
        raise ValueError(
            f"cell must have the dtype and device of pos ({pos.dtype}, {pos.device}), got {cell.dtype}, {cell.device}"
        )
    if not bool(torch.isfinite(cell).all()):
        raise ValueError("cell contains NaN or infinite values")
    pbc = torch.as_tensor(pbc, device=pos.device)
    if pbc.dtype != torch.bool:
        raise ValueError(f"pbc must hold booleans, got dtype {pbc.dtype}")
    if pbc.dim() == 0:
        pbc = pbc.expand(3)
    if pbc.shape[-1:] != (3,) or pbc.dim() > 2:
        raise ValueError(f"pbc must have shape [3] or [B, 3], got {list(pbc.shape)}")
    cell, pbc = cell.reshape(-1, 3, 3), pbc.reshape(-1, 3)
    if cell.shape[0] != pbc.shape[0] and 1 not in (cell.shape[0], pbc.shape[0]):
        raise ValueError(f"cell has {cell.shape[0]} graphs but pbc has {pbc.shape[0]}")
    num_graphs = max(cell.shape[0], pbc.shape[0])
    return cell.expand(num_graphs, 3, 3), pbc.expand(num_graphs, 3)


def _lexsort(primary: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by ``primary``, ties broken by ``secondary`` (two stable passes)."""
    order = torch.sort(secondary, stable=True).indices
    return order[torch.sort(primary[order], stable=True).indices]


def _radius_graph_pbc(
    pos: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    r: float,
    graph: torch.Tensor,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`radius_graph_pbc` on validated input (``cell [B,3,3]``, ``pbc [B,3]``, ``graph [N]``)."""
    num_nodes = pos.shape[0]
    if num_nodes == 0:
        return torch.zeros(2, 0, dtype=torch.long, device=pos.device), pos.new_zeros(0, 3)
    r_search = _search_radius(r, pos.dtype)
    lattice = cell.double() * pbc[..., None]  # the lattice vectors of the periodic directions only
    # lattice @ recip = diag(pbc): columns are the reciprocal vectors, exactly zero for open directions
    recip = torch.linalg.pinv(lattice) * pbc[:, None, :]
    if not torch.allclose(lattice @ recip, torch.diag_embed(pbc.double()), atol=1e-6):
        raise ValueError("cell: the lattice vectors of the periodic directions must be linearly independent")
    # wrap every point into its home cell: frac in [0, 1) along periodic directions
    x = pos.double()
    frac = torch.einsum("ni,nij->nj", x, recip[graph])
    wrap = torch.floor(frac)
    home = x - torch.einsum("ni,nij->nj", wrap, lattice[graph])
    frac = frac - wrap
    # images within r_search of the home cell: along every periodic direction, the integer shifts S
    # with -reach < frac + S < 1 + reach (reach = r_search / plane spacing); S = 0 along open ones
    reach = r_search * recip.norm(dim=1)[graph]
    open_ = ~pbc[graph]
    low = torch.floor(-reach - frac).long().add_(1).masked_fill_(open_, 0)
    count = (torch.ceil(1 + reach - frac).long() - low).masked_fill_(open_, 1)
    atom, k = ragged_arange(torch.zeros_like(graph), count.prod(1))
    ny, nz = count[atom, 1], count[atom, 2]
    image_shift = low[atom] + torch.stack([k // (ny * nz), k // nz % ny, k % nz], dim=1)
    image_pos = home[atom] + torch.einsum("mi,mij->mj", image_shift.double(), lattice[graph[atom]])

    dst, s = cross_pairs(home, image_pos, r_search, graph, graph[atom], backend)
    src = atom[s]
    wrap = wrap.long()
    shift = image_shift[s] - wrap[src] + wrap[dst]
    edge_vec = pos[src] - pos[dst] + (shift.to(pos.dtype)[:, None, :] @ cell[graph[dst]]).squeeze(1)
    keep = (squared_norm(edge_vec) < r * r) & ((src != dst) | (shift != 0).any(1))
    src, dst, shift = src[keep], dst[keep], shift[keep]
    if src.numel() > 0:
        code = shift - shift.min()
        span = int(code.max()) + 1
        order = _lexsort(dst * num_nodes + src, (code[:, 0] * span + code[:, 1]) * span + code[:, 2])
        src, dst, shift = src[order], dst[order], shift[order]
    return torch.stack([src, dst]), shift.to(pos.dtype)


def radius_graph_pbc(
    pos: torch.Tensor,
    cell: torch.Tensor,
    pbc,
    r_max: float,
    batch: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Radius graph of a periodic system: every periodic image closer than ``r_max``.

    With lattice vectors as the rows of ``cell`` (:math:`C`), an edge :math:`(s, d)`
    with integer image shift :math:`S \in \mathbb{Z}^3` has the vector

    .. math::

        v_{sd}(S) = x_s - x_d + S\,C, \qquad
        \mathcal{E} = \{(s, d, S) : \|v_{sd}(S)\|^2 < r_{\max}^2,\ (s, S) \ne (d, 0)\},

    inside each graph, with :math:`S_i = 0` along non-periodic directions. So in code
    ``edge_vec = pos[src] - pos[dst] + shifts @ cell`` (per graph:
    ``shifts @ cell[batch[dst]]``), evaluated in ``pos.dtype``. Cells smaller than
    :math:`2 r_{\max}` give several images of one pair and edges from a node to its own
    images; skewed (triclinic) cells are fine, and ``pos`` need not be wrapped into the
    cell. The graph is symmetric: :math:`(s, d, S) \leftrightarrow (d, s, -S)`.

    Points are wrapped into their home cell, the images within :math:`r_{\max}` of it
    (a shell :math:`r_{\max}` thick, measured along the reciprocal directions) are added,
    and one radius search pairs home points with images.

    Args:
        pos: ``[N, 3]`` finite floating positions.
        cell: ``[3, 3]`` lattice (rows = lattice vectors) shared by all graphs, or
            ``[B, 3, 3]`` one per graph; same dtype and device as ``pos``. Rows of
            non-periodic directions are ignored (they may be zero).
        pbc: booleans ``[3]`` or ``[B, 3]`` (tensor or sequence; a single bool means all
            three directions): which directions are periodic.
        r_max: cutoff radius, a positive finite number.
        batch: ``[N]`` integer graph index of every point, or ``None`` for one graph.

    Returns:
        ``(edge_index, shifts)``: ``[2, E]`` int64 rows ``(src, dst)`` and ``[E, 3]``
        integer-valued shifts in ``pos.dtype``, sorted by ``dst``, then ``src``, then
        shift (lexicographic).

    Raises:
        ValueError: on malformed input, or when the periodic lattice vectors of a graph
            are linearly dependent.

    Example::

        >>> pos = torch.tensor([[0.0, 0.0, 0.0]])
        >>> edge_index, shifts = radius_graph_pbc(pos, torch.eye(3), [True, False, False], 1.5)
        >>> edge_index
        tensor([[0, 0],
                [0, 0]])
        >>> shifts
        tensor([[-1.,  0.,  0.],
                [ 1.,  0.,  0.]])
    """
    r = _check_r_max(r_max)
    check_pos(pos)
    batch = _graph_index(batch, pos)
    cell, pbc = _check_cell(cell, pbc, pos)
    if batch is None:
        batch = torch.zeros(pos.shape[0], dtype=torch.long, device=pos.device)
    graphs, graph = torch.unique(batch, return_inverse=True)  # graph indices made contiguous
    if cell.shape[0] == 1:
        cell, pbc = cell.expand(graphs.numel(), 3, 3), pbc.expand(graphs.numel(), 3)
    elif graphs.numel() > 0 and int(graphs[-1]) >= cell.shape[0]:
        raise ValueError(f"batch holds graph index {int(graphs[-1])} but cell/pbc describe {cell.shape[0]} graphs")
    else:
        cell, pbc = cell[graphs], pbc[graphs]
    pos = pos.detach()
    return _radius_graph_pbc(pos, cell.detach(), pbc, r, graph, default_backend(pos.device))


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
