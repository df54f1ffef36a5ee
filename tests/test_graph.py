"""Neighbour graphs: every backend against brute force written plainly here, and against ASE."""
import concurrent.futures
import contextlib
import importlib.util
import itertools
import json
import math
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from e3attn.graph import complete_graph, radius_graph, radius_graph_pbc
from e3attn.graph import edges as edges_module
from e3attn.graph import radius as graph_module
from e3attn.graph import search as _search
from e3attn.graph.cells import cell_list_pairs, ragged_arange
from e3attn.graph.radius import _radius_graph, _radius_graph_pbc
from e3attn.graph.search import BACKENDS, has_torch_cluster

AVAILABLE = [b for b in BACKENDS if b != "torch_cluster" or has_torch_cluster()]
# radii whose squares are exact in binary, so grid-valued clouds test the strict "<" exactly
RADII = [0.5, 0.75, 1.0, 1.5, 2.5]
SETTINGS = settings(max_examples=40, deadline=None)


def edges_of(pairs):
    """``[(src, dst), ...]`` -> ``[2, E]`` int64."""
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T


def brute_radius_graph(pos, r, batch=None, loop=False):
    """All ordered pairs tested one by one, emitted in (dst, src) order."""
    n = pos.shape[0]
    diff = pos[:, None, :] - pos[None, :, :]
    d2 = diff[..., 0] * diff[..., 0] + diff[..., 1] * diff[..., 1] + diff[..., 2] * diff[..., 2]
    pairs = []
    for dst in range(n):
        for src in range(n):
            if batch is not None and batch[src] != batch[dst]:
                continue
            if src == dst:
                if loop:
                    pairs.append((src, dst))
            elif d2[src, dst] < r * r:
                pairs.append((src, dst))
    return edges_of(pairs)


@st.composite
def clouds(draw, max_points=24, grid=True):
    """Positions (on a 1/4 grid: exact arithmetic, many exact ties and duplicates), batch, dtype."""
    n = draw(st.integers(0, max_points))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    if grid:  # small extents make coincident points common
        extent = draw(st.sampled_from([1, 3, 8]))
        coords = draw(st.lists(st.integers(-extent, extent), min_size=3 * n, max_size=3 * n))
        pos = torch.tensor(coords, dtype=dtype).reshape(n, 3) / 4
    else:
        coords = draw(st.lists(st.floats(-3, 3, width=32), min_size=3 * n, max_size=3 * n))
        pos = torch.tensor(coords, dtype=dtype).reshape(n, 3)
    batch = None
    if draw(st.booleans()):  # unsorted, non-contiguous graph indices
        batch = torch.tensor(draw(st.lists(st.sampled_from([0, 2, 5]), min_size=n, max_size=n)), dtype=torch.long)
    return pos, batch


@SETTINGS
@given(cloud=clouds(), r=st.sampled_from(RADII), loop=st.booleans())
def test_radius_graph_equals_brute_force_on_grid_clouds(cloud, r, loop):
    pos, batch = cloud
    expected = brute_radius_graph(pos, r, batch, loop)
    assert torch.equal(radius_graph(pos, r, batch, loop=loop), expected)
    for backend in AVAILABLE:
        assert torch.equal(_radius_graph(pos, r, batch, loop, None, backend), expected), backend


@SETTINGS
@given(cloud=clouds(grid=False), r=st.floats(0.05, 4.0))
def test_radius_graph_equals_brute_force_on_float_clouds(cloud, r):
    pos, batch = cloud
    expected = brute_radius_graph(pos, r, batch)
    for backend in AVAILABLE:
        assert torch.equal(_radius_graph(pos, r, batch, False, None, backend), expected), backend


@SETTINGS
@given(cloud=clouds(max_points=12), r=st.sampled_from(RADII), loop=st.booleans(), cap=st.integers(0, 8))
def test_max_num_neighbors_raises_exactly_when_exceeded(cloud, r, loop, cap):
    pos, batch = cloud
    expected = brute_radius_graph(pos, r, batch, loop)
    degree = [int((expected[1] == i).sum()) for i in range(pos.shape[0])]
    if max(degree, default=0) > cap:
        node = degree.index(max(degree))
        with pytest.raises(ValueError, match=f"node {node} has {degree[node]} incoming edges"):
            radius_graph(pos, r, batch, loop=loop, max_num_neighbors=cap)
    else:
        assert torch.equal(radius_graph(pos, r, batch, loop=loop, max_num_neighbors=cap), expected)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_radius_graph_larger_cloud_with_batch(backend):
    gen = torch.Generator().manual_seed(0)
    pos = torch.rand(1500, 3, generator=gen, dtype=torch.float64) * 6.0
    batch = torch.randint(0, 3, (1500,), generator=gen)
    r = 0.9
    diff = pos[:, None, :] - pos[None, :, :]
    d2 = diff[..., 0] * diff[..., 0] + diff[..., 1] * diff[..., 1] + diff[..., 2] * diff[..., 2]
    adjacency = (d2 < r * r) & (batch[:, None] == batch[None, :]) & ~torch.eye(1500, dtype=torch.bool)
    dst, src = adjacency.T.nonzero(as_tuple=True)  # row-major over (dst, src): already (dst, src) order
    expected = torch.stack([src, dst])
    assert expected.shape[1] > 5_000
    assert torch.equal(_radius_graph(pos, r, batch, False, None, backend), expected)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_dense_cloud_is_the_complete_graph(backend):
    # every node has 299 neighbours: far above torch_cluster's first per-node cap, nothing may be dropped
    pos = torch.rand(300, 3, generator=torch.Generator().manual_seed(5))
    expected = [(s, d) for d in range(300) for s in range(300) if s != d]
    assert torch.equal(_radius_graph(pos, 2.0, None, False, None, backend), edges_of(expected))


