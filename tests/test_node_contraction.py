"""The attention with its radial weights contracted at the nodes (e3attn.node_contraction, e3attn.kernels.segment_ops):
the operators against independent references and their own derivatives, the layer against the plain formulation
(values, first and second derivatives) in float64, edge cases, repeatability, and where it applies. Tests taking
the ``backend`` fixture run on the numba kernels and on the Triton kernels (of the GPU, in Triton's interpreter)."""
import functools

import pytest
import torch
from e3nn import o3

from e3attn import kernels, radius_graph
from e3attn.attention import EquivariantAttention
from e3attn.kernels import segment_ops
from e3attn.tensor_product import SphericalTensorProduct
from kernel_switch import plain

pytest.importorskip("numba")

# a small structure: two blocks (path offset, K, 2l+1, channels per head, L offset, z offset), paths 13-19 unused
HEADS, HIDDEN, PATHS = 2, 3, 20
BLOCKS = torch.tensor([[0, 4, 1, 2, 0, 0], [4, 3, 3, 1, 48, 4]])
DIMS = [HEADS, HIDDEN, PATHS, 10, 66]
DEGREES = torch.tensor([0, 3, 1, 0, 4, 2, 5])  # nodes 0 and 3 without incoming edges


def _graph(degrees=DEGREES):
    rowptr = torch.cat([torch.zeros(1, dtype=torch.long), degrees.cumsum(0)])
    return rowptr, torch.repeat_interleave(torch.arange(degrees.shape[0]), degrees)


def _expanded(z, lt):
    """The reference :math:`Q_i = E(z_i, L)` ``[N, heads * hidden, paths]``, block by block from the definition."""
    q = z.new_zeros(z.shape[0], HEADS, HIDDEN, PATHS)
    for poff, k, dim_l, width, loff, zoff in BLOCKS.tolist():
        zb = z[:, zoff : zoff + HEADS * width * dim_l].reshape(-1, HEADS, width, dim_l)
        lb = lt[loff : loff + HEADS * width * HIDDEN * k].reshape(HEADS, width, HIDDEN, k)
        q[..., poff : poff + k * dim_l] = torch.einsum("nawm,awhk->nahmk", zb, lb).reshape(-1, HEADS, HIDDEN, k * dim_l)
    return q.reshape(z.shape[0], HEADS * HIDDEN, PATHS)


def _operands(seed=0, degrees=DEGREES):
    g = torch.Generator().manual_seed(seed)
    nodes, edges = degrees.shape[0], int(degrees.sum())

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    return rand(edges, PATHS), rand(edges, HEADS * HIDDEN), rand(nodes, DIMS[3]), rand(DIMS[4])


def test_node_operators_equal_their_definitions(backend):
    rowptr, dst = _graph()
    y, a, z, lt = _operands()
    q = _expanded(z, lt)
    t, r = segment_ops.node_expand(y, a, z, lt, BLOCKS, rowptr, DIMS)
    torch.testing.assert_close(t, (y[:, None, :] * q[dst]).sum(-1), atol=1e-13, rtol=0)
    torch.testing.assert_close(r, (a[:, :, None] * q[dst]).sum(1), atol=1e-13, rtol=0)
    u = torch.zeros(z.shape[0], HEADS * HIDDEN, PATHS, dtype=torch.float64).index_add(0, dst, a[:, :, None] * y[:, None])
    w = torch.randn(z.shape, dtype=torch.float64)
    o, glt = segment_ops.node_outer(a, y, lt, w, BLOCKS, rowptr, DIMS)
    # R is the adjoint of E and X the gradient of <E(z, L), U> in L: checked through autograd of the reference
    (ref_o,) = torch.autograd.grad((_expanded(z, lt) * u.detach()).sum(), z, retain_graph=True)
    (ref_glt,) = torch.autograd.grad((_expanded(w, lt) * u.detach()).sum(), lt)
    torch.testing.assert_close(o, ref_o, atol=1e-13, rtol=0)
    torch.testing.assert_close(glt, ref_glt, atol=1e-13, rtol=0)
    assert torch.equal(o[[0, 3]], torch.zeros_like(o[[0, 3]]))  # no incoming edges: zero


