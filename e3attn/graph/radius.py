r"""The radius graphs, open (:func:`radius_graph`) and periodic (:func:`radius_graph_pbc`): the public functions
check their arguments and call the custom operators ``e3attn::radius_graph`` and ``e3attn::radius_graph_pbc``,
which search candidate pairs (:mod:`e3attn.graph.search`), settle the cutoff exactly and sort the edges
(:mod:`e3attn.graph.edges`)."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from e3attn._checks import check_batch, check_pos
from e3attn.graph.cells import squared_norm
from e3attn.graph.checks import (check_cell, check_cells_away, check_flag, check_images, check_max_num_neighbors,
                                 check_r_max, check_spread)
from e3attn.graph.edges import (_arrays, _cast, _check_num_neighbors, _csr_edges, _graph_index, _graph_labels,
                                _int64, _margin, _on_host, _settle, _shift_vectors, _shorter_than, _tensor, _without)
from e3attn.graph.search import default_backend, half_pairs, periodic_half_pairs

__all__ = ["radius_graph", "radius_graph_pbc"]

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
    host = _on_host(pos)
    (points,) = _arrays(host, pos)
    check_spread(points, r)
    # a difference of two coordinates rounds relative to itself: the margin is relative to r
    margin = _margin(pos.dtype)
    pairs, distances = _arrays(host, *half_pairs(pos, r * (1 + margin), batch, backend))

    def exact(index):
        return _shorter_than(points, pairs if index is None else pairs[index], r)

    (pairs,) = _without([pairs], _settle(distances, r * (1 - margin), exact))
    edge_index, _ = _csr_edges(pairs[:, 0], pairs[:, 1], None, num_nodes, loop)
    edge_index = _tensor(edge_index)
    _check_num_neighbors(edge_index[1], num_nodes, max_num_neighbors)
    return edge_index


@torch.library.custom_op("e3attn::radius_graph", mutates_args=())
def _radius_graph_op(
    pos: torch.Tensor, r_max: float, batch: Optional[torch.Tensor], loop: bool, max_num_neighbors: Optional[int]
) -> torch.Tensor:
    """:func:`radius_graph` once its arguments are checked: validates the values of ``pos`` and ``batch``."""
    check_batch(batch, pos.shape[0])
    return _radius_graph(pos, r_max, batch, loop, max_num_neighbors, default_backend(pos.device))


@_radius_graph_op.register_fake
def _(pos, r_max, batch, loop, max_num_neighbors):
    return pos.new_empty((2, torch.library.get_ctx().new_dynamic_size()), dtype=torch.long)


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

    Cost is :math:`O(N + E)` time and memory for clouds of roughly even density, plus
    :math:`O(E \log E)` to sort: vesin's cell list on CPU (the graphs of a batch laid out
    side by side and searched at once, with :func:`torch.get_num_threads` threads),
    ``torch_cluster`` on other devices when installed, else a PyTorch cell list. The
    result is produced in CSR order by sorting packed ``dst << bits | src`` keys by value
    (on CPU block by block of destinations, each block's keys in cache).
    Nothing is truncated: ``max_num_neighbors`` only guards against surprises. Every
    thread keeps its vesin buffers between calls (up to :math:`2^{22}` pairs, about
    150 MiB), as a simulation loop would.

    The search is the custom operator ``e3attn::radius_graph`` with a data-dependent
    number of edges, so ``torch.compile(fullgraph=True)`` traces functions that call it.

    Args:
        pos: ``[N, 3]`` finite floating positions, :math:`N < 2^{31}`.
        r_max: cutoff radius, a positive finite number (Python or NumPy scalar, or a
            one-element tensor or array; never a bool) whose square is a normal number of
            ``pos.dtype``: :math:`1.1 \cdot 10^{-19} \le r_{\max} < 1.8 \cdot 10^{19}` in
            float32, :math:`1.5 \cdot 10^{-154} \le r_{\max} < 1.3 \cdot 10^{154}` in float64.
        batch: ``[N]`` integer graph index of every point (any int64 values, any order,
            need not be contiguous), or ``None`` for a single graph.
        loop: also add the self-loop :math:`(i, i)` of every node.
        max_num_neighbors: ``None`` (no cap), or raise :class:`ValueError` when a node
            has more incoming edges than this (its self-loop included).

    Returns:
        ``edge_index``: ``[2, E]`` int64 on ``pos.device``, rows ``(src, dst)``, sorted by
        ``dst`` then ``src``.

    Raises:
        ValueError: on malformed ``pos``, ``r_max``, ``batch``, ``loop`` or
            ``max_num_neighbors``, when coordinates exceed :math:`2^{1000} r_{\max}`, or when
            a node exceeds ``max_num_neighbors``.

    Example::

        >>> import torch
        >>> pos = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [0.0, 1.5, 0]])
        >>> radius_graph(pos, 1.2)
        tensor([[1, 0],
                [0, 1]])
    """
    check_pos(pos, finite=False)  # the values: in the operator (check_spread)
    r = check_r_max(r_max, pos.dtype)
    if pos.shape[0] >= 2**31:
        raise ValueError(f"pos must have fewer than 2**31 points, got {pos.shape[0]}")
    batch = _graph_index(batch, pos)
    loop = check_flag(loop, "loop")
    max_num_neighbors = check_max_num_neighbors(max_num_neighbors)
    return _radius_graph_op(pos.detach(), r, batch, loop, max_num_neighbors)