def test_radius_graph_edge_cases():
    empty = torch.zeros(0, 3)
    assert radius_graph(empty, 1.0).shape == (2, 0)
    assert radius_graph(empty, 1.0, loop=True).shape == (2, 0)
    one = torch.tensor([[0.3, -1.0, 2.0]])
    assert radius_graph(one, 1.0).shape == (2, 0)
    assert radius_graph(one, 1.0, loop=True).tolist() == [[0], [0]]
    # coincident points are neighbours of each other; the exact cutoff distance is not
    pos = torch.tensor([[0.0, 0, 0], [0.0, 0, 0], [0.0, 0, 0], [1.0, 0, 0]])
    assert radius_graph(pos, 1.0).tolist() == [[1, 2, 0, 2, 0, 1], [0, 0, 1, 1, 2, 2]]
    assert radius_graph(pos, 1.0 + 1e-6).shape[1] == 12


def test_radius_graph_order_dtype_device_symmetry():
    gen = torch.Generator().manual_seed(1)
    pos = torch.rand(300, 3, generator=gen) * 3
    edge_index = radius_graph(pos.requires_grad_(), 0.7, loop=True)
    assert edge_index.dtype == torch.int64 and edge_index.device == pos.device
    src, dst = edge_index.tolist()
    assert list(zip(dst, src)) == sorted(set(zip(dst, src)))  # strictly increasing (dst, src)
    assert set(zip(src, dst)) == set(zip(dst, src))
    assert all((i, i) in set(zip(src, dst)) for i in range(300))


def test_max_num_neighbors():
    # node 0 is the centre of a star of 3 points; the leaves see only the centre
    pos = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [-1.0, 0, 0], [0.0, 1.0, 0]])
    assert radius_graph(pos, 1.2, max_num_neighbors=3).shape[1] == 6
    with pytest.raises(ValueError, match=r"node 0 has 3 incoming edges .* max_num_neighbors=2"):
        radius_graph(pos, 1.2, max_num_neighbors=2)
    with pytest.raises(ValueError, match=r"node 0 has 4 incoming edges"):
        radius_graph(pos, 1.2, loop=True, max_num_neighbors=3)
    assert radius_graph(pos, 0.5, max_num_neighbors=0).shape[1] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pos=torch.zeros(4, 2)), r"pos must have shape \[N, 3\]"),
        (dict(pos=torch.tensor([[0.0, float("nan"), 0]])), "pos contains NaN"),
        (dict(pos=torch.tensor([[0.0, float("inf"), 0]])), "pos contains NaN or infinite"),
        (dict(pos=torch.zeros(4, 3, dtype=torch.long)), "pos must be a floating-point"),
        (dict(r_max=0.0), "r_max must be a positive finite number"),
        (dict(r_max=-1.0), "r_max must be a positive finite number"),
        (dict(r_max=float("inf")), "r_max must be a positive finite number"),
        (dict(r_max=float("nan")), "r_max must be a positive finite number"),
        (dict(r_max="1"), "r_max must be a positive finite number"),
        (dict(r_max=True), "r_max must be a positive finite number"),
        (dict(batch=torch.zeros(3, dtype=torch.long)), r"batch must have shape \[4\]"),
        (dict(batch=torch.zeros(4)), "batch must be an integer tensor"),
        (dict(batch=torch.tensor([0, -1, 0, 0])), "batch must hold non-negative"),
        (dict(max_num_neighbors=-1), "max_num_neighbors must be None or a non-negative int"),
        (dict(max_num_neighbors=2.5), "max_num_neighbors must be None or a non-negative int"),
    ],
)
def test_radius_graph_bad_input(kwargs, match):
    args = dict(pos=torch.zeros(4, 3), r_max=1.0)
    args.update(kwargs)
    pos, r_max = args.pop("pos"), args.pop("r_max")
    with pytest.raises(ValueError, match=match):
        radius_graph(pos, r_max, **args)


def test_radius_tensor_and_integer_r_max():
    pos = torch.tensor([[0.0, 0, 0], [1.5, 0, 0]])
    assert radius_graph(pos, torch.tensor(2.0)).shape[1] == 2
    assert radius_graph(pos, 2).shape[1] == 2