def test_node_outer_is_zero_where_no_block_reaches(backend):
    """z and L entries that no block of the table uses (the operator allows them) get zero gradients."""
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands())
    dims = DIMS[:3] + [DIMS[3] + 2, DIMS[4] + 4]
    wide_z = torch.cat([z, torch.ones(z.shape[0], 2, dtype=z.dtype)], 1)
    wide_lt = torch.cat([lt, torch.ones(4, dtype=lt.dtype)])
    o, glt = segment_ops.node_outer(a, y, wide_lt, wide_z, BLOCKS, rowptr, dims)
    ref_o, ref_glt = segment_ops.node_outer(a, y, lt, z, BLOCKS, rowptr, DIMS)
    assert torch.equal(o[:, DIMS[3]:], torch.zeros_like(o[:, DIMS[3]:]))
    assert torch.equal(glt[DIMS[4]:], torch.zeros(4, dtype=glt.dtype))
    torch.testing.assert_close(o[:, :DIMS[3]], ref_o, atol=1e-13, rtol=0)
    torch.testing.assert_close(glt[:DIMS[4]], ref_glt, atol=1e-13, rtol=0)


def test_node_operators_with_hub_nodes_and_wide_blocks(backend):
    """Segments longer than a kernel's step of edges (a hub of 40 edges) and per-node matrices wider than its tiles
    (80 rows, 96 columns): every chunk of edges, rows and columns, against the definitions."""
    heads, hidden, kdim, dim_l, width = 2, 40, 30, 3, 2
    blocks = torch.tensor([[0, kdim, dim_l, width, 0, 0]])
    dims = [heads, hidden, 96, heads * width * dim_l, heads * width * hidden * kdim]
    degrees = torch.tensor([40, 0, 17, 3])
    rowptr, dst = _graph(degrees)
    g = torch.Generator().manual_seed(5)
    y, a = torch.randn(60, dims[2], generator=g, dtype=torch.float64), torch.randn(60, heads * hidden, generator=g,
                                                                                    dtype=torch.float64)
    z, lt = torch.randn(4, dims[3], generator=g, dtype=torch.float64), torch.randn(dims[4], generator=g,
                                                                                 dtype=torch.float64)
    q = torch.zeros(4, heads, hidden, dims[2], dtype=torch.float64)
    q[..., : dim_l * kdim] = torch.einsum("nawm,awhk->nahmk", z.reshape(4, heads, width, dim_l),
                                          lt.reshape(heads, width, hidden, kdim)).reshape(4, heads, hidden, -1)
    q = q.reshape(4, heads * hidden, dims[2])
    t, r = segment_ops.node_expand(y, a, z, lt, blocks, rowptr, dims)
    torch.testing.assert_close(t, torch.einsum("ep,ejp->ej", y, q[dst]), atol=1e-12, rtol=0)
    torch.testing.assert_close(r, torch.einsum("ej,ejp->ep", a, q[dst]), atol=1e-12, rtol=0)
    u = torch.zeros_like(q).index_add(0, dst, a[:, :, None] * y[:, None])
    o, glt = segment_ops.node_outer(a, y, lt, z, blocks, rowptr, dims)
    ub = u.reshape(4, heads, hidden, dims[2])[..., : dim_l * kdim].reshape(4, heads, hidden, dim_l, kdim)
    ref_o = torch.einsum("awhk,nahmk->nawm", lt.reshape(heads, width, hidden, kdim), ub).reshape(4, -1)
    ref_glt = torch.einsum("nawm,nahmk->awhk", z.reshape(4, heads, width, dim_l), ub).reshape(-1)
    torch.testing.assert_close(o, ref_o, atol=1e-11, rtol=0)
    torch.testing.assert_close(glt, ref_glt, atol=1e-11, rtol=0)


def test_node_operators_one_output_at_a_time(backend):
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands(1))
    t, r = segment_ops.node_expand(y, a, z, lt, BLOCKS, rowptr, DIMS)
    assert torch.equal(segment_ops.node_expand(y, None, z, lt, BLOCKS, rowptr, DIMS)[0], t)
    assert torch.equal(segment_ops.node_expand(None, a, z, lt, BLOCKS, rowptr, DIMS)[1], r)
    o, g = segment_ops.node_outer(a, y, lt, z, BLOCKS, rowptr, DIMS)
    assert torch.equal(segment_ops.node_outer(a, y, lt, None, BLOCKS, rowptr, DIMS)[0], o)
    assert torch.equal(segment_ops.node_outer(a, y, None, z, BLOCKS, rowptr, DIMS)[1], g)
    assert segment_ops.node_outer(a, y, None, z, BLOCKS, rowptr, DIMS)[0].numel() == 0


