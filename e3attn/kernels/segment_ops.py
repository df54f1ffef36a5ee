r"""The kernels of :mod:`e3attn.kernels.segments` as PyTorch custom operators, differentiable to any order.

With the edges grouped by destination (``rowptr [N + 1]``), :math:`Q_i = E(z_i, L)` the per-node expansion of
:class:`~e3attn.node_contraction.NodeContraction` and :math:`U_i = O(a, y)_i = \sum_{e \to i} a_e^T y_e`:

* ``e3attn::node_expand(y, a, z, L)``: :math:`D(y, Q)_e = y_e Q_i^T` and :math:`C(a, Q)_e = a_e Q_i`;
* ``e3attn::node_outer(a, y, L, z)``: :math:`R(U_i, L)` and :math:`\sum_i X(U_i, z_i)`;
* ``e3attn::path_features(spec, x, index, sh)``: :math:`y_e = P(x_{\mathrm{index}(e)}, Y_e)`, and
  ``e3attn::path_features_backward`` its gradients.

Each output is multilinear, with :math:`\langle g, D(y, Q) \rangle = \langle Q, O(g, y) \rangle`,
:math:`\langle g, C(a, Q) \rangle = \langle Q, O(a, g) \rangle` and
:math:`\langle g, R(U, L) \rangle = \langle E(g, L), U \rangle = \langle g', X(U, z) \rangle`-type
identities, so the gradients of one operator are the other's outputs:

.. math::

    \partial_y \langle g_t, D \rangle = C(g_t, Q),\quad \partial_a \langle g_r, C \rangle = D(g_r, Q),\quad
    \partial_{z, L} = R, X \text{ of } O(g_t, y) + O(a, g_r),

    \partial_{a, y} \big(\langle g_o, R \rangle + \langle g_X, X \rangle\big) = D, C \text{ of }
    W = E(g_o, L) + E(z, g_X),\quad \partial_L = X(U, g_o),\quad \partial_z = R(U, g_X),

and every derivative, forces and their training included, runs on the same two operators; each call computes
the outputs that share its per-node matrix at once. An input given as None leaves its output empty. CPU
tensors (float32 and float64) only: :func:`e3attn.kernels.segments_enabled` says where the layer uses them.

The layer calls them through :func:`call`: in plain eager mode that runs each operator's implementation and
autograd directly, as a ``torch.autograd.Function``, without the dispatcher's cost per call (a fraction of a
millisecond); under ``torch.compile`` (and dispatch modes, tensor subclasses, batched gradients) through the
registered operators.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

from . import _plain_eager, cpu, segments
from .backends import backend
from .cpu import _array, _forward_groups
from .layout import component_major_paths, layout_for, padded_paths
from .._remembered import checked, remember
from .segment_checks import (_TRUSTED, arguments_checked_by_caller, check_blocks, check_shape, common_dtype,
                             node_arguments)
from .threads import groups_for, parallel, reduction_groups

__all__ = ["call", "node_expand", "node_outer", "path_features", "path_features_backward"]

_TILE = 64  # edges per tile of the path features (longer tiles measured slower: the tile leaves the cache)


def _node_groups(rowptr: torch.Tensor, work: int) -> int:
    """Groups of nodes for the threads: a few per thread (no reduction: any split gives the same result)."""
    return groups_for(work, max(1, min(rowptr.shape[0] - 1, 4 * torch.get_num_threads())))


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def _node_pass(y, a, z, lt, blocks, rowptr, dims, needs) -> Tuple[torch.Tensor, ...]:
    r"""The outputs of :func:`~e3attn.kernels.segments.node_pass` flagged in ``needs`` (the others empty), in one
    pass over the nodes: with :math:`Q_i = E(z_i, L)`, :math:`t_e = y_e Q_i^T` ``[E, heads * hidden]`` and
    :math:`r_e = a_e Q_i` ``[E, paths]``; with :math:`U_i = \sum_{e \to i} a_e^T y_e`, :math:`R(U_i, L)`
    ``[N, z width]`` and :math:`\sum_i X(U_i, z_i)` ``[L size]`` (the gradient in :math:`L` of
    :math:`\sum_i \langle E(z_i, L), U_i \rangle`; summed per group of nodes, in order, the groups set by
    the work alone: :func:`~e3attn.kernels.threads.reduction_groups`). On the backend
    of the tensors' device (:func:`e3attn.kernels.backend`)."""
    ref = next(t for t in (y, a, z) if t is not None)
    on_triton = backend(ref.device) == "triton"
    table = (check_blocks(blocks, dims) if on_triton else None) if _TRUSTED.get() else node_arguments(
        a, y, z, lt, blocks, rowptr, dims)
    if on_triton:
        from . import segments_triton  # imports triton: only where it runs

        return segments_triton.node_pass(y, a, z, lt, table, rowptr, dims, needs)
    a_, y_, z_, lt_ = (_array(t) if t is not None else np.empty((0,) + shape, _NUMPY[ref.dtype])
                       for t, shape in ((a, ()), (y, (dims[2],)), (z, (dims[3],)), (lt, ())))
    a_ = a_.reshape(-1)
    need_t, need_r, need_o, need_g = needs
    num = max(y_.shape[0], a_.shape[0] // max(1, dims[0] * dims[1]))
    work = sum(needs) * num * dims[0] * dims[1] * dims[2]
    groups = reduction_groups(work, cpu.GROUPS) if need_g else _node_groups(rowptr, work)
    outs = (ref.new_empty(num if need_t else 0, dims[0] * dims[1]), ref.new_empty(num if need_r else 0, dims[2]),
            ref.new_zeros(rowptr.shape[0] - 1 if need_o else 0, dims[3]), ref.new_empty(groups if need_g else 0, dims[4]))
    arrays = (outs[0].view(-1).numpy(), outs[1].numpy(), outs[2].numpy(), outs[3].numpy())
    ptr, table_ = _array(rowptr), _array(blocks)
    parallel(lambda g: segments.node_pass(y_, a_, z_, lt_, table_, dims[0], dims[1], ptr, g, groups, *arrays), groups,
             work)
    return outs[0], outs[1], outs[2], outs[3].sum(0) if need_g else outs[3].new_empty(0)


def _node_expand(y: Optional[torch.Tensor], a: Optional[torch.Tensor], z: torch.Tensor, lt: torch.Tensor,
                blocks: torch.Tensor, rowptr: torch.Tensor, dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """:math:`t = D(y, Q)` and :math:`r = C(a, Q)` of :func:`_node_pass` (each empty when its input is None)."""
    return _node_pass(y, a, z, lt, blocks, rowptr, dims, (y is not None, a is not None, False, False))[:2]


node_expand = torch.library.custom_op("e3attn::node_expand", _node_expand, mutates_args=())


def _node_outer(a: torch.Tensor, y: torch.Tensor, lt: Optional[torch.Tensor], z: Optional[torch.Tensor],
               blocks: torch.Tensor, rowptr: torch.Tensor, dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    r""":math:`R(U, L)` and :math:`\sum_i X(U_i, z_i)` of :func:`_node_pass` (each empty when its input is None)."""
    return _node_pass(y, a, z, lt, blocks, rowptr, dims, (False, False, lt is not None, z is not None))[2:]


node_outer = torch.library.custom_op("e3attn::node_outer", _node_outer, mutates_args=())


@node_expand.register_fake
def _(y, a, z, lt, blocks, rowptr, dims):
    num = y.shape[0] if y is not None else (a.shape[0] if a is not None else 0)
    return z.new_empty(num if y is not None else 0, dims[0] * dims[1]), z.new_empty(num if a is not None else 0, dims[2])


@node_outer.register_fake
def _(a, y, lt, z, blocks, rowptr, dims):
    return y.new_empty(rowptr.shape[0] - 1 if lt is not None else 0, dims[3]), y.new_empty(dims[4] if z is not None else 0)


def _path_arguments(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor) -> bool:
    """Check what the kernels rely on (on a GPU, ``index``'s values are not read: the layer builds it; nothing in a
    backward formula of this module, ``_TRUSTED``); whether the Triton backend runs them
    (:func:`e3attn.kernels.backend`)."""
    if _TRUSTED.get():
        return backend(sh.device) == "triton"
    layout = layout_for(spec)
    if x.dim() != 2 or x.shape[1] <= int(layout.path_x.max(initial=-1)):
        raise ValueError(f"x has the wrong shape for this product: {list(x.shape)}")
    if sh.dim() != 2 or sh.shape[1] <= int(layout.path_y.max(initial=-1)):
        raise ValueError(f"sh has the wrong shape for this product: {list(sh.shape)}")
    check_shape("index", index, (sh.shape[0],), sh.device)
    check_shape("x", x, tuple(x.shape), sh.device)
    if sh.device.type == "cpu" and index.shape[0] and checked(index, x.shape[0]) is None:
        if int(index.min()) < 0 or int(index.max()) >= x.shape[0]:
            raise IndexError(f"index must be in [0, {x.shape[0]}) (the rows of x)")
        remember(index, x.shape[0], True)
    common_dtype(x=x, sh=sh)
    return backend(sh.device) == "triton"


def _path_structure(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor):
    """The data as arrays and the path structure (component-major) for the numba kernels."""
    layout = layout_for(spec)
    data = (_array(x), _array(index), _array(sh))
    order, paths = component_major_paths(spec)
    structure = (layout.path_x, layout.path_y, order[layout.path_p], layout.path_c.astype(data[0].dtype))
    return data, structure, paths


def _path_work(x: torch.Tensor, sh: torch.Tensor, structure: tuple, paths: int) -> int:
    """The path features' work for :func:`~e3attn.kernels.threads.parallel`: a multiply-add per coefficient and
    edge, and about eight per number gathered, transposed or stored (what most of their time goes to)."""
    return sh.shape[0] * (structure[3].shape[0] + 8 * (x.shape[1] + sh.shape[1] + paths))


def _path_features(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """:math:`P(x_{\\mathrm{index}}, Y)` ``[E, paths]`` of the product named by ``spec``."""
    if _path_arguments(spec, x, index, sh):
        from . import paths_triton  # imports triton: only where it runs

        return paths_triton.path_features(spec, x, index, sh, padded_paths(layout_for(spec).num_paths))
    data, structure, paths = _path_structure(spec, x, index, sh)
    out, work = sh.new_empty(sh.shape[0], paths), _path_work(x, sh, structure, paths)
    groups = groups_for(work, _forward_groups(sh.shape[0], _TILE))
    empty = np.empty((0, paths), data[0].dtype)
    arrays = (out.numpy(), np.empty((0, x.shape[1]), data[0].dtype), np.empty((0, sh.shape[1]), data[0].dtype))
    parallel(lambda group: segments.path_features(*data, empty, structure, _TILE, group, groups, *arrays), groups,
             work)
    return out


path_features = torch.library.custom_op("e3attn::path_features", _path_features, mutates_args=())


def _path_features_backward(spec: str, x: torch.Tensor, index: torch.Tensor, sh: torch.Tensor, grad: torch.Tensor,
                           needs: List[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``x`` ``[N, in]`` and ``sh`` ``[E, sh]`` flagged in ``needs`` (others empty)."""
    on_triton = _path_arguments(spec, x, index, sh)
    if not _TRUSTED.get():
        check_shape("grad", grad, (sh.shape[0], padded_paths(layout_for(spec).num_paths)), sh.device)
        common_dtype(x=x, grad=grad)
    if on_triton:
        from . import paths_triton  # imports triton: only where it runs

        return paths_triton.path_features_backward(spec, x, index, sh, grad, needs)
    data, structure, paths = _path_structure(spec, x, index, sh)
    gx_edges, gsh = x.new_empty(sh.shape[0], x.shape[1]), sh.new_empty(sh.shape)
    work = 2 * _path_work(x, sh, structure, paths)
    groups, g = groups_for(work, _forward_groups(sh.shape[0], _TILE)), _array(grad)
    arrays = (np.empty((0, paths), data[0].dtype), gx_edges.numpy(), gsh.numpy())
    parallel(lambda group: segments.path_features(*data, g, structure, _TILE, group, groups, *arrays), groups, work)
    gx = x.new_zeros(x.shape) if needs[0] else x.new_empty(0)
    if needs[0]:  # the gradient of the gather x[index]: rows summed in edge order (bitwise repeatable)
        segments.add_rows(gx.numpy(), data[1], gx_edges.numpy())
    return gx, gsh if needs[1] else sh.new_empty(0)


path_features_backward = torch.library.custom_op("e3attn::path_features_backward", _path_features_backward,
                                                mutates_args=())


@path_features.register_fake
def _(spec, x, index, sh):
    return sh.new_empty(sh.shape[0], padded_paths(layout_for(spec).num_paths))


@path_features_backward.register_fake
def _(spec, x, index, sh, grad, needs):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip((x, sh), needs))


# ---------------------------------------------------------------------- autograd: the gradients of each are the others


def _trusting(backward: Callable) -> Callable:
    """``backward`` with the argument checks of this module's operators skipped while it runs (``_TRUSTED``). The
    operators that it records for a higher derivative are differentiated by these formulas too, on what they were
    given: nothing is checked after the forward."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        with arguments_checked_by_caller():
            return backward(ctx, *grads)

    return run


def _save_node(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:6])
    ctx.dims = inputs[6]
    ctx.set_materialize_grads(False)  # an output without a gradient costs nothing (not a zero-filled tensor)


def _used(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return g.contiguous() if g is not None and guard_or_true(g.numel() != 0) else None  # sizes may be symbolic


def _add(total: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


def _first_order(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a backward formula may compute all its gradients in one :func:`_node_pass`: they need not be
    differentiable (the separate operators are), in plain eager mode."""
    return not torch.is_grad_enabled() and _eager_mode(tensors)


@_trusting
def _expand_backward(ctx, gt, gr):
    r"""For :math:`t = D(y, Q)`, :math:`r = C(a, Q)`, :math:`Q = E(z, L)`: :math:`\partial_y = C(g_t, Q)`,
    :math:`\partial_a = D(g_r, Q)` (one call), and :math:`\partial_{z, L}` from :math:`U = O(g_t, y) + O(a, g_r)`."""
    y, a, z, lt, blocks, rowptr = ctx.saved_tensors
    gt, gr, d = _used(gt) if y is not None else None, _used(gr) if a is not None else None, ctx.dims
    need_y, need_a, need_z, need_lt = ctx.needs_input_grad[:4]
    if a is None and gt is not None and _first_order(gt, y, z, lt):  # the layer's keys: one pass
        _, gy, gz, glt = _node_pass(y, gt, z, lt, blocks, rowptr, d, (False, need_y, need_z, need_lt))
        return gy if need_y else None, None, gz if need_z else None, glt if need_lt else None, None, None, None
    ga = gy = gz = glt = None
    use_gr, use_gt = need_a and gr is not None, need_y and gt is not None
    if use_gr or use_gt:
        ga, gy = call(node_expand, gr if use_gr else None, gt if use_gt else None, z, lt, blocks, rowptr, d)
        ga, gy = ga if use_gr else None, gy if use_gt else None
    if need_z or need_lt:
        for left, right in ((gt, y), (a, gr)):
            if left is not None and right is not None:
                o, g = call(node_outer, left, right, lt if need_z else None, z if need_lt else None, blocks, rowptr, d)
                gz, glt = _add(gz, o) if need_z else None, _add(glt, g) if need_lt else None
    return gy, ga, gz, glt, None, None, None


@_trusting
def _outer_backward(ctx, go, gg):
    r"""For :math:`o = R(U, L)`, :math:`g = X(U, z)`, :math:`U = O(a, y)`: with :math:`W = E(g_o, L) + E(z, g_g)`,
    :math:`\partial_a = D(y, W)`, :math:`\partial_y = C(a, W)`, and :math:`\partial_L = X(U, g_o)`,
    :math:`\partial_z = R(U, g_g)` (one call)."""
    a, y, lt, z, blocks, rowptr = ctx.saved_tensors
    go, gg, d = _used(go) if lt is not None else None, _used(gg) if z is not None else None, ctx.dims
    need_a, need_y, need_lt, need_z = ctx.needs_input_grad[:4]
    if z is None and go is not None and _first_order(go, a, y, lt):  # the layer's values: one pass
        ga, gy, _, glt = _node_pass(y, a, go, lt, blocks, rowptr, d, (need_a, need_y, False, need_lt))
        return ga if need_a else None, gy if need_y else None, glt if need_lt else None, None, None, None, None
    ga = gy = glt = gz = None
    if need_a or need_y:
        for zz, ll in ((go, lt), (z, gg)):
            if zz is not None and ll is not None:
                t, r = call(node_expand, y if need_a else None, a if need_y else None, zz, ll, blocks, rowptr, d)
                ga, gy = (_add(ga, t) if need_a else None), (_add(gy, r) if need_y else None)
    if (need_z and gg is not None) or (need_lt and go is not None):
        gz, glt = call(node_outer, a, y, gg if need_z else None, go if need_lt else None, blocks, rowptr, d)
    return (ga, gy, glt if need_lt and go is not None else None, gz if need_z and gg is not None else None,
            None, None, None)


node_expand.register_autograd(_expand_backward, setup_context=_save_node)
node_outer.register_autograd(_outer_backward, setup_context=_save_node)


def _save_paths(ctx, inputs, output) -> None:
    spec, x, index, sh = inputs[:4]
    ctx.spec = spec
    ctx.save_for_backward(x, index, sh, *inputs[4:5])
    ctx.set_materialize_grads(False)  # e.g. in force training, the features' gradient is not in the loss


@_trusting
def _paths_backward(ctx, grad):
    x, index, sh = ctx.saved_tensors
    needs = [ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
    if not any(needs) or grad is None:
        return None, None, None, None
    gx, gsh = call(path_features_backward, ctx.spec, x, index, sh, grad.contiguous(), needs)
    return None, gx if needs[0] else None, None, gsh if needs[1] else None


def _save_paths_backward(ctx, inputs, output) -> None:
    _save_paths(ctx, inputs, output)
    ctx.needs = inputs[5]


@_trusting
def _paths_backward_backward(ctx, vx, vsh):
    r"""For the gradients :math:`(v_x, v_Y)` arriving at :math:`(P_x^T(g; Y), P_Y^T(g; x))`:
    :math:`\partial_g = P(v_x, Y) + P(x, v_Y)`, :math:`\partial_x = P_x^T(g; v_Y)`,
    :math:`\partial_Y = P_Y^T(g; v_x)` (the product is bilinear)."""
    x, index, sh, grad = ctx.saved_tensors
    vx = vx if ctx.needs[0] and vx is not None and guard_or_true(vx.numel() != 0) else None
    vsh = vsh if ctx.needs[1] and vsh is not None and guard_or_true(vsh.numel() != 0) else None
    spec = ctx.spec
    g_grad = gx = gsh = None
    if ctx.needs_input_grad[4]:
        parts = ([call(path_features, spec, vx.contiguous(), index, sh)] if vx is not None else []) + (
            [call(path_features, spec, x, index, vsh.contiguous())] if vsh is not None else [])
        g_grad = sum(parts[1:], parts[0]) if parts else None
    if ctx.needs_input_grad[1] and vsh is not None:
        gx = call(path_features_backward, spec, x, index, vsh.contiguous(), grad, [True, False])[0]
    if ctx.needs_input_grad[3] and vx is not None:
        gsh = call(path_features_backward, spec, vx.contiguous(), index, sh, grad, [False, True])[1]
    return None, gx, None, gsh, g_grad, None


path_features.register_autograd(_paths_backward, setup_context=_save_paths)
path_features_backward.register_autograd(_paths_backward_backward, setup_context=_save_paths_backward)


# ---------------------------------------------------------------------- eager mode: the same, without the dispatcher


def _eager(name: str, impl: Callable, setup_context: Callable, backward: Callable) -> Callable:
    """``impl`` with the autograd of its operator as a ``torch.autograd.Function`` (the same ``setup_context`` and
    ``backward``, so the same inputs, saved tensors and gradients), named ``name`` in the profiler."""

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            if torch.autograd._profiler_enabled():
                with torch.profiler.record_function(name):
                    out = impl(*inputs)
            else:
                out = impl(*inputs)
            setup_context(ctx, inputs, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    return Eager.apply


_EAGER = {op: _eager(f"e3attn::{impl.__name__[1:]}", impl, setup, backward) for op, impl, setup, backward in (
    (node_expand, _node_expand, _save_node, _expand_backward),
    (node_outer, _node_outer, _save_node, _outer_backward),
    (path_features, _path_features, _save_paths, _paths_backward),
    (path_features_backward, _path_features_backward, _save_paths_backward, _paths_backward_backward))}


def call(op, *args):
    """``op(*args)`` for one of this module's operators. In plain eager mode (plain, unbatched tensors, no
    ``torch.compile`` tracing, no dispatch mode and no ``torch.func`` transform active), its implementation and
    autograd are called directly, without the dispatcher's cost per call (which small graphs feel); otherwise
    through the dispatcher."""
    return _EAGER[op](*args) if _eager_mode(args) else op(*args)


def _eager_mode(args) -> bool:
    """Plain eager mode (as :func:`~e3attn.kernels.eager_on_cpu` defines it) for the tensors among ``args``."""
    return _plain_eager([t for t in args if isinstance(t, torch.Tensor)])