def test_ragged_arange_and_cell_list_chunks():
    segment, values = ragged_arange(torch.tensor([4, 9, 0, 7]), torch.tensor([3, 0, 1, 2]))
    expected = [(k, s + i) for k, (s, c) in enumerate([(4, 3), (9, 0), (0, 1), (7, 2)]) for i in range(c)]
    assert list(zip(segment.tolist(), values.tolist())) == expected
    gen = torch.Generator().manual_seed(2)
    query = torch.rand(60, 3, generator=gen, dtype=torch.float64) * 4
    source = torch.rand(200, 3, generator=gen, dtype=torch.float64) * 4
    d2 = ((query[:, None, :] - source[None, :, :]) ** 2).sum(-1)
    expected = set(map(tuple, (d2 < 1.0).nonzero().tolist()))
    for max_candidates in (1, 37, 2**22):  # tiny chunks: one query point at a time
        q, s = cell_list_pairs(query, source, 1.0, max_candidates=max_candidates)
        assert set(zip(q.tolist(), s.tolist())) == expected
        assert len(q) == len(expected)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_sparse_far_apart_clouds(backend):
    # two tight clusters 1e12 apart: a dense grid of cells would not fit in memory or int64 keys
    pos = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [1e12, 0, 0], [1e12, 0.25, 0], [1e12, 0, 3.0]], dtype=torch.float64)
    assert _radius_graph(pos, 1.0, None, False, None, backend).tolist() == [[1, 0, 3, 2], [0, 1, 2, 3]]


@pytest.mark.parametrize("backend", AVAILABLE)
def test_any_int64_graph_labels(backend):
    # labels beyond 2**53 are not exactly representable in float64: they must never be used as coordinates
    pos = torch.zeros(4, 3)
    batch = torch.tensor([2**53, 2**53 + 1, 2**63 - 1, 2**53])
    assert _radius_graph(pos, 1.0, batch, False, None, backend).tolist() == [[3, 0], [0, 3]]
    assert radius_graph(pos, 1.0, batch).tolist() == [[3, 0], [0, 3]]


@pytest.mark.parametrize("backend", AVAILABLE)
def test_flat_elongated_and_outlying_clouds(backend):
    # boxes that vesin 0.6 cannot grid (its capped cell grid rounds an axis to zero cells and divides by
    # zero): a plane 400 cutoffs wide, a line 1e6 long, a cluster with a far outlier
    gen = torch.Generator().manual_seed(6)
    plane = torch.cat([torch.rand(30, 2, generator=gen, dtype=torch.float64) * 400, torch.zeros(30, 1)], 1)
    plane = torch.cat([plane, plane[:10] + 0.3])  # ten close pairs
    line = torch.zeros(8, 3, dtype=torch.float64)
    line[:, 0] = torch.tensor([0.0, 0.5, 1e6, 1e6 + 0.9, 3e5, 3e5 + 1.1, 7e5, 7e5 + 0.2])
    outlier = torch.cat([torch.rand(40, 3, generator=gen, dtype=torch.float64), torch.tensor([[1e9, 0, 0]])])
    for pos in (plane, line, outlier):
        expected = brute_radius_graph(pos, 1.0)
        assert torch.equal(_radius_graph(pos, 1.0, None, False, None, backend), expected)
        batch = torch.arange(pos.shape[0]) % 3
        assert torch.equal(_radius_graph(pos, 1.0, batch, False, None, backend), brute_radius_graph(pos, 1.0, batch))


def test_batch_of_many_uneven_graphs():
    # vesin searches a batch in one call, every graph translated into its own slot: graphs of very
    # different extents and shapes, in float32 and float64
    gen = torch.Generator().manual_seed(7)
    parts, labels = [], []
    for g in range(40):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        scale = [0.5, 3.0, 1e4][g % 3]
        part = torch.rand(n, 3, generator=gen, dtype=torch.float64) * scale - scale / 2
        if g % 4 == 0:
            part[:, 2] = 0.0  # flat
        parts.append(part)
        labels += [3 * g + 1] * n
    pos, batch = torch.cat(parts), torch.tensor(labels)
    order = torch.randperm(pos.shape[0], generator=gen)
    pos, batch = pos[order], batch[order]
    for dtype in (torch.float32, torch.float64):
        p = pos.to(dtype)
        assert torch.equal(radius_graph(p, 1.3, batch), brute_radius_graph(p, 1.3, batch))