def _through(route, op):
    """``op`` called through PyTorch's dispatcher (as under ``torch.compile``) or as the layer calls it in eager mode
    (``segment_ops.call``: the implementation and autograd without the dispatcher)."""
    return op if route == "dispatcher" else functools.partial(segment_ops.call, op)


def _one_pass_gives_every_output(y, a, z, lt, blocks, rowptr, dims) -> None:
    """``node_pass`` with all four outputs (expansions and sums sharing one buffer, node after node) equals the
    operators called one at a time."""
    from e3attn.kernels import segments

    t, r = segment_ops.node_expand(y, a, z, lt, blocks, rowptr, dims)
    o, g = segment_ops.node_outer(a, y, lt, z, blocks, rowptr, dims)
    outs = [torch.empty_like(t).reshape(-1), torch.empty_like(r), torch.empty_like(o),
            torch.empty(1, dims[4], dtype=y.dtype)]
    segments.node_pass(y.numpy(), a.reshape(-1).numpy(), z.numpy(), lt.numpy(), blocks.numpy(), dims[0], dims[1],
                       rowptr.numpy(), 0, 1, *(x.numpy() for x in outs))  # one group: every node in turn
    for got, want in zip((outs[0], outs[1], outs[2], outs[3][0]), (t.reshape(-1), r, o, g)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_one_node_pass_gives_every_output_at_once():
    """All four outputs of one pass equal the operators', with path features that are not zero in the columns no
    block covers (13-19)."""
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands(4))
    _one_pass_gives_every_output(y, a, z, lt, BLOCKS, rowptr, DIMS)
    assert (y[:, 13:] != 0).all()


_MORE_ROWS = torch.tensor([[0, 2, 1, 1, 0, 0], [2, 2, 3, 1, 32, 2]])  # 2 paths into 0e, 2 x 3 into 1o; 8, 9: none
_MORE_ROWS_DIMS = [2, 8, 10, 8, 64]  # heads, hidden (16 rows), paths, z width, L size


def _more_rows_case():
    """Operands with more rows than paths and the definition of ``Q_i`` ``[N, rows, paths]`` (zero in the paths that
    no block covers, where ``y`` is not)."""
    heads, hidden, paths = _MORE_ROWS_DIMS[:3]
    rowptr, dst = _graph(torch.tensor([3, 0, 5, 1]))
    g = torch.Generator().manual_seed(5)
    y, a, z, lt = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                   for shape in ((9, paths), (9, heads * hidden), (4, _MORE_ROWS_DIMS[3]), (_MORE_ROWS_DIMS[4],)))
    q = z.new_zeros(4, heads, hidden, paths)
    for poff, k, dim_l, width, loff, zoff in _MORE_ROWS.tolist():
        zb = z[:, zoff : zoff + heads * width * dim_l].reshape(-1, heads, width, dim_l)
        lb = lt[loff : loff + heads * width * hidden * k].reshape(heads, width, hidden, k)
        q[..., poff : poff + k * dim_l] = torch.einsum("nawm,awhk->nahmk", zb, lb).reshape(-1, heads, hidden, k * dim_l)
    return (y, a, z, lt), rowptr, dst, q.reshape(4, heads * hidden, paths)


