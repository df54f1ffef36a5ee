r"""Neighbour-search backends: candidate pairs closer than a radius, inside the same graph.

Every backend returns a *half list*: each unordered pair once, as rows ``(i, j)`` with
``i < j`` (open systems) or as ``(i, j, S)`` with an integer image shift :math:`S` of
``j`` (periodic systems, where a point may also pair with its own images), such that

.. math:: \|y_j - y_i + S L\| \le r

up to pairs whose distance rounds to :math:`r`; callers settle the cutoff with an exact
test. The backends:

- ``"vesin"``: the compiled, multithreaded cell list of `vesin
  <https://luthaf.fr/vesin>`_ (CPU). A batch of open graphs is laid out side by side
  and searched in one call; periodic graphs are searched one cell at a time.
- ``"torch_cluster"``: the optional ``torch_cluster.radius`` (used on CUDA when installed).
- ``"cells"``: the plain-PyTorch cell list of :mod:`e3attn.graph.cells` (any device): GPUs
  without torch_cluster, and the boxes whose cell grid vesin 0.6 cannot build
  (:func:`vesin_grid_ok`).

Periodic backends other than vesin add the images of every point within :math:`r` of its
home cell and pair home points with images.
"""
from __future__ import annotations

import math
import threading
from typing import List, Optional, Tuple

import numpy as np
import torch

from e3attn.graph.cells import cell_list_pairs, ragged_arange

__all__ = [
    "BACKENDS",
    "has_torch_cluster",
    "default_backend",
    "vesin_grid_ok",
    "half_pairs",
    "periodic_half_pairs",
    "cross_pairs",
]

BACKENDS = ("vesin", "cells", "torch_cluster")

Batch = Optional[torch.Tensor]

# first per-query cap handed to torch_cluster (its CUDA kernel allocates queries x cap)
_CLUSTER_CAP = 64
# vesin 0.6 coarsens its grid to about this many cells (see vesin_grid_ok)
_VESIN_MAX_CELLS = 1e5


def has_torch_cluster() -> bool:
    """Whether the optional ``torch_cluster`` package can be imported."""
    try:
        import torch_cluster  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device: torch.device) -> str:
    r"""The backend used for tensors on ``device``.

    .. math:: \text{cpu} \mapsto \texttt{vesin},\quad
        \text{other} \mapsto \texttt{torch\_cluster} \text{ if installed, else } \texttt{cells}

    Args:
        device: the device holding the positions.

    Returns:
        one of :data:`BACKENDS`.

    Example::

        >>> default_backend(torch.device("cpu"))
        'vesin'
    """
    if device.type == "cpu":
        return "vesin"
    return "torch_cluster" if has_torch_cluster() else "cells"


def vesin_grid_ok(faces: List[float], cutoff: float) -> bool:
    r"""Whether vesin 0.6 can grid a box whose faces are ``faces`` apart.

    vesin bins points into :math:`n_k = \max(1, \lfloor d_k / r \rfloor)` cells along each
    axis (:math:`d_k`: the distance between opposite faces of its box). Beyond
    :math:`10^5` cells it shrinks the grid keeping the ratios :math:`n_x / n_y` and
    :math:`n_y / n_z`, which rounds a short axis of a flat or elongated box to zero cells
    and then divides by zero (the process dies). This repeats that arithmetic and asks
    for at least two cells per axis, a margin against rounding.

    Args:
        faces: the three face distances :math:`d_k`.
        cutoff: the search radius :math:`r`.

    Returns:
        ``False`` when vesin's grid would have (almost) no cell along some axis.

    Example::

        >>> vesin_grid_ok([30.0, 30.0, 30.0], 1.0), vesin_grid_ok([1000.0, 1000.0, 1.0], 1.0)
        (True, False)
    """
    n = [max(1.0, math.trunc(face / cutoff)) for face in faces]
    if n[0] * n[1] * n[2] <= _VESIN_MAX_CELLS:
        return True
    x_over_y, y_over_z = n[0] / n[1], n[1] / n[2]
    nz = math.trunc(math.pow(_VESIN_MAX_CELLS / (x_over_y * y_over_z * y_over_z), 1 / 3))
    ny = math.trunc(y_over_z * nz)
    nx = math.trunc(x_over_y * ny)
    return min(nx, ny, nz) >= 2