def test_huge_r_max_and_coordinates():
    # r_max**2 must be finite (and normal) in the dtype of pos: refused otherwise, not silently wrong
    far = torch.tensor([[0.0, 0, 0], [5e154, 0, 0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"r_max=1e\+155 is out of range for torch.float64 positions"):
        radius_graph(far, 1e155)
    with pytest.raises(ValueError, match=r"r_max=1e\+20 is out of range for torch.float32 positions"):
        radius_graph(torch.tensor([[0.0, 0, 0], [3e19, 0, 0]]), 1e20)
    with pytest.raises(ValueError, match=r"r_max=1e-30 is out of range for torch.float32"):
        radius_graph(torch.zeros(2, 3), 1e-30)
    with pytest.raises(ValueError, match="r_max=1e\\+155 is out of range"):
        radius_graph_pbc(far, torch.eye(3, dtype=torch.float64), [True, False, False], 1e155)
    # the largest usable cutoff, and coordinates near 1e154 and 1e300, work
    assert radius_graph(far / 10, 1e154).tolist() == [[1, 0], [0, 1]]
    assert radius_graph(far, 1e154).shape == (2, 0)
    for magnitude in (1e154, 1e300):
        pos = torch.tensor([[magnitude, 0, 0], [magnitude, 0.5, 0], [-magnitude, 0, 0], [0, 0, 0]], dtype=torch.float64)
        assert torch.equal(radius_graph(pos, 1.0), brute_radius_graph(pos, 1.0))
        assert torch.equal(radius_graph(pos, 1.0), edges_of([(1, 0), (0, 1)]))
    # a cloud spread over more than 2**1000 cutoffs cannot be searched in units of r_max
    with pytest.raises(ValueError, match=r"pos has coordinates up to 1e\+300, more than 2\*\*1000 times r_max"):
        radius_graph(torch.tensor([[1e300, 0, 0], [0.0, 0, 0]], dtype=torch.float64), 1e-10)


def test_numbers_numpy_scalars_and_bools():
    pos = torch.tensor([[0.0, 0, 0], [1.5, 0, 0]])
    expected = [[1, 0], [0, 1]]
    for r_max in (2, 2.0, np.float32(2.0), np.float64(2.0), np.int64(2), np.array(2.0), torch.tensor(2.0)):
        assert radius_graph(pos, r_max).tolist() == expected, r_max
        assert radius_graph_pbc(pos, torch.eye(3) * 9, [True] * 3, r_max)[0].tolist() == expected, r_max
    assert radius_graph(pos, 2.0, max_num_neighbors=np.int64(1)).tolist() == expected
    assert radius_graph(pos, 2.0, loop=np.bool_(True)).shape[1] == 4
    assert complete_graph(np.int64(2), loop=np.bool_(False)).tolist() == expected
    for r_max in (True, np.bool_(True), torch.tensor(True), np.array(True)):
        with pytest.raises(ValueError, match="r_max must be a positive finite number"):
            radius_graph(pos, r_max)
    for value in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="loop must be a bool"):
            radius_graph(pos, 2.0, loop=value)
    for value in (True, np.bool_(False), 2.0, np.float32(3)):
        with pytest.raises(ValueError, match="max_num_neighbors must be None or a non-negative int"):
            radius_graph(pos, 2.0, max_num_neighbors=value)
    with pytest.raises(ValueError, match="num_nodes must be a non-negative int"):
        complete_graph(np.bool_(True))


def test_concurrent_calls_and_released_buffers(monkeypatch):
    # every thread has its own vesin buffers; results beyond _VESIN_KEEP_PAIRS are copied out and the
    # buffers released
    gen = torch.Generator().manual_seed(8)
    clouds = [torch.rand(n, 3, generator=gen) * 3 for n in (40, 50, 60, 70, 80, 90)]
    expected = [brute_radius_graph(pos, 0.8) for pos in clouds]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert all(map(torch.equal, pool.map(lambda pos: radius_graph(pos, 0.8), clouds), expected))
    monkeypatch.setattr(_search, "_VESIN_KEEP_PAIRS", 10)
    for pos, edges in zip(clouds, expected):
        assert torch.equal(radius_graph(pos, 0.8), edges)
        assert getattr(_search._VESIN, "search", None) is None


@pytest.mark.slow
def test_radius_graph_under_torch_compile_fullgraph():
    # the search is a custom operator with a data-dependent number of edges: one compiled graph, no
    # break, the same edges as eager for clouds of different sizes; its value checks still run
    def energy(pos, batch, cell):
        edge_index = radius_graph(pos, 0.9, batch)
        vec = pos[edge_index[0]] - pos[edge_index[1]]
        periodic, shifts = radius_graph_pbc(pos, cell, [True, True, False], 0.7, batch)
        vec_pbc = pos[periodic[0]] - pos[periodic[1]] + shifts @ cell
        return (vec * vec).sum() + vec_pbc.norm(dim=1).sum(), edge_index, periodic, shifts

    torch._dynamo.reset()
    compiled = torch.compile(energy, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(9)
    cell = torch.tensor([[2.0, 0.0, 0.0], [0.5, 2.5, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    for n in (40, 70):
        pos = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 3
        batch = torch.randint(0, 2, (n,), generator=gen)
        eager, traced = energy(pos, batch, cell), compiled(pos, batch, cell)
        assert torch.allclose(eager[0], traced[0], rtol=1e-12, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(eager[1:], traced[1:]))
    bad = pos.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="pos contains NaN"):
        compiled(bad, batch, cell)


def test_custom_operators_pass_opcheck():
    pos = torch.rand(30, 3, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * 2
    batch = torch.tensor([5, 2**40] * 15)
    cell = torch.tensor([[[2.0, 0, 0], [0.3, 2.0, 0], [0, 0, 2.5]]], dtype=torch.float64)
    torch.library.opcheck(torch.ops.e3attn.radius_graph, (pos, 0.8, batch, True, None))
    torch.library.opcheck(torch.ops.e3attn.radius_graph_pbc, (pos, cell, torch.tensor([[True, True, False]]), 0.8, None))


# ---------------------------------------------------------------- periodic


def brute_radius_graph_pbc(pos, cells, pbc, r, graph):
    """Every pair, every image shift in a generous box, tested one by one; (dst, src, shift) order."""
    grids = []
    for cell, periodic in zip(cells, pbc):
        # plane spacings are >= the smallest singular value of the periodic lattice vectors;
        # positions lie within 2 cells of the origin, hence the + 4
        rows = cell[periodic]
        reach = math.ceil(r / float(torch.linalg.svdvals(rows.double()).min())) + 4 if len(rows) else 0
        ranges = [range(-reach, reach + 1) if p else [0] for p in periodic.tolist()]
        grid = torch.tensor(list(itertools.product(*ranges)), dtype=pos.dtype)  # lexicographic order
        grids.append((grid, grid @ cell))
    pairs, shifts = [], []
    for dst in range(pos.shape[0]):
        for src in range(pos.shape[0]):
            g = int(graph[src])
            if g != int(graph[dst]):
                continue
            grid, offsets = grids[g]
            v = pos[src] - pos[dst] + offsets
            near = v[:, 0] * v[:, 0] + v[:, 1] * v[:, 1] + v[:, 2] * v[:, 2] < r * r
            for shift in grid[near].tolist():
                if src != dst or any(shift):
                    pairs.append((src, dst))
                    shifts.append(shift)
    return edges_of(pairs), torch.tensor(shifts, dtype=pos.dtype).reshape(-1, 3)


@st.composite
def crystals(draw, num_graphs=1):
    """Grid-valued (often skewed, sometimes small) cells, unwrapped positions, random pbc."""
    cells, pbcs, pos, graph = [], [], [], []
    for g in range(num_graphs):
        while True:
            cell = torch.tensor(draw(st.lists(st.integers(-2, 4), min_size=9, max_size=9)), dtype=torch.float64)
            cell = cell.reshape(3, 3) / 2 + torch.eye(3) * draw(st.sampled_from([0.5, 1.0, 2.0]))
            if float(torch.linalg.svdvals(cell).min()) >= 0.5:  # bounded number of images
                break
        n = draw(st.integers(1, 4))
        frac = torch.tensor(draw(st.lists(st.integers(-4, 7), min_size=3 * n, max_size=3 * n)), dtype=torch.float64)
        pos.append(frac.reshape(n, 3) / 4 @ cell)  # fractional coordinates in [-1, 2): not wrapped
        cells.append(cell)
        pbcs.append(draw(st.lists(st.booleans(), min_size=3, max_size=3)))
        graph += [g] * n
    return torch.cat(pos), torch.stack(cells), torch.tensor(pbcs), torch.tensor(graph)


@settings(max_examples=30, deadline=None)
@given(crystal=crystals(), r=st.sampled_from([0.75, 1.0, 1.5, 2.5]))
def test_pbc_equals_brute_force(crystal, r):
    pos, cells, pbc, graph = crystal
    expected = brute_radius_graph_pbc(pos, cells, pbc, r, graph)
    edge_index, shifts = radius_graph_pbc(pos, cells[0], pbc[0], r)
    assert torch.equal(edge_index, expected[0]) and torch.equal(shifts, expected[1])
    for backend in AVAILABLE:
        edge_index, shifts = _radius_graph_pbc(pos, cells, pbc, r, graph, backend)
        assert torch.equal(edge_index, expected[0]) and torch.equal(shifts, expected[1]), backend


@settings(max_examples=15, deadline=None)
@given(crystal=crystals(num_graphs=2), r=st.sampled_from([1.0, 1.5]))
def test_pbc_batch_of_two_crystals(crystal, r):
    pos, cells, pbc, graph = crystal
    expected = brute_radius_graph_pbc(pos, cells, pbc, r, graph)
    edge_index, shifts = radius_graph_pbc(pos, cells, pbc, r, batch=graph)
    assert torch.equal(edge_index, expected[0]) and torch.equal(shifts, expected[1])


def test_pbc_simple_cubic_shells():
    # one atom, unit cubic cell: 6 neighbours at 1, 12 at sqrt(2), 8 at sqrt(3), 6 at 2
    pos = torch.tensor([[0.25, 0.5, 0.75]], dtype=torch.float64)
    counts = {r: radius_graph_pbc(pos, torch.eye(3, dtype=torch.float64), [True] * 3, r)[0].shape[1]
              for r in (0.99, 1.01, 1.5, 1.8, 2.01)}
    assert counts == {0.99: 0, 1.01: 6, 1.5: 18, 1.8: 26, 2.01: 32}


def test_pbc_edge_vectors_symmetry_and_types():
    gen = torch.Generator().manual_seed(3)
    cell = torch.tensor([[3.0, 0.0, 0.0], [1.2, 2.5, 0.0], [0.4, -0.7, 2.2]])
    pos = torch.rand(7, 3, generator=gen) * 5 - 1
    edge_index, shifts = radius_graph_pbc(pos, cell, torch.tensor([True, True, True]), 2.5)
    assert edge_index.dtype == torch.int64 and shifts.dtype == pos.dtype
    assert torch.equal(shifts, shifts.round())
    src, dst = edge_index
    edge_vec = pos[src] - pos[dst] + shifts @ cell
    assert float(edge_vec.norm(dim=1).max()) < 2.5
    triples = set(zip(src.tolist(), dst.tolist(), map(tuple, shifts.tolist())))
    assert triples == {(d, s, tuple(-x for x in sh)) for s, d, sh in triples}
    assert any(s == d for s, d, _ in triples)  # |a3| < r: every atom sees its own images


def test_pbc_without_periodic_directions_is_the_radius_graph():
    gen = torch.Generator().manual_seed(4)
    pos = torch.rand(60, 3, generator=gen, dtype=torch.float64) * 3
    batch = torch.randint(0, 2, (60,), generator=gen)
    edge_index, shifts = radius_graph_pbc(pos, torch.zeros(3, 3, dtype=torch.float64), False, 1.0, batch)
    assert torch.equal(edge_index, radius_graph(pos, 1.0, batch))
    assert not shifts.any()


def test_pbc_edge_cases():
    edge_index, shifts = radius_graph_pbc(torch.zeros(0, 3), torch.eye(3), [True] * 3, 1.0)
    assert edge_index.shape == (2, 0) and shifts.shape == (0, 3)
    # a slab: the non-periodic third lattice vector may be zero
    cell = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 0]])
    edge_index, shifts = radius_graph_pbc(torch.zeros(1, 3), cell, [True, True, False], 1.2)
    assert shifts.tolist() == [[-1, 0, 0], [0, -1, 0], [0, 1, 0], [1, 0, 0]]
    # a duplicate and a copy one lattice vector away: distance 0 through the right shifts
    pos = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [1.1, 0.2, 0.3]], dtype=torch.float64)
    for backend in AVAILABLE:
        edge_index, shifts = _radius_graph_pbc(
            pos, torch.eye(3, dtype=torch.float64)[None], torch.tensor([[True, False, False]]), 0.5,
            torch.zeros(3, dtype=torch.long), backend,
        )
        assert edge_index.tolist() == [[1, 2, 0, 2, 0, 1], [0, 0, 1, 1, 2, 2]]
        assert shifts[:, 0].tolist() == [0, -1, 0, -1, 1, 1] and not shifts[:, 1:].any()