def test_node_operators_with_more_rows_than_paths(backend):
    """With more rows ``heads * hidden`` (16) than paths (10), the numba kernel contracts the edges along the rows
    (on Q_i^T): every output equals its definition, and gradcheck and gradgradcheck pass."""
    (y, a, z, lt), rowptr, dst, q = _more_rows_case()
    heads, hidden, paths = _MORE_ROWS_DIMS[:3]
    blocks, dims = _MORE_ROWS, _MORE_ROWS_DIMS
    t, r = segment_ops.node_expand(y, a, z, lt, blocks, rowptr, dims)
    torch.testing.assert_close(t, (y[:, None, :] * q[dst]).sum(-1), atol=1e-13, rtol=0)
    torch.testing.assert_close(r, (a[:, :, None] * q[dst]).sum(1), atol=1e-13, rtol=0)
    u = torch.zeros(4, heads * hidden, paths, dtype=torch.float64).index_add(0, dst, a[:, :, None] * y[:, None])
    o, glt = segment_ops.node_outer(a, y, lt, z, blocks, rowptr, dims)
    ref_o, ref_glt = torch.autograd.grad((q * u.detach()).sum(), [z, lt])  # R: adjoint of E; X: gradient in L
    torch.testing.assert_close(o, ref_o, atol=1e-13, rtol=0)
    torch.testing.assert_close(glt, ref_glt, atol=1e-13, rtol=0)
    fast = backend == "triton"
    for fn, args in ((lambda *x: segment_ops.node_expand(*x, blocks, rowptr, dims), (y, a, z, lt)),
                     (lambda *x: segment_ops.node_outer(*x, blocks, rowptr, dims), (a, y, lt, z))):
        assert torch.autograd.gradcheck(fn, args, fast_mode=fast)
        assert torch.autograd.gradgradcheck(fn, args, fast_mode=fast)


def test_one_node_pass_on_the_transpose_gives_every_output_at_once():
    """As ``test_one_node_pass_gives_every_output_at_once``, with more rows than paths (``Q_i^T`` and ``U_i^T`` in
    one buffer, node after node): the expansions read zero in the paths that no block covers after a node's sum."""
    operands, rowptr, _, _ = _more_rows_case()
    y, a, z, lt = (t.detach() for t in operands)
    _one_pass_gives_every_output(y, a, z, lt, _MORE_ROWS, rowptr, _MORE_ROWS_DIMS)
    assert (y[:, 8:] != 0).all()


@pytest.mark.parametrize("route", ["dispatcher", "eager"])
def test_node_operators_gradcheck_and_gradgradcheck(route, backend):
    rowptr, _ = _graph(torch.tensor([2, 0, 3]))
    y, a, z, lt = _operands(2, torch.tensor([2, 0, 3]))

    def expand(y, a, z, lt):
        return _through(route, segment_ops.node_expand)(y, a, z, lt, BLOCKS, rowptr, DIMS)

    def outer(a, y, lt, z):
        return _through(route, segment_ops.node_outer)(a, y, lt, z, BLOCKS, rowptr, DIMS)

    fast = backend == "triton"  # the interpreter runs each program in Python: random projections, not every row
    for fn, args in ((expand, (y, a, z, lt)), (outer, (a, y, lt, z[:3].detach().clone().requires_grad_()))):
        assert torch.autograd.gradcheck(fn, args, fast_mode=fast)
        assert torch.autograd.gradgradcheck(fn, args, fast_mode=fast)


@pytest.mark.parametrize("route", ["dispatcher", "eager"])
def test_first_order_gradients_in_one_pass(route, backend):
    """The layer's keys (``node_expand`` without ``a``) and values (``node_outer`` without ``z``): in eager mode their
    first-order gradients come from one node pass (``_node_pass``), which gradcheck compares with finite
    differences, and equal the separate operators' (through a differentiable backward)."""
    rowptr, _ = _graph(torch.tensor([2, 0, 3]))
    y, a, z, lt = _operands(2, torch.tensor([2, 0, 3]))

    def keys(y, z, lt):
        return _through(route, segment_ops.node_expand)(y, None, z, lt, BLOCKS, rowptr, DIMS)[0]

    def values(a, y, lt):
        return _through(route, segment_ops.node_outer)(a, y, lt, None, BLOCKS, rowptr, DIMS)[0]

    for fn, args in ((keys, (y, z, lt)), (values, (a, y, lt))):
        assert torch.autograd.gradcheck(fn, args, fast_mode=backend == "triton")
        out = fn(*args)
        cot = torch.randn_like(out)
        single = torch.autograd.grad(out, args, cot)
        separate = torch.autograd.grad(fn(*args), args, cot, create_graph=True)  # the separate operators
        for got, want in zip(single, separate):
            torch.testing.assert_close(got, want, atol=1e-13, rtol=0)