def _open_faces(points: np.ndarray) -> List[float]:
    """The faces of the box vesin fits around ``points`` along open axes (its own rule)."""
    extent = [float(points[:, k].max() - points[:, k].min()) if len(points) else 0.0 for k in range(3)]
    return [max(1.0, 1.01 * (e if e >= 1e-6 else 1.0)) for e in extent]


_VESIN = threading.local()  # one vesin.NeighborList per thread, reused: its buffers stay allocated
# vesin's buffers are kept between calls up to this many pairs (about 150 MiB), released above
_VESIN_KEEP_PAIRS = 2**22


def _vesin_pairs(points: np.ndarray, box: np.ndarray, periodic: np.ndarray, cutoff: float):
    """vesin's half list of ``points`` ``[n, 3]`` (float64, scaled so that ``cutoff`` is about 1):
    ``(pairs [P, 2] int64, shifts [P, 3] int32 or None, distances [P] float64)`` NumPy arrays.

    Up to :data:`_VESIN_KEEP_PAIRS` pairs, these are views of this thread's vesin buffers, valid
    until its next call; larger results are copied out and the buffers released.
    """
    search = getattr(_VESIN, "search", None)
    if search is None:
        import vesin

        search = _VESIN.search = vesin.NeighborList(cutoff=cutoff, full_list=False)
    search.cutoff, search.n_threads = cutoff, torch.get_num_threads()
    found = search.compute(points, box, periodic, "PSd" if periodic.any() else "Pd", copy=False)
    if len(found[0]) > _VESIN_KEEP_PAIRS:
        found = [array.copy() for array in found]
        del _VESIN.search
    return found[0].view(np.int64), (found[1] if len(found) == 3 else None), found[-1]


def _scale(cutoff: float) -> float:
    """A power of two :math:`s` with :math:`s \\cdot \\mathrm{cutoff} \\in [1, 2)`: scaling by it is exact."""
    return math.ldexp(1.0, -math.floor(math.log2(cutoff)))


def _float64(points: torch.Tensor, scale: float) -> np.ndarray:
    """``points * scale`` as a new float64 NumPy array."""
    points = points.detach().cpu()
    if points.dtype == torch.bfloat16:  # unknown to NumPy
        points = points.double()
    return np.multiply(points.numpy(), scale, dtype=np.float64)