@st.composite
def float_crystals(draw):
    """A skewed cell with float entries, unwrapped float positions and random pbc (ASE needs full cells)."""
    while True:
        cell = torch.tensor(draw(st.lists(st.floats(-1.5, 1.5), min_size=9, max_size=9)), dtype=torch.float64)
        cell = cell.reshape(3, 3) + torch.eye(3, dtype=torch.float64) * draw(st.floats(1.5, 4.0))
        if float(torch.linalg.svdvals(cell).min()) >= 0.7:
            break
    n = draw(st.integers(1, 12))
    frac = torch.tensor(draw(st.lists(st.floats(-1.0, 2.0), min_size=3 * n, max_size=3 * n)), dtype=torch.float64)
    pbc = draw(st.lists(st.booleans(), min_size=3, max_size=3))
    return frac.reshape(n, 3) @ cell, cell, pbc


@settings(max_examples=40, deadline=None)
@given(crystal=float_crystals(), r=st.floats(0.5, 3.0))
def test_pbc_equals_ase(crystal, r):
    from ase.neighborlist import primitive_neighbor_list

    pos, cell, pbc = crystal
    i, j, shifts = primitive_neighbor_list("ijS", pbc, cell.numpy(), pos.numpy(), r, self_interaction=False)
    # ASE: D = pos[j] - pos[i] + S @ cell; here src = j, dst = i
    expected = sorted(zip(i.tolist(), j.tolist(), map(tuple, shifts.tolist())))
    for backend in AVAILABLE:
        edge_index, found = _radius_graph_pbc(pos, cell[None], torch.tensor([pbc]), r, torch.zeros(len(pos), dtype=torch.long), backend)
        got = list(zip(edge_index[1].tolist(), edge_index[0].tolist(), map(tuple, found.long().tolist())))
        assert got == expected, backend