def test_node_operators_pass_opcheck(backend):
    rowptr, _ = _graph()
    y, a, z, lt = _operands(3)
    for args in ((y, a, z, lt), (y, None, z, lt), (None, a, z, lt)):
        torch.library.opcheck(segment_ops.node_expand, (*args, BLOCKS, rowptr, DIMS))
    for lt_, z_ in ((lt, z), (lt, None), (None, z)):
        torch.library.opcheck(segment_ops.node_outer, (a, y, lt_, z_, BLOCKS, rowptr, DIMS))
    tp = SphericalTensorProduct("3x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["2x0e + 1x1o", "1x1o + 1x2e"])
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    sh = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 4, 1, 1, 2, 3, 0])
    torch.library.opcheck(segment_ops.path_features, (tp._spec, x, index, sh))


@pytest.mark.parametrize("route", ["dispatcher", "eager"])
def test_path_features_equal_the_products_steps(route, float64_default, backend):
    """In the order (degree group, component, path) of the node kernels, with their first and second derivatives."""
    tp = SphericalTensorProduct("3x0e + 2x1o + 1x2e", o3.Irreps.spherical_harmonics(2), ["2x0e + 1x1o", "1x2e"])
    x, sh = torch.randn(5, tp.irreps_in.dim, requires_grad=True), torch.randn(7, 9, requires_grad=True)
    index = torch.tensor([0, 4, 1, 1, 2, 3, 0])
    ys = tp._products(x[index].T, sh.T, tp.constant("cg", torch.float64))
    order, columns = segment_ops.component_major_paths(tp._spec)
    reference = torch.cat([y.reshape(-1, 7) for y in ys if y is not None]).T  # (group, path, component)
    got = _through(route, segment_ops.path_features)(tp._spec, x, index, sh)
    assert got.shape == (7, columns) and columns % 8 == 0 and len(order) <= columns < len(order) + 8
    torch.testing.assert_close(got[:, torch.as_tensor(order)], reference, atol=1e-14, rtol=0)
    assert sorted(order.tolist()) == list(range(len(order)))
    assert (got[:, len(order):] == 0).all()  # the padding
    paths = _through(route, segment_ops.path_features)
    fast = backend == "triton"
    assert torch.autograd.gradcheck(lambda x, sh: paths(tp._spec, x, index, sh), (x, sh), fast_mode=fast)
    assert torch.autograd.gradgradcheck(lambda x, sh: paths(tp._spec, x, index, sh), (x, sh), fast_mode=fast)


def test_node_operators_refuse_what_would_read_out_of_range(backend):
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands())
    with pytest.raises(ValueError, match="rowptr must rise from 0"):
        segment_ops.node_expand(y, None, z, lt, BLOCKS, rowptr.flip(0), DIMS)
    with pytest.raises(ValueError, match="rowptr must be a 1-d int64"):
        segment_ops.node_expand(y, None, z, lt, BLOCKS, rowptr.int(), DIMS)
    with pytest.raises(ValueError, match=r"z must have shape \[6, 10\]"):  # one node fewer in rowptr than in z
        segment_ops.node_expand(y, None, z, lt, BLOCKS, rowptr[:-1], DIMS)
    with pytest.raises(ValueError, match="z must have shape"):
        segment_ops.node_expand(y, None, z[:, :4], lt, BLOCKS, rowptr, DIMS)
    with pytest.raises(ValueError, match="blocks does not fit"):
        segment_ops.node_outer(a, y, lt, None, BLOCKS + 40, rowptr, DIMS)
    with pytest.raises(IndexError, match="index must be in"):
        tp = SphericalTensorProduct("2x0e", o3.Irreps.spherical_harmonics(1), ["1x0e"])
        segment_ops.path_features(tp._spec, torch.randn(2, 2), torch.tensor([0, 2]), torch.randn(2, 4))


