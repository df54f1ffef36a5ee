r"""The attention's node contraction on Triton: the backend of :mod:`e3attn.kernels.segment_ops` for CUDA tensors.

The same outputs as :func:`e3attn.kernels.segments.node_pass` (see
:class:`~e3attn.node_contraction.NodeContraction` for the math), computed in three kinds of steps:

* per node, the matrices :math:`Q_i = E(z_i, L)`, stored ``[N, paths, heads * hidden]``, and from :math:`U_i` (the
  same layout) the adjoints :math:`R(U_i, L)` and :math:`\sum_i X(U_i, z_i)`: per block of the product one batched
  matrix product on cuBLAS with the head-block-diagonal matrix of :math:`L` (``_plan``), reading and writing
  the block's rows of :math:`Q` or :math:`U` in place (views: no copy of them), never per edge;
* per node and its incoming edges ``rowptr[i]:rowptr[i + 1]`` (the CSR layout of the destination-sorted
  edges), ``_segment_rows_kernel``: :math:`t_e = y_e Q_i` or :math:`r_e = a_e Q_i^T`, one program per node and
  chunk of output columns streaming the node's edges through ``tl.dot``;
* ``_segment_outer_kernel``: :math:`U_i = \sum_{e \to i} y_e^T a_e`, one program per node and tile of
  :math:`U_i`;
* ``_node_sum_kernel``: :math:`\sum_i X(U_i, z_i)`, the gradient of the radial networks' last layer, a sum over
  all nodes split into shares (one program per share, head and tile), then the shares' sums added (bitwise
  repeatable).

On a GPU the segment kernels and the path features' kernel choose their tiles and warps by timing at their first
call per shape (:func:`~e3attn.kernels.segments_triton.tuned`; ``E3ATTN_TRITON_AUTOTUNE=0``: the first choice).

No per-edge weights, keys or values are formed: per edge only the path features :math:`y_e`
(:mod:`e3attn.kernels.paths_triton`). Every program writes only its own rows, so the node contraction has no
atomic additions.

Products run in IEEE float32 (or float64): TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` asks for
it, for these kernels as for cuBLAS. With ``TRITON_INTERPRET=1`` set before Triton is first imported, the same
kernels run on CPU tensors in Triton's interpreter (``E3ATTN_KERNEL_BACKEND=triton``): how the tests check them
without a GPU.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .._env import env_flag

__all__ = ["node_pass"]

BLOCK_E = 16  # edges per step of a node's segment (tl.dot's least size; most nodes have 10-40 edges)
#: whether the kernels' tiles and warps are chosen by timing on the GPU (``E3ATTN_TRITON_AUTOTUNE``, see :func:`tuned`)
AUTOTUNE = env_flag("E3ATTN_TRITON_AUTOTUNE", True)
_TUNE_IN_INTERPRETER = False  # the tests set it to run every choice in the interpreter


def _block(n: int, least: int, most: int) -> int:
    return max(least, min(most, triton.next_power_of_2(max(n, 1))))


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, which must be set before Triton's
    kernels are defined: before e3attn's kernels are imported)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs.runtime.interpret) if knobs is not None else env_flag("TRITON_INTERPRET", False)


def size_class(n: int) -> int:
    """The bit length of ``n`` (at least 1): sizes of one class share a choice of tiles (:func:`tuned`)."""
    return max(int(n), 1).bit_length()


def tuned(key: List[str], sizes: Dict[str, str], choices: Sequence[Tuple[int, ...]]):
    """Decorate a Triton kernel so that its tile sizes (the constexprs named in ``sizes``, each bounded by the size
    argument it names) and its number of warps are chosen among ``choices`` (tuples of the tile sizes in the order
    of ``sizes``, then the warps) by timing them on the GPU, once per value of the ``key`` arguments and dtypes
    (``triton.autotune``: the first call with a new key runs each choice a few times; the choice is kept on disk
    with Triton's compiled kernels, so later processes skip the timing: delete Triton's cache, ``TRITON_CACHE_DIR``
    or ``~/.triton/cache``, to time again). The kernels take an unused argument ``size_class``
    (:func:`size_class` of the number of nodes or edges) for their keys, so that a choice made on small graphs
    does not serve large ones. Tiles larger than their size are cut to it (at least 16). The choices tile the
    output only: with IEEE products each output's sum runs in the same order whichever is chosen. In Triton's
    interpreter, or with ``E3ATTN_TRITON_AUTOTUNE=0``, the first choice alone, untimed."""
    names = list(sizes)
    configs = [triton.Config(dict(zip(names, c[:-1])), num_warps=c[-1]) for c in choices]
    interpreted = _interpreting()  # as when the kernel is defined, which is what runs it

    def fitted(configs, named_args, **kwargs):
        seen, out = set(), []
        single = not AUTOTUNE or (interpreted and not _TUNE_IN_INTERPRETER)
        for config in configs[: 1 if single else None]:
            blocks = {n: min(config.kwargs[n], _block(named_args[sizes[n]], 16, 1 << 30)) for n in names}
            if (tuple(blocks.values()), config.num_warps) not in seen:
                seen.add((tuple(blocks.values()), config.num_warps))
                out.append(triton.Config(blocks, num_warps=config.num_warps))
        return out

    def bench(fn, quantiles):  # a short timing: these kernels take microseconds to milliseconds
        if interpreted or not AUTOTUNE:  # one choice, nothing to time (Triton before 3.9 times even one)
            return [0.0, 0.0, 0.0]
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    return triton.autotune(configs, key=key + ["size_class"], prune_configs_by={"early_config_prune": fitted},
                           do_bench=bench, cache_results=AUTOTUNE and not interpreted)


@tuned(["k_size", "c_size", "m_stride_c", "PRECISION"], {"BLOCK_C": "c_size"},
       [(64, 4), (32, 2), (32, 4), (64, 2), (128, 4), (128, 8)])
@triton.jit(do_not_specialize=["size_class"])
def _segment_rows_kernel(a_ptr, m_ptr, rowptr_ptr, out_ptr, k_size, c_size, m_node_stride, m_stride_k, m_stride_c,
                         size_class, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                         PRECISION: tl.constexpr):
    """``out[e, c] = sum_k a[e, k] M_i[k, c]`` for the edges ``e`` of node ``i = program_id(0)``, columns of chunk
    ``program_id(1)``, with ``M_i[k, c]`` at ``m + i m_node_stride + k m_stride_k + c m_stride_c``."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cs < c_size
    m_base = m_ptr + node.to(tl.int64) * m_node_stride
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        acc = tl.zeros((BLOCK_E, BLOCK_C), dtype=out_ptr.dtype.element_ty)
        for k0 in range(0, k_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_size
            a = tl.load(a_ptr + rows[:, None] * k_size + ks[None, :], mask=e_mask[:, None] & k_mask[None, :],
                        other=0.0)
            m = tl.load(m_base + ks[:, None] * m_stride_k + cs[None, :] * m_stride_c,
                        mask=k_mask[:, None] & c_mask[None, :], other=0.0)
            acc += tl.dot(a, m, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * c_size + cs[None, :], acc, mask=e_mask[:, None] & c_mask[None, :])


@tuned(["j_size", "p_size", "PRECISION"], {"BLOCK_J": "j_size", "BLOCK_P": "p_size"},
       [(64, 64, 4), (32, 32, 2), (32, 64, 4), (64, 128, 8), (128, 64, 8), (128, 128, 8)])
@triton.jit(do_not_specialize=["size_class"])
def _segment_outer_kernel(a_ptr, y_ptr, rowptr_ptr, u_ptr, j_size, p_size, size_class, BLOCK_E: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr):
    """``U[i, p, j] = sum_{e -> i} y[e, p] a[e, j]`` for node ``i = program_id(0)`` and the tile
    ``(program_id(1), program_id(2))`` of its ``[P, J]`` (zero for a node without edges)."""
    node = tl.program_id(0)
    start = tl.load(rowptr_ptr + node)
    stop = tl.load(rowptr_ptr + node + 1)
    ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    js = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = js < j_size
    p_mask = ps < p_size
    acc = tl.zeros((BLOCK_P, BLOCK_J), dtype=u_ptr.dtype.element_ty)
    for e0 in range(start, stop, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        e_mask = es < stop
        rows = es.to(tl.int64)
        y = tl.load(y_ptr + rows[:, None] * p_size + ps[None, :], mask=e_mask[:, None] & p_mask[None, :], other=0.0)
        a = tl.load(a_ptr + rows[:, None] * j_size + js[None, :], mask=e_mask[:, None] & j_mask[None, :], other=0.0)
        acc += tl.dot(tl.trans(y), a, input_precision=PRECISION)
    base = u_ptr + node.to(tl.int64) * p_size * j_size
    tl.store(base + ps[:, None] * j_size + js[None, :], acc, mask=p_mask[:, None] & j_mask[None, :])


@triton.jit
def _node_sum_kernel(z_ptr, u_ptr, part_ptr, num_nodes, nodes_per_program, width, dim_l, hidden, kh_size, j_size,
                     z_stride, u_stride, u_m_stride, row_tiles, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, PRECISION: tl.constexpr):
    """``part[s, a, w, (k, h)] = sum_i sum_m z[i, (a, w), m] u[i, m, (k, a, h)]`` over the nodes ``i`` of share ``s =
    program_id(0)`` (``nodes_per_program`` of them), for head ``a`` and the tile of rows ``w`` given by
    ``program_id(1) = a row_tiles + tile`` and the tile of columns ``(k, h)`` by ``program_id(2)``; ``z[i, (a, w),
    m]`` at ``z + i z_stride + (a width + w) dim_l + m``, ``u[i, m, (k, a, h)]`` at ``u + i u_stride + m
    u_m_stride + k j_size + a hidden + h`` (``kh_size = kdim hidden``)."""
    share = tl.program_id(0)
    head = tl.program_id(1) // row_tiles
    ws = (tl.program_id(1) % row_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    qs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    w_mask = ws < width
    q_mask = qs < kh_size
    z_cols = (head * width + ws) * dim_l
    u_cols = (qs // hidden) * j_size + head * hidden + qs % hidden
    start = share * nodes_per_program
    stop = tl.minimum(start + nodes_per_program, num_nodes)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=part_ptr.dtype.element_ty)
    for n0 in range(start, stop, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_mask = ns < stop
        nodes = ns.to(tl.int64)
        for m in range(dim_l):
            zt = tl.load(z_ptr + nodes[:, None] * z_stride + z_cols[None, :] + m,
                         mask=n_mask[:, None] & w_mask[None, :], other=0.0)
            ut = tl.load(u_ptr + nodes[:, None] * u_stride + m * u_m_stride + u_cols[None, :],
                         mask=n_mask[:, None] & q_mask[None, :], other=0.0)
            acc += tl.dot(tl.trans(zt), ut, input_precision=PRECISION)
    base = part_ptr + (share.to(tl.int64) * tl.num_programs(1) // row_tiles + head) * width * kh_size
    tl.store(base + ws[:, None] * kh_size + qs[None, :], acc, mask=w_mask[:, None] & q_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE unless float32 products may use TF32 (PyTorch's own switch)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _check_interpretable(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise RuntimeError("the Triton kernels run CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing e3attn (E3ATTN_KERNEL_BACKEND=triton does so where there is no GPU)")


def _segment_rows(a: torch.Tensor, m: torch.Tensor, rowptr: torch.Tensor, over_paths: bool) -> torch.Tensor:
    """For ``M [N, P, J]`` and the edges ``e -> i``: ``out[e] = a[e] @ M_i`` (``over_paths``: ``a [E, P]``,
    ``out [E, J]``) or ``out[e] = a[e] @ M_i^T`` (``a [E, J]``, ``out [E, P]``)."""
    nodes, paths, cols = m.shape
    k_size, c_size = (paths, cols) if over_paths else (cols, paths)
    stride_k, stride_c = (cols, 1) if over_paths else (1, cols)
    out = a.new_empty(a.shape[0], c_size)
    if out.numel() == 0:
        return out
    _segment_rows_kernel[lambda meta: (nodes, triton.cdiv(c_size, meta["BLOCK_C"]))](
        a, m, rowptr, out, k_size, c_size, paths * cols, stride_k, stride_c, size_class(nodes), BLOCK_E=BLOCK_E,
        BLOCK_K=_block(k_size, 16, 64), PRECISION=_precision(a.dtype))
    return out


def _segment_outer(a: torch.Tensor, y: torch.Tensor, rowptr: torch.Tensor) -> torch.Tensor:
    """``U [N, P, J]``: ``U_i = sum_{e -> i} y_e^T a_e``."""
    nodes, j_size, p_size = rowptr.shape[0] - 1, a.shape[1], y.shape[1]
    u = y.new_empty(nodes, p_size, j_size)
    if u.numel() == 0:
        return u

    def grid(meta):
        return nodes, triton.cdiv(p_size, meta["BLOCK_P"]), triton.cdiv(j_size, meta["BLOCK_J"])

    _segment_outer_kernel[grid](a, y, rowptr, u, j_size, p_size, size_class(nodes), BLOCK_E=BLOCK_E,
                                PRECISION=_precision(y.dtype))
    return u


_SUM_PROGRAMS = 1024  # about as many programs of _node_sum_kernel: a few per multiprocessor
_SUM_BLOCK_N = 32  # nodes per step of _node_sum_kernel (tl.dot's inner size)


def _node_sum(zb: torch.Tensor, ub: torch.Tensor, heads: int, hidden: int) -> torch.Tensor:
    """``G[a, w, (k, h)] = sum_i sum_m zb[i, (a, w), m] ub[i, m, (k, a, h)]`` ``[heads, width, kdim hidden]`` for
    ``zb [N, heads width, M]`` (rows of ``z``: stride 1 along ``M``, ``M`` along the rows) and ``ub [N, M, kdim
    heads hidden]`` (rows of ``U``: contiguous ``[M, kdim heads hidden]``): the head-diagonal blocks of ``sum_i
    zb[i]^T ub[i]``, the others not computed. A sum over the nodes split into shares, each share's sum by one
    program per head and tile (cuBLAS runs such a product, of a long inner dimension and a small result, on a few
    programs), then the shares' sums added (bitwise repeatable)."""
    nodes, rows, dim_l = zb.shape
    width, kh_size = rows // heads, ub.shape[2] // heads
    if nodes == 0 or width == 0 or kh_size == 0:  # a block without paths (cut by a support) or channels
        return zb.new_zeros(heads, width, kh_size)
    block_r, block_c = _block(width, 16, 32), _block(kh_size, 16, 64)
    tiles = (heads * triton.cdiv(width, block_r), triton.cdiv(kh_size, block_c))
    shares = max(1, min(triton.cdiv(nodes, _SUM_BLOCK_N), triton.cdiv(_SUM_PROGRAMS, tiles[0] * tiles[1])))
    per_share = triton.cdiv(triton.cdiv(nodes, shares), _SUM_BLOCK_N) * _SUM_BLOCK_N
    shares = triton.cdiv(nodes, per_share)
    part = zb.new_empty(shares, heads, width, kh_size)
    _node_sum_kernel[(shares,) + tiles](
        zb, ub, part, nodes, per_share, width, dim_l, hidden, kh_size, heads * hidden, zb.stride(0), ub.stride(0),
        ub.stride(1), tiles[0] // heads, BLOCK_N=_SUM_BLOCK_N, BLOCK_R=block_r, BLOCK_C=block_c,
        PRECISION=_precision(zb.dtype))
    return part.sum(0)


# ------------------------------------------------------------------ per node: E(z, L) and its adjoints, per block


class _Block(NamedTuple):
    """A block of the product (a degree group: ``kdim`` paths, ``dim_l = 2l+1`` components, ``width`` channels
    per head) as the node matrices see it: its rows ``poff : poff + dim_l kdim`` of ``Q_i [P, J]``, its columns
    ``zoff : zoff + heads width dim_l`` of ``z`` and ``loff`` of ``L``, and ``lbd``, the offset of its
    ``[heads width, kdim J]`` matrix in :func:`_head_matrices`."""

    poff: int
    kdim: int
    dim_l: int
    width: int
    loff: int
    zoff: int
    lbd: int


class _Plan(NamedTuple):
    blocks: Tuple[_Block, ...]
    index: torch.Tensor  # [sum of the blocks' heads width kdim J] into L and one zero after it
    uncovered: Tuple[Tuple[int, int], ...]  # rows of Q_i that no block writes (zero)


_PLANS: Dict[Tuple, _Plan] = {}


def _plan(table: List[List[int]], dims: List[int], device: torch.device) -> _Plan:
    """The blocks of ``table`` and the gather that lays out ``L`` per block as the head-block-diagonal matrices
    ``Lb[(a, w), (k, a', h)] = [a = a'] L[a, w, h, k]`` (:func:`_head_matrices`)."""
    key = (tuple(map(tuple, table)), tuple(dims), device)
    found = _PLANS.get(key)
    if found is None:
        heads, hidden, paths, _, lsize = dims
        blocks, parts, covered, offset = [], [], np.zeros(paths, bool), 0
        for poff, kdim, dim_l, width, loff, zoff in table:
            a, w, k, b, h = np.ix_(*(np.arange(n) for n in (heads, width, kdim, heads, hidden)))
            index = loff + ((a * width + w) * hidden + h) * kdim + k  # [a, w, k, a', h]
            parts.append(np.where(a == b, index, lsize).reshape(-1))  # lsize: the zero appended to L
            blocks.append(_Block(poff, kdim, dim_l, width, loff, zoff, offset))
            covered[poff : poff + dim_l * kdim] = True
            offset += parts[-1].size
        edges = np.flatnonzero(np.diff(np.concatenate([[1], covered.astype(np.int8), [1]])))
        uncovered = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))  # runs of False
        index = torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0, np.int64), device=device)
        found = _PLANS[key] = _Plan(tuple(blocks), index, uncovered)
    return found


def _head_matrices(lt: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """All blocks' ``Lb [heads width, kdim J]`` (see :func:`_plan`), flat, in one gather."""
    return torch.cat([lt, lt.new_zeros(1)]).index_select(0, plan.index)


def _views(blk: _Block, dims: List[int], lbd: Optional[torch.Tensor], z: Optional[torch.Tensor]):
    """The block's ``Lb [heads width, kdim J]`` and ``z_b [N, heads width, 2l+1]`` (None where not given)."""
    heads, hidden = dims[:2]
    rows, cols = heads * blk.width, blk.kdim * heads * hidden
    lb = lbd[blk.lbd : blk.lbd + rows * cols].view(rows, cols) if lbd is not None else None
    zb = z[:, blk.zoff : blk.zoff + rows * blk.dim_l].unflatten(1, (rows, blk.dim_l)) if z is not None else None
    return lb, zb


def _rows(m: torch.Tensor, blk: _Block) -> torch.Tensor:
    """The block's rows of ``M [N, P, J]`` as ``[N, 2l+1, kdim J]`` (a view)."""
    return m[:, blk.poff : blk.poff + blk.dim_l * blk.kdim].unflatten(1, (blk.dim_l, -1)).flatten(2)


def _expand(z: torch.Tensor, lt: torch.Tensor, table: List[List[int]], dims: List[int]) -> torch.Tensor:
    """``Q [N, P, J]``: ``Q[i, poff + m K + k, a H + h] = sum_w z[i, a, w, m] L[a, w, h, k]``, per block one
    matrix product per component ``m`` (``[N, heads width] @ Lb``, batched over ``m``) written in place into its
    rows of ``Q``."""
    heads, hidden, paths = dims[:3]
    plan = _plan(table, dims, z.device)
    q = z.new_empty(z.shape[0], paths, heads * hidden)
    for start, stop in plan.uncovered:
        q[:, start:stop] = 0.0
    lbd = _head_matrices(lt, plan)
    for blk in plan.blocks:  # batched over the components m: [N, heads width] @ Lb per m, into Q's rows in place
        lb, zb = _views(blk, dims, lbd, z)
        torch.bmm(zb.permute(2, 0, 1), lb.expand(blk.dim_l, -1, -1), out=_rows(q, blk).transpose(0, 1))
    return q


def _adjoints(u: torch.Tensor, lt: Optional[torch.Tensor], z: Optional[torch.Tensor], table: List[List[int]],
              dims: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """From ``U [N, P, J]``: ``R(U, L) [N, z width]`` (if ``lt``) and ``sum_i X(U_i, z_i) [L size]`` (if ``z``),
    each empty otherwise; per block batched matrix products on views of ``U`` (no copy of it)."""
    heads, hidden, _, zwidth, lsize = dims
    nodes = u.shape[0]
    plan = _plan(table, dims, u.device)
    out = u.new_zeros(nodes if lt is not None else 0, zwidth)  # zero where no block is (as numba's)
    glt = u.new_zeros(lsize if z is not None else 0)
    lbd = _head_matrices(lt, plan) if lt is not None else None
    for blk in plan.blocks:
        ub = _rows(u, blk)  # [N, 2l+1, K J]
        lb, zb = _views(blk, dims, lbd, z)
        rows = heads * blk.width
        if lt is not None:  # out[i, (a, w), m] = sum_(k, a', h) Lb[(a, w), (k, a', h)] U_i[m, (k, a', h)]
            r = torch.bmm(ub.transpose(0, 1), lb.t().expand(blk.dim_l, -1, -1))  # [2l+1, N, heads width]
            out[:, blk.zoff : blk.zoff + rows * blk.dim_l].unflatten(1, (rows, blk.dim_l)).copy_(r.permute(1, 2, 0))
        if z is not None:  # sum over nodes and m of z_i[(a, w), m] U_i[m, (k, a, h)]: [a, w, (k, h)]
            g = _node_sum(zb, ub, heads, hidden).view(heads, blk.width, blk.kdim, hidden)
            size = heads * blk.width * hidden * blk.kdim
            glt[blk.loff : blk.loff + size].view(heads, blk.width, hidden, blk.kdim).copy_(g.transpose(2, 3))
    return out, glt


def node_pass(y: Optional[torch.Tensor], a: Optional[torch.Tensor], z: Optional[torch.Tensor],
              lt: Optional[torch.Tensor], table: List[List[int]], rowptr: torch.Tensor, dims: List[int],
              needs: Sequence[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The outputs of :func:`e3attn.kernels.segments.node_pass` flagged in ``needs`` (the others empty):
    :math:`t = D(y, Q)` ``[E, heads * hidden]``, :math:`r = C(a, Q)` ``[E, paths]``, :math:`R(U, L)`
    ``[N, z width]`` and :math:`\sum_i X(U_i, z_i)` ``[L size]``, with :math:`Q_i = E(z_i, L)` and
    :math:`U_i = \sum_{e \to i} a_e^T y_e`, both stored ``[N, paths, heads * hidden]``. ``table`` is the block
    table as Python integers; the arguments are checked by the caller (:mod:`e3attn.kernels.segment_ops`)."""
    need_t, need_r, need_o, need_g = needs
    ref = next(t for t in (y, a, z) if t is not None)
    _check_interpretable(ref)
    heads, hidden, paths = dims[:3]
    num = y.shape[0] if y is not None else a.shape[0]
    a = a.reshape(num, heads * hidden).contiguous() if a is not None else None
    y = y.contiguous() if y is not None else None
    empty = ref.new_empty(0)
    t = r = o = g = empty
    if need_t or need_r:
        q = _expand(z.contiguous(), lt.contiguous(), table, dims)
        t = _segment_rows(y, q, rowptr, over_paths=True) if need_t else ref.new_empty(0, heads * hidden)
        r = _segment_rows(a, q, rowptr, over_paths=False) if need_r else ref.new_empty(0, paths)
    if need_o or need_g:
        u = _segment_outer(a, y, rowptr)
        o, g = _adjoints(u, lt.contiguous() if need_o else None, z.contiguous() if need_g else None, table, dims)
    return (t if need_t else ref.new_empty(0, heads * hidden), r if need_r else ref.new_empty(0, paths),
            o if need_o else ref.new_empty(0, dims[3]), g if need_g else empty)