def test_pbc_unwrapped_positions_far_from_the_cell():
    # points up to 300 cells away: the shifts carry the wrapping (large ones take the stable-sort path)
    gen = torch.Generator().manual_seed(11)
    cell = torch.tensor([[2.2, 0.0, 0.0], [0.7, 2.0, 0.0], [-0.4, 0.3, 2.5]], dtype=torch.float64)
    home = torch.rand(9, 3, generator=gen, dtype=torch.float64) @ cell
    for spread in (3, 300):
        wrap = torch.randint(-spread, spread + 1, (9, 3), generator=gen)
        pos = home + wrap.double() @ cell
        edge_index, shifts = radius_graph_pbc(pos, cell, [True] * 3, 2.4)
        reference, reference_shifts = radius_graph_pbc(home, cell, [True] * 3, 2.4)
        src, dst = reference
        moved = reference_shifts.long() + wrap[dst] - wrap[src]
        triples = sorted(zip(dst.tolist(), src.tolist(), map(tuple, moved.tolist())))
        assert list(zip(edge_index[1].tolist(), edge_index[0].tolist(), map(tuple, shifts.long().tolist()))) == triples
        edge_vec = pos[edge_index[0]] - pos[edge_index[1]] + shifts @ cell
        assert float(edge_vec.norm(dim=1).max()) < 2.4