def test_node_operators_check_again_what_changed_in_place(backend):
    """The checks of ``rowptr``, ``blocks`` and ``index`` run once per tensor, and again after an in-place change."""
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands())
    rowptr, blocks = rowptr.clone(), BLOCKS.clone()
    segment_ops.node_expand(y, None, z, lt, blocks, rowptr, DIMS)  # checked and remembered
    rowptr[1:3] = rowptr[1:3].flip(0).clone()  # no longer rising
    with pytest.raises(ValueError, match="rowptr must rise from 0"):
        segment_ops.node_expand(y, None, z, lt, blocks, rowptr, DIMS)
    rowptr, _ = _graph()
    segment_ops.node_outer(a, y, lt, None, blocks, rowptr, DIMS)
    blocks += 40
    with pytest.raises(ValueError, match="blocks does not fit"):
        segment_ops.node_outer(a, y, lt, None, blocks, rowptr, DIMS)
    tp = SphericalTensorProduct("2x0e", o3.Irreps.spherical_harmonics(1), ["1x0e"])
    index = torch.tensor([0, 1])
    segment_ops.path_features(tp._spec, torch.randn(2, 2), index, torch.randn(2, 4))
    index[1] = 2
    with pytest.raises(IndexError, match="index must be in"):
        segment_ops.path_features(tp._spec, torch.randn(2, 2), index, torch.randn(2, 4))
    index[1] = 1
    segment_ops.path_features(tp._spec, torch.randn(2, 2), index, torch.randn(2, 4))  # checked again, remembered
    with pytest.raises(IndexError, match="index must be in"):  # the same tensor, unchanged, with fewer rows of x
        segment_ops.path_features(tp._spec, torch.randn(1, 2), index, torch.randn(2, 4))


def test_node_operators_check_their_arguments_in_the_forward_only(monkeypatch, float64_default):
    """The backward formulas call the operators on the forward's checked inputs and on gradients of its outputs:
    no check runs again in them, to the second derivative, and checking is on again afterwards."""
    calls = {"node": 0, "paths": 0}

    def counted(name, check):
        def run(*args):
            calls[name] += 1
            return check(*args)
        return run

    monkeypatch.setattr(segment_ops, "node_arguments", counted("node", segment_ops.node_arguments))
    monkeypatch.setattr(segment_ops, "check_shape", counted("paths", segment_ops.check_shape))  # path features
    layer = EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", 1.3, num_heads=2)
    pos = torch.randn(9, 3, requires_grad=True)
    f = layer.irreps_input.randn(9, -1)
    out = layer(f, pos)
    forward = dict(calls)
    assert forward["node"] > 0 and forward["paths"] > 0
    (forces,) = torch.autograd.grad(out.pow(2).sum(), pos, create_graph=True)
    forces.pow(2).sum().backward()  # the second derivatives: the backward formulas' own backward formulas
    assert calls == forward
    assert pos.grad.abs().max() > 0 and not segment_ops._TRUSTED.get()
    y, _, z, lt = (t.detach() for t in _operands())
    segment_ops.node_expand(y, None, z, lt, BLOCKS, _graph()[0], DIMS)  # a call of its own: checked
    assert calls["node"] == forward["node"] + 1


def test_remembered_notes_go_with_their_tensor():
    import gc
    import weakref

    from e3attn import _remembered

    t = torch.arange(4)
    _remembered.remember(t, "rising", True)
    assert _remembered.checked(t, "rising") is True
    identity = id(t)
    del t
    gc.collect()
    assert identity not in _remembered._NOTES  # no note outlives its tensor
    u, other = torch.arange(4), torch.arange(4)
    _remembered._NOTES[id(u)] = (weakref.ref(other), u._version, "rising", True)  # another tensor's note at u's id
    assert _remembered.checked(u, "rising") is None


LAYERS = [
    (("10x0e + 5x1o", "11x0e + 4x1o", "12x0e + 3x1o", "14x0e + 6x1o"), 1, 3, "sqrt_alpha"),
    (("4x0e + 2x1o + 2x2e", "4x0e + 2x1o", "2x0e + 4x1o + 2x2e", "6x0e + 2x1o + 4x2e + 2x1e"), 2, 2, "alpha"),
    (("3x0e + 2x1o", "2x1o", "2x1o", "2x0e + 2x2e"), 2, 2, "sqrt_alpha"),  # keys use only some of the paths
]


def _layer(case, seed=0):
    irreps, heads, lmax, aggregation = case
    torch.manual_seed(seed)
    return EquivariantAttention(*irreps, max_radius=1.3, num_heads=heads, lmax=lmax, aggregation=aggregation)