def _layout(x: np.ndarray, graph: np.ndarray, num_graphs: int, gap: float) -> float:
    """Translate every graph of ``x`` (in place) into its own slot of a near-cubic grid of slots, ``gap``
    apart: no two graphs then come closer than ``gap``. Returns the side of the grid (what rounding in
    the translated coordinates is relative to)."""
    lo, hi = np.full((3, num_graphs), np.inf), np.full((3, num_graphs), -np.inf)
    for k in range(3):  # one axis at a time: the fast path of ufunc.at
        np.minimum.at(lo[k], graph, x[:, k])
        np.maximum.at(hi[k], graph, x[:, k])
    lo, hi = lo.T, hi.T
    side = float((hi - lo).max()) + gap
    nz = math.ceil(num_graphs ** (1 / 3))
    ny = math.ceil(math.sqrt(num_graphs / nz))
    nx = math.ceil(num_graphs / (ny * nz))
    g = np.arange(num_graphs)
    slot = np.stack([g % nx, g // nx % ny, g // (nx * ny)], axis=1) * side
    x -= (lo - slot)[graph]
    return side * max(nx, ny, nz)


def _vesin_half_pairs(pos: torch.Tensor, r: float, batch: Batch):
    """Open half list by vesin with distances, or ``None`` when vesin cannot grid these points."""
    scale, extent = _scale(r), 0.0
    points = _float64(pos, scale)
    if batch is not None:
        graphs, graph = np.unique(batch.cpu().numpy(), return_inverse=True)
        if len(graphs) > 1:
            extent = _layout(points, graph.reshape(-1), len(graphs), 2.0 * r * scale)
    # the layout's rounding, relative to its extent, must not hide a pair
    cutoff = r * scale + 8 * np.finfo(np.float64).eps * extent
    if not vesin_grid_ok(_open_faces(points), cutoff):
        return None
    pairs, _, distances = _vesin_pairs(points, np.zeros((3, 3)), np.zeros(3, dtype=bool), cutoff)
    # distances of the laid-out points, rounded up by what the layout's rounding can add
    distances /= scale
    if extent:
        distances += 8 * np.finfo(np.float64).eps * extent / scale
    return torch.from_numpy(pairs).to(pos.device), torch.from_numpy(distances).to(pos.device)


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
        backend: ``"cells"`` or ``"torch_cluster"`` (vesin searches one point set).

    Returns:
        ``(q, s)``: int64 tensors ``[P]`` on the device of ``query``.

    Example::

        >>> x = torch.tensor([[0.0, 0, 0], [0.5, 0, 0]])
        >>> sorted(zip(*(t.tolist() for t in cross_pairs(x, x[:1], 1.0, None, None, "cells"))))
        [(0, 0), (1, 0)]
    """
    if query.shape[0] == 0 or source.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.long, device=query.device)
        return empty, empty
    if backend == "torch_cluster":
        return _cluster_pairs(query, source, r, query_batch, source_batch)
    return cell_list_pairs(query, source, r, query_batch, source_batch)


def half_pairs(
    pos: torch.Tensor, r: float, batch: Optional[torch.Tensor], backend: str
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Every unordered pair of distinct points of the same graph within ``r``, once.

    .. math:: \{(i, j) : i < j,\ \mathrm{batch}_i = \mathrm{batch}_j,\ \|x_i - x_j\| \le r\}

    up to pairs at distance :math:`r` within rounding. vesin finds each pair once (a
    batch of graphs laid out side by side, in one search) and measures it in float64;
    the other backends search all ordered pairs and keep one orientation.

    Args:
        pos: ``[N, 3]`` positions (``N > 0``).
        r: search radius.
        batch: ``[N]`` int64 graph indices, or ``None``.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(pairs, distances)``: ``[P, 2]`` int64 rows ``(i, j)`` with ``i < j``, in no
        particular order, and their float64 distances ``[P]`` up to rounding (vesin), or
        ``None`` (other backends).

    Example::

        >>> x = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [3.0, 0, 0]])
        >>> pairs, distances = half_pairs(x, 1.0, None, "vesin")
        >>> pairs, distances
        (tensor([[0, 1]]), tensor([0.5000], dtype=torch.float64))
    """
    if backend == "vesin":
        found = _vesin_half_pairs(pos, r, batch)
        if found is not None:
            return found
        backend = "cells"
    q, s = cross_pairs(pos, pos, r, batch, batch, backend)
    keep = s < q
    return torch.stack([s[keep], q[keep]], dim=1), None


def _lexicographic_sign(shift: torch.Tensor) -> torch.Tensor:
    """The sign of the first non-zero component of every row of ``shift`` ``[P, 3]``."""
    first = torch.where(shift[:, 1] != 0, shift[:, 1], shift[:, 2])
    return torch.where(shift[:, 0] != 0, shift[:, 0], first).sign()


def _image_half_pairs(home, lattice, recip, pbc, graph, r, backend):
    """Periodic half list through explicit images: every point's images within ``r`` of its home
    cell, one search pairing home points with images, one orientation of each pair kept."""
    frac = torch.einsum("ni,nij->nj", home, recip[graph])
    # along every periodic direction, the integer shifts S with -reach < frac + S < 1 + reach
    # (reach = r / plane spacing); S = 0 along open ones
    reach = r * recip.norm(dim=1)[graph]
    open_ = ~pbc[graph]
    low = torch.floor(-reach - frac).long().add_(1).masked_fill_(open_, 0)
    count = (torch.ceil(1 + reach - frac).long() - low).masked_fill_(open_, 1)
    atom, k = ragged_arange(torch.zeros_like(graph), count.prod(1))
    ny, nz = count[atom, 1], count[atom, 2]
    image_shift = low[atom] + torch.stack([k // (ny * nz), k // nz % ny, k % nz], dim=1)
    image_pos = home[atom] + torch.einsum("mi,mij->mj", image_shift.to(home.dtype), lattice[graph[atom]])
    i, s = cross_pairs(home, image_pos, r, graph, graph[atom], backend)
    j, shift = atom[s], image_shift[s]
    keep = (j > i) | ((j == i) & (_lexicographic_sign(shift) > 0))
    return i[keep], j[keep], shift[keep], None


def _vesin_periodic_half_pairs(home, lattice, recip, pbc, graph, r):
    """Periodic half list by vesin with distances, one call per graph, or ``None`` when vesin
    cannot grid a cell."""
    scale = _scale(r)
    spacing = (1.0 / recip.norm(dim=1)).tolist()  # the plane spacings of the periodic directions
    points, boxes, pbc = _float64(home, scale), (lattice * scale).numpy(), pbc.numpy()
    num_graphs = lattice.shape[0]
    if num_graphs == 1:
        members = [None]
    else:
        graph = graph.numpy()
        order = np.argsort(graph, kind="stable")
        members = np.split(order, np.cumsum(np.bincount(graph, minlength=num_graphs))[:-1])
    searches = []
    for g, index in enumerate(members):
        graph_points = points if index is None else points[index]
        if len(graph_points) == 0:
            continue
        opened = _open_faces(graph_points)
        faces = [spacing[g][k] * scale if pbc[g, k] else opened[k] for k in range(3)]
        if not vesin_grid_ok(faces, r * scale):
            return None
        searches.append((index, graph_points, boxes[g], pbc[g]))
    found = []
    for index, graph_points, box, periodic in searches:
        pairs, shifts, distances = _vesin_pairs(graph_points, box, periodic, r * scale)
        if shifts is None:
            shifts = np.zeros((len(pairs), 3), dtype=np.int32)
        if index is None:  # a single graph: vesin's buffers are used until the graph is built
            found.append((pairs[:, 0], pairs[:, 1], shifts, np.divide(distances, scale, out=distances)))
        else:  # copied out before the next graph's search reuses them
            pairs = index[pairs]
            found.append((pairs[:, 0], pairs[:, 1], shifts.copy(), distances / scale))
    if len(found) != 1:
        found = [tuple(np.concatenate(part) for part in zip(*found))]
    return tuple(torch.from_numpy(part) for part in found[0])


def periodic_half_pairs(
    home: torch.Tensor,
    lattice: torch.Tensor,
    recip: torch.Tensor,
    pbc: torch.Tensor,
    graph: torch.Tensor,
    r: float,
    backend: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    r"""Every pair of a periodic system within ``r``, one orientation of each.

    .. math:: \{(i, j, S) : \mathrm{graph}_i = \mathrm{graph}_j,\ \|y_j - y_i + S L\| \le r,\
        (i, S) \ne (j, 0)\}

    modulo :math:`(i, j, S) \sim (j, i, -S)`, up to pairs at distance :math:`r` within
    rounding, with :math:`L` the lattice of the pair's graph and :math:`S_k = 0` along its
    open directions.

    Args:
        home: ``[N, 3]`` float64 positions inside their home cell (fractional coordinates in
            :math:`[0, 1)` along periodic directions).
        lattice: ``[B, 3, 3]`` float64 lattice vectors (rows) of every graph, zero along
            open directions.
        recip: ``[B, 3, 3]`` float64, ``lattice @ recip = diag(pbc)`` (zero columns along
            open directions).
        pbc: ``[B, 3]`` bool, the periodic directions of every graph.
        graph: ``[N]`` int64 graph index of every point, in ``[0, B)``.
        r: search radius.
        backend: one of :data:`BACKENDS`.

    Returns:
        ``(i, j, S, distances)``: int64 ``[P]``, ``[P]``, integer ``[P, 3]``, in no
        particular order, and the float64 distances ``[P]`` up to rounding (vesin) or
        ``None`` (other backends).

    Example::

        >>> home = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
        >>> lattice = torch.diag(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))[None]
        >>> i, j, S, distances = periodic_half_pairs(home, lattice, lattice, torch.tensor([[True, False, False]]),
        ...                                          torch.zeros(1, dtype=torch.long), 1.5, "vesin")
        >>> i.tolist(), j.tolist(), S.abs().tolist(), distances.tolist()
        ([0], [0], [[1, 0, 0]], [1.0])
    """
    if backend == "vesin":
        device = home.device
        found = _vesin_periodic_half_pairs(home.cpu(), lattice.cpu(), recip.cpu(), pbc.cpu(), graph.cpu(), r)
        if found is not None:
            return tuple(t.to(device) for t in found)
        backend = "cells"
    return _image_half_pairs(home, lattice, recip, pbc, graph, r, backend)