def test_pbc_cells_vesin_cannot_grid():
    # a periodic sheet 400 cutoffs wide and 0.9 thick: vesin 0.6 would divide by zero
    gen = torch.Generator().manual_seed(12)
    cell = torch.diag(torch.tensor([400.0, 400.0, 0.9], dtype=torch.float64))
    pos = torch.rand(12, 3, generator=gen, dtype=torch.float64) @ cell
    pos = torch.cat([pos, pos[:4] + 0.4])
    for pbc in ([True, True, True], [True, True, False]):
        expected = brute_radius_graph_pbc(pos, cell[None], torch.tensor([pbc]), 1.0, torch.zeros(16, dtype=torch.long))
        for backend in AVAILABLE:
            edge_index, shifts = _radius_graph_pbc(pos, cell[None], torch.tensor([pbc]), 1.0, torch.zeros(16, dtype=torch.long), backend)
            assert torch.equal(edge_index, expected[0]) and torch.equal(shifts, expected[1]), backend


@pytest.mark.parametrize(
    "cell, r_max, match",
    [
        ([[1, 0, 0], [1, 1e-7, 0], [0, 0, 1]], 1.0, r"direction [01] are 1e-07 apart, so r_max=1 reaches 1.2e\+15 periodic"),
        ([[1e-10, 0, 0], [0, 1e-10, 0], [0, 0, 1e-10]], 1.0, r"direction \d are 1e-10 apart, so r_max=1 reaches 8e\+30"),
        ([[0.01, 0, 0], [0, 1, 0], [0, 0, 1]], 30.0, r"direction 0 are 0.01 apart"),
    ],
)
def test_pbc_refuses_unreasonable_numbers_of_images(cell, r_max, match):
    pos = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        radius_graph_pbc(pos, torch.tensor(cell, dtype=torch.float64), [True] * 3, r_max)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cell=torch.eye(4)), r"cell must have shape \[3, 3\] or \[B, 3, 3\]"),
        (dict(cell=torch.eye(3, dtype=torch.float64)), "cell must have the dtype and device of pos"),
        (dict(cell=torch.full((3, 3), float("nan"))), "cell contains NaN"),
        (dict(cell=torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [0, 0, 1]])), "linearly independent"),
        (dict(pbc=[1, 1, 1]), "pbc must hold booleans"),
        (dict(pbc=[True, True]), r"pbc must have shape \[3\] or \[B, 3\]"),
        (
            dict(cell=torch.eye(3).expand(2, 3, 3), pbc=torch.ones(3, 3, dtype=torch.bool)),
            "cell has 2 graphs but pbc has 3",
        ),
        (dict(cell=torch.eye(3).expand(2, 3, 3), batch=torch.tensor([0, 2])), "batch holds graph index 2"),
        (dict(r_max=0), "r_max must be a positive finite number"),
    ],
)
def test_pbc_bad_input(kwargs, match):
    args = dict(pos=torch.zeros(2, 3), cell=torch.eye(3), pbc=[True] * 3, r_max=1.0, batch=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        radius_graph_pbc(**args)


@contextlib.contextmanager
def _torch_assembly():
    """The graphs of CPU tensors assembled with torch instead of NumPy: the code path of GPUs (and bfloat16)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph_module, "_on_host", lambda pos: False)
        yield


@settings(max_examples=25, deadline=None)
@given(cloud=clouds(), r=st.sampled_from(RADII), loop=st.booleans(), crystal=crystals(num_graphs=2))
def test_torch_assembly_equals_brute_force(cloud, r, loop, crystal):
    # on GPUs the graph is sorted and decoded with torch; the same functions run here on CPU tensors
    pos, batch = cloud
    pbc_pos, cells, pbc, graph = crystal
    expected_pbc = brute_radius_graph_pbc(pbc_pos, cells, pbc, r, graph)
    with _torch_assembly():
        for backend in AVAILABLE:
            assert torch.equal(_radius_graph(pos, r, batch, loop, None, backend), brute_radius_graph(pos, r, batch, loop))
            edge_index, shifts = _radius_graph_pbc(pbc_pos, cells, pbc, r, graph, backend)
            assert torch.equal(edge_index, expected_pbc[0]) and torch.equal(shifts, expected_pbc[1]), backend


def _half_list(case: str, n: int, rng: np.random.Generator):
    """``(i, j, shift or None)`` on ``n`` nodes: a half list shaped to reach every branch of the host assembly."""
    if case == "empty":
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int32)
    if case == "hub":  # node 0 paired with everyone: one destination range above the insertion limit
        others = rng.permutation(np.arange(1, n))
        return np.zeros(n - 1, np.int64), others, None
    if case == "open":  # 40,000 edges: enough for the threads
        i, j = rng.integers(0, n, (2, 40000))
        keep = i < j
        return i[keep], j[keep], None
    # 300 images of one pair (a cell much smaller than r) in random order: a range that stays out of order
    # after the counting sorts, beside random pairs of small shifts; "zero": every shift is zero. Pairs as
    # vesin gives them (uint64 indices, int32 shifts)
    pairs = rng.integers(0, n, (2, 1200))
    i, j = np.concatenate([pairs[0], np.full(300, 7)]), np.concatenate([pairs[1], np.full(300, 3)])
    images = np.stack(np.unravel_index(rng.permutation(7**3)[:300], (7, 7, 7)), 1) - 3
    shift = np.concatenate([rng.integers(-2, 3, (1200, 3)), images]).astype(np.int32)
    return i.astype(np.uint64), j.astype(np.uint64), (shift * 0 if case == "zero" else shift)


# 1 node (its self-loop alone); 150: blocks of 64 nodes; 10^5: of 8,192 (open) or 64 (images); 2^27: 64-bit keys
@pytest.mark.parametrize("case, n", [("empty", 1), ("empty", 150), ("hub", 150), ("open", 150), ("images", 150),
                                     ("zero", 150), ("open", 10**5), ("images", 10**5), ("open", 2**27),
                                     ("images", 2**27)])
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_host_assembly_equals_lexsort(case, n, loop, threads):
    # the blockwise sort of e3attn.graph.csr against NumPy's lexsort of the edges (dst, src, shift)
    i, j, shift = _half_list(case, n, np.random.default_rng(len(case)))
    loop = loop and shift is None and n < 10**6  # self-loops: open graphs only
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        edge_index, shifts = edges_module._csr_edges(i, j, shift, n, loop, torch.float64)
    finally:
        torch.set_num_threads(before)
    i, j, nodes = i.astype(np.int64), j.astype(np.int64), np.arange(n if loop else 0)
    dst, src = np.concatenate([i, j, nodes]), np.concatenate([j, i, nodes])
    s = np.zeros((len(dst), 3), np.int64) if shift is None else np.concatenate([shift, -shift]).astype(np.int64)
    order = np.lexsort((s[:, 2], s[:, 1], s[:, 0], src, dst))
    np.testing.assert_array_equal(edge_index, np.stack([src[order], dst[order]]))
    if shift is None:
        assert shifts is None
    else:
        assert shifts.dtype == np.float64
        np.testing.assert_array_equal(shifts, s[order].astype(np.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_positions(dtype):
    # NumPy has no bfloat16: such graphs are assembled with torch; numba has no float16: its shifts are decoded wider
    pos = (torch.rand(40, 3, generator=torch.Generator().manual_seed(13)) * 3).to(dtype)
    assert torch.equal(radius_graph(pos, 1.0), brute_radius_graph(pos, 1.0))
    cell = (torch.eye(3) * 3).to(dtype)
    edge_index, shifts = radius_graph_pbc(pos, cell, [True, True, False], 1.0)
    expected = brute_radius_graph_pbc(pos, cell[None], torch.tensor([[True, True, False]]), 1.0, torch.zeros(40, dtype=torch.long))
    assert torch.equal(edge_index, expected[0]) and torch.equal(shifts, expected[1]) and shifts.dtype == dtype


# ---------------------------------------------------------------- complete graph


@settings(max_examples=30, deadline=None)
@given(labels=st.lists(st.integers(0, 3), max_size=12), loop=st.booleans(), with_batch=st.booleans())
def test_complete_graph_equals_itertools(labels, loop, with_batch):
    n = len(labels)
    batch = torch.tensor(labels, dtype=torch.long) if with_batch else None
    expected = [
        (s, d)
        for d, s in itertools.product(range(n), repeat=2)
        if (not with_batch or labels[s] == labels[d]) and (loop or s != d)
    ]
    assert torch.equal(complete_graph(n, batch, loop=loop), edges_of(expected))


def test_complete_graph_bad_input():
    with pytest.raises(ValueError, match="num_nodes must be a non-negative int"):
        complete_graph(-1)
    with pytest.raises(ValueError, match="num_nodes must be a non-negative int"):
        complete_graph(2.0)
    with pytest.raises(ValueError, match=r"batch must have shape \[3\]"):
        complete_graph(3, torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------- benchmark script


def test_benchmark_quick_run(tmp_path):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "radius_graph.py"
    spec = importlib.util.spec_from_file_location("bench_radius_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "radius_graph.json"
    threads = torch.get_num_threads()
    module.main(["--quick", "--device", "cpu", "--out", str(out)])
    assert torch.get_num_threads() == threads
    rows = json.loads(out.read_text())["results"]
    methods = {name: {row["method"] for row in rows if row["system"] == name} for name in ("open", "fcc", "triclinic")}
    assert methods["open"] >= {"e3attn", "e3attn[cells]", "vesin", "vesin[sorted]", "dense"}
    assert methods["fcc"] == methods["triclinic"] == {"e3attn", "vesin", "vesin[sorted]"}
    for row in rows:  # every method of a case found the same edges as vesin
        vesin = [other for other in rows if other["method"] == "vesin" and all(
            other[key] == row[key] for key in ("system", "num_points", "threads"))]
        assert row["num_edges"] == vesin[0]["num_edges"] > 0
        assert row["wall_ms"] > 0 and row["cpu_ratio_to_vesin"] > 0