@pytest.mark.parametrize("case", LAYERS)
def test_layer_at_the_nodes_equals_the_plain_formulation(case, float64_default, backend):
    """Output, attention and the force-training gradients (second derivatives in the positions)."""
    layer = _layer(case)
    pos, f = torch.randn(24, 3), layer.irreps_input.randn(24, -1)
    assert kernels.segments_enabled(pos.device, pos.dtype)

    def step():
        p, x = pos.clone().requires_grad_(), f.clone().requires_grad_()
        out, alpha = layer(x, p, return_attention=True)
        energy = out.pow(2).sum()
        forces = torch.autograd.grad(energy, p, create_graph=True)[0]
        grads = torch.autograd.grad(energy.pow(2) + forces.pow(2).sum() + alpha.sum(), [x, p, *layer.parameters()])
        return (out, alpha, *grads)

    for got, ref in zip(step(), plain(step)):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_layer_at_the_nodes_with_unsorted_edges_isolated_nodes_and_duplicates(float64_default, backend):
    layer = _layer(LAYERS[1])
    pos = torch.cat([torch.randn(9, 3), torch.full((1, 3), 50.0)])  # node 9 is isolated
    pos[8] = pos[7]  # two coincident points
    f = layer.irreps_input.randn(10, -1)
    edge_index = radius_graph(pos, 1.3)
    perm = torch.randperm(edge_index.shape[1], generator=torch.Generator().manual_seed(0))
    out, alpha = layer(f, pos, edge_index[:, perm], return_attention=True)
    ref, ref_alpha = plain(lambda: layer(f, pos, edge_index, return_attention=True))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha, ref_alpha[perm], atol=1e-12, rtol=0)  # in the order the edges were given
    assert torch.equal(out[9], torch.zeros_like(out[9]))


@pytest.mark.parametrize("nodes", [0, 1])
def test_layer_at_the_nodes_without_edges(nodes, float64_default, backend):
    layer = _layer(LAYERS[0])
    pos = torch.randn(nodes, 3, requires_grad=True)
    f = layer.irreps_input.randn(nodes, -1, requires_grad=True)
    out, alpha = layer(f, pos, return_attention=True)
    assert out.shape == (nodes, layer.irreps_output.dim) and alpha.shape == (0, 1)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), [f, pos, *layer.parameters()], allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)


def _across_threads(fn, counts=(1, 2, 2)):
    before, results = torch.get_num_threads(), []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(fn())
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_node_operators_are_bitwise_repeatable_for_any_number_of_threads():
    """The sum of the weight gradient runs per fixed group of nodes; everything else is written once per node."""
    rowptr, _ = _graph(torch.randint(0, 6, (50,), generator=torch.Generator().manual_seed(0)))
    y, a, z, lt = (t.detach().float() for t in _operands(0, rowptr.diff()))
    _across_threads(lambda: [*segment_ops.node_expand(y, a, z, lt, BLOCKS, rowptr, DIMS),
                             *segment_ops.node_outer(a, y, lt, z, BLOCKS, rowptr, DIMS)])


def test_layer_at_the_nodes_is_bitwise_repeatable_run_to_run():
    # (across numbers of threads, PyTorch's own matrix products may round differently)
    layer = _layer(LAYERS[1])
    pos, f = torch.randn(40, 3), layer.irreps_input.randn(40, -1)

    def run():
        p = pos.clone().requires_grad_()
        out = layer(f, p)
        return [out, *torch.autograd.grad(out.pow(2).sum(), [p, *layer.parameters()])]

    for threads in (1, 2):
        _across_threads(run, (threads, threads))


def test_where_the_layer_contracts_at_the_nodes():
    cpu = torch.device("cpu")
    assert kernels.segments_enabled(cpu, torch.float32) and kernels.segments_enabled(cpu, torch.float64)
    assert not kernels.segments_enabled(cpu, torch.bfloat16)
    previous = kernels.set_cuda_kernels(None)  # the default
    try:
        assert not kernels.segments_enabled(torch.device("cuda"), torch.float32)  # eager on CUDA: the plain formulation
    finally:
        kernels.set_cuda_kernels(previous)
    assert kernels.backend(cpu) == "numba" and kernels.backend(torch.device("cuda")) == "triton"
    with pytest.raises(NotImplementedError, match="no e3attn kernel for device 'meta'"):
        kernels.backend(torch.device("meta"))
    with pytest.raises(ValueError, match="name must be one of numba, triton"):
        kernels.set_cpu_backend("cuda")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels.segments_enabled(cpu, torch.float32)
    assert plain(lambda: kernels.segments_enabled(cpu, torch.float32)) is False