def _per_graph_product(rows, matrices, graph):
    """``rows[n] @ matrices[graph[n]]`` for ``[N, 3]`` rows and ``[B, 3, 3]`` matrices (einsum: no BLAS
    threads)."""
    einsum = np.einsum if isinstance(rows, np.ndarray) else torch.einsum
    if matrices.shape[0] == 1:
        return einsum("ni,ij->nj", rows, matrices[0])
    return einsum("ni,nij->nj", rows, matrices[graph])


def _radius_graph_pbc(
    pos: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    r: float,
    graph: torch.Tensor,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`radius_graph_pbc` on validated input: ``cell [1 or B, 3, 3]``, ``pbc [1 or B, 3]``,
    ``graph [N]`` with values in ``[0, B)``."""
    num_nodes = pos.shape[0]
    if num_nodes == 0:
        return torch.zeros(2, 0, dtype=torch.long, device=pos.device), pos.new_zeros(0, 3)
    host = _on_host(pos)
    points, cells, point_graph = _arrays(host, pos, cell, graph)
    largest = check_spread(points, r)
    num_graphs = max(cell.shape[0], pbc.shape[0], int(point_graph.max()) + 1)
    pbc = pbc.expand(num_graphs, 3)
    lattice = (cell.double() * pbc[..., None]).expand(num_graphs, 3, 3)  # the periodic lattice vectors only
    # lattice @ recip = diag(pbc): columns are the reciprocal vectors, exactly zero for open directions
    recip = torch.linalg.pinv(lattice) * pbc[:, None, :]
    if not torch.allclose(lattice @ recip, torch.diag_embed(pbc.double()), atol=1e-6):
        raise ValueError("cell: the lattice vectors of the periodic directions must be linearly independent")
    inverse_spacing = recip.norm(dim=1)  # [B, 3]: one over the plane spacing, 0 along open directions
    check_images(inverse_spacing, pbc, r)
    lattices, recips = _arrays(host, lattice.contiguous(), recip)
    x = _cast(points, recips)
    frac = _per_graph_product(x, recips, point_graph)
    far = torch.tensor([float(abs(frac[:, k]).max()) for k in range(3)], dtype=torch.float64)  # per column
    check_cells_away(float(far.max()), pos.dtype)
    wrap = frac // 1
    moved = bool(wrap.any())
    home = x - _per_graph_product(wrap, lattices, point_graph) if moved else x
    # pos[src] - pos[dst] + shift @ cell rounds relative to the size of its terms, not to the distance:
    # |pos| <= X, and |shift_k| <= 2 max|frac_k| + r / spacing_k + 1 along each lattice vector
    far = far.to(lattice.device)
    size = 2 * largest + float(((2 * far + r * inverse_spacing + 1) * lattice.abs().amax(2)).sum(1).max())
    slack = 8 * torch.finfo(pos.dtype).eps * size
    margin = _margin(pos.dtype)
    found = periodic_half_pairs(_tensor(home), lattice, recip, pbc, graph, r * (1 + margin) + slack, backend)
    i, j, shift, distances = _arrays(host, *found)
    if moved:  # from the home cells back to pos
        wrap = _int64(wrap)
        shift = shift + (wrap[i] - wrap[j])

    def exact(index):
        a, b, s = (i, j, shift) if index is None else (i[index], j[index], shift[index])
        return squared_norm(points[b] - points[a] + _shift_vectors(s, cells, point_graph[a])) < r * r

    i, j, shift = _without([i, j, shift], _settle(distances, r * (1 - margin) - slack, exact))
    edge_index, shifts = _csr_edges(i, j, shift, num_nodes, False, pos.dtype)
    return _tensor(edge_index), _tensor(shifts)


@torch.library.custom_op("e3attn::radius_graph_pbc", mutates_args=())
def _radius_graph_pbc_op(
    pos: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, r_max: float, batch: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`radius_graph_pbc` once its arguments are checked: validates values, selects every graph's cell."""
    check_batch(batch, pos.shape[0])
    if not bool(torch.isfinite(cell).all()):
        raise ValueError("cell contains NaN or infinite values")
    if batch is None:
        graphs, graph = torch.zeros(1, dtype=torch.long), torch.zeros(pos.shape[0], dtype=torch.long)
    else:
        graphs, graph = _graph_labels(batch)  # graph indices made contiguous
    graphs, graph = graphs.to(pos.device), graph.to(pos.device)
    described = max(cell.shape[0], pbc.shape[0])
    if described > 1 and graphs.numel() > 0 and int(graphs[-1]) >= described:
        raise ValueError(f"batch holds graph index {int(graphs[-1])} but cell/pbc describe {described} graphs")
    cell = cell[graphs] if cell.shape[0] > 1 else cell
    pbc = pbc[graphs] if pbc.shape[0] > 1 else pbc
    return _radius_graph_pbc(pos, cell, pbc, r_max, graph, default_backend(pos.device))


@_radius_graph_pbc_op.register_fake
def _(pos, cell, pbc, r_max, batch):
    num_edges = torch.library.get_ctx().new_dynamic_size()
    return pos.new_empty((2, num_edges), dtype=torch.long), pos.new_empty((num_edges, 3))


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

    Points are wrapped into their home cell and vesin's periodic cell list (CPU) searches
    every graph; other devices add the images within :math:`r_{\max}` of the home cell
    (a shell :math:`r_{\max}` thick, measured along the reciprocal directions) and pair
    home points with images. Like :func:`radius_graph`, the search is a custom operator
    (``e3attn::radius_graph_pbc``) that ``torch.compile(fullgraph=True)`` traces.

    Args:
        pos: ``[N, 3]`` finite floating positions.
        cell: ``[3, 3]`` lattice (rows = lattice vectors) shared by all graphs, or
            ``[B, 3, 3]`` one per graph; same dtype and device as ``pos``. Rows of
            non-periodic directions are ignored (they may be zero).
        pbc: booleans ``[3]`` or ``[B, 3]`` (tensor or sequence; a single bool means all
            three directions): which directions are periodic.
        r_max: cutoff radius, a positive finite number with :math:`r_{\max}^2` finite in
            ``pos.dtype``.
        batch: ``[N]`` integer graph index of every point, or ``None`` for one graph.

    Returns:
        ``(edge_index, shifts)``: ``[2, E]`` int64 rows ``(src, dst)`` and ``[E, 3]``
        integer-valued shifts in ``pos.dtype``, sorted by ``dst``, then ``src``, then
        shift (lexicographic).

    Raises:
        ValueError: on malformed input; when the periodic lattice vectors of a graph are
            linearly dependent; or when more than :math:`2^{20}` periodic images of a point
            lie within ``r_max`` (a cell that is nearly singular, or tiny against
            ``r_max``: the error names the plane spacing).

    Example::

        >>> import torch
        >>> pos = torch.tensor([[0.0, 0.0, 0.0]])
        >>> edge_index, shifts = radius_graph_pbc(pos, torch.eye(3), [True, False, False], 1.5)
        >>> edge_index
        tensor([[0, 0],
                [0, 0]])
        >>> shifts
        tensor([[-1.,  0.,  0.],
                [ 1.,  0.,  0.]])
    """
    check_pos(pos, finite=False)  # the values: in the operator (check_spread)
    r = check_r_max(r_max, pos.dtype)
    batch = _graph_index(batch, pos)
    cell, pbc = check_cell(cell, pbc, pos)
    return _radius_graph_pbc_op(pos.detach(), cell.detach(), pbc, r, batch)