def test_block_tables_stay_on_the_cpu_when_the_layer_moves():
    """The kernels read the block tables as Python integers (no copy from a GPU per call): moving the layer to
    another device (here ``meta``, as ``.to("cuda")`` would) moves its index buffers, not the tables."""
    layer = _layer(LAYERS[1]).to("meta")
    assert layer.nodes._key_columns.device.type == "meta"
    assert layer.nodes._key_blocks.device.type == "cpu" and layer.nodes._value_blocks.device.type == "cpu"


def test_outputs_of_unreachable_blocks_and_of_no_nodes_are_zero(float64_default, backend):
    """Blocks without paths (K = 0) and graphs without nodes still write every output (no uninitialised memory)."""
    layer = EquivariantAttention("2x0e", "2x0e", "2x0e", "2x1e", max_radius=1.3, lmax=1)  # values unreachable
    pos, f = torch.randn(6, 3), layer.irreps_input.randn(6, -1)
    out = layer(f, pos)
    assert torch.equal(out, torch.zeros_like(out))
    y, a, z = torch.randn(0, PATHS), torch.randn(0, HEADS * HIDDEN), torch.randn(0, DIMS[3])
    rowptr = torch.zeros(1, dtype=torch.long)
    _, glt = segment_ops.node_outer(a, y, None, z, BLOCKS, rowptr, DIMS)
    assert torch.equal(glt, torch.zeros(DIMS[4]))


@pytest.mark.parametrize("row, match", [
    ([0, 4, 1, 2, 0, -10**12], "blocks does not fit"),  # a negative offset
    ([0, 2**62, 4, 1, 0, 0], "blocks does not fit"),  # a product that overflows int64
    ([-3, 4, 1, 2, 0, 0], "blocks does not fit"),
])
def test_node_operators_refuse_bad_block_tables(row, match):
    rowptr, _ = _graph()
    y, a, z, lt = (t.detach() for t in _operands())
    with pytest.raises(ValueError, match=match):
        segment_ops.node_expand(y, None, z, lt, torch.tensor([row]), rowptr, DIMS)
    with pytest.raises(ValueError, match="int64"):
        segment_ops.node_expand(y, None, z, lt, BLOCKS.int(), rowptr, DIMS)
    with pytest.raises(ValueError, match="heads >= 1"):
        segment_ops.node_expand(y, None, z, lt, BLOCKS, rowptr, [0, *DIMS[1:]])
    with pytest.raises(ValueError, match="float32 or float64"):
        segment_ops.node_expand(y.float(), None, z, lt, BLOCKS, rowptr, DIMS)


def test_path_features_of_a_transposed_input_compile(float64_default, backend):
    """The gradient of ``x`` is contiguous whatever the strides of ``x`` (as the fake implementation says)."""
    tp = SphericalTensorProduct("3x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["2x0e + 1x1o"])
    x = torch.randn(9, 5, requires_grad=True)
    sh, index = torch.randn(7, 9), torch.tensor([0, 4, 1, 1, 2, 3, 0])
    paths = segment_ops.component_major_paths(tp._spec)[1]
    torch.library.opcheck(segment_ops.path_features_backward, (tp._spec, x.T, index, sh, torch.randn(7, paths), [True, True]))
    with pytest.raises(ValueError, match="float32 or float64"):
        segment_ops.path_features(tp._spec, x.T.float(), index, sh)


def test_force_training_does_no_work_for_gradients_outside_the_loss(float64_default, backend):
    """The loss of force training does not depend on the features' gradient: its double backward must not run the
    path features on a zero-filled stand-in for it (the operators' gradients are not materialised)."""
    from torch.profiler import profile

    layer = _layer(LAYERS[0])
    pos = torch.randn(12, 3, requires_grad=True)
    f = layer.irreps_input.randn(12, -1, requires_grad=True)  # its gradient is computed, but not in the loss
    with profile() as prof:
        energy = layer(f, pos).pow(2).sum()
        forces = torch.autograd.grad(energy, pos, create_graph=True)[0]
        forces.pow(2).sum().backward()
    calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("e3attn::path_features")}
    # products: the forward, and the double backward's for the incoming gradient (one more if it ran on the zeros);
    # their backward: first order, the double backward's for the features, and the loss's way back through the
    # path features (one more if it ran on the zeros)
    assert calls == {"e3attn::path_features": 2, "e3attn::path_features_backward": 3}
