r"""The flat arrays that describe a :class:`~e3attn.tensor_product.SphericalTensorProduct` to the kernels.

The kernels see the product as two sparse steps per edge :math:`e`:

1. the *path features* :math:`y_e = P(x_e, Y_e)`, one float per (degree group :math:`g`, path :math:`k`,
   component :math:`m`), from the non-zero Clebsch-Gordan coefficients:

   .. math:: y_{e, p} = \sum_{q:\ p_q = p} c_q\, x_{e, i_q}\, Y_{e, j_q}

2. per output block (an output :math:`t` and a degree group :math:`g`, weights ``[K, W]``):

   .. math:: z_{e, \mathrm{col}(w) + m} = \sum_k \Big(\sum_h h_{e, h} L_{h, k W + w}\Big)\, y_{e, g, k, m}

The node contraction (:class:`~e3attn.node_contraction.NodeContraction`) computes the first step per edge
(``e3attn::path_features``, :mod:`e3attn.kernels.segment_ops`) and takes the second to the nodes, block by
block. All arrays are built once per product, from its Clebsch-Gordan constant and weight layout.

A layout may also keep only some inputs and degree groups (:func:`restricted_spec`): the paths :math:`k` from
the other input irreps and the groups not kept are dropped, and every kept path keeps its coefficients (with
the normalisation of the whole product) and, through ``rows``, its row of the weights. Where the dropped inputs
are zero and the dropped groups unused, it computes the same with fewer paths.
"""
from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..tensor_product import _structure

__all__ = ["KernelLayout", "component_major_paths", "kernel_layout", "layout_for", "padded_paths", "restricted_spec"]

# columns of ``KernelLayout.blocks``
BLOCK_FIELDS = ("output", "path_offset", "k", "dim_l", "width", "weight_offset", "channel_offset")


class KernelLayout(NamedTuple):
    """The structure of a tensor product as flat arrays (see the module docstring).

    ``path_x``, ``path_y``, ``path_p`` (int64) and ``path_c`` (float64) list the non-zero
    coefficients :math:`(i_q, j_q, p_q, c_q)`, sorted by :math:`p_q`; ``num_paths`` is the length of
    :math:`y_e`. ``blocks`` has one row per output block with the columns ``BLOCK_FIELDS``: the
    output, the offset of its degree group in :math:`y_e`, :math:`K`, :math:`2l+1`, :math:`W`,
    the offset of its ``[K, W]`` weights in the output's weights and the offset of its channels in
    ``channels``, which holds the first output column (component :math:`m = 0`) of every channel
    :math:`w`, counted in the concatenation of all outputs. ``out_offsets`` are the first columns of
    the outputs in that concatenation and ``weight_numel`` their weight counts. ``rows`` holds, block after
    block, the row of the product's ``[K, W]`` weights of each of the block's :math:`K` paths (``0 .. K - 1``
    unless the layout is restricted, :func:`restricted_spec`).
    """

    path_x: np.ndarray
    path_y: np.ndarray
    path_p: np.ndarray
    path_c: np.ndarray
    num_paths: int
    blocks: np.ndarray
    channels: np.ndarray
    out_offsets: Tuple[int, ...]
    weight_numel: Tuple[int, ...]
    rows: np.ndarray


def kernel_layout(tp, inputs: Optional[Sequence[int]] = None, groups: Optional[Sequence[int]] = None) -> KernelLayout:
    """The :class:`KernelLayout` of ``tp`` (a ``SphericalTensorProduct``), read from its structure; with
    ``inputs`` (indices of ``tp``'s input irreps) and ``groups`` (of its degree groups), only the paths from
    those inputs into those groups (see the module docstring)."""
    kept_inputs = set(range(len(tp._in)) if inputs is None else inputs)
    kept_groups = set(range(len(tp._groups)) if groups is None else groups)
    steps = [s for s in tp._steps if s.a in kept_inputs and s.g in kept_groups]
    k_kept = [sum(s.rows for s in steps if s.g == g) for g in range(len(tp._groups))]
    cg = tp.cg.detach().to("cpu", torch.float64).numpy()
    in_offsets = np.cumsum([0] + [mul * (2 * l + 1) for mul, l, _ in tp._in])
    group_sizes = [k * (2 * l + 1) for k, (l, _) in zip(k_kept, tp._groups)]
    group_offsets = np.cumsum([0] + group_sizes)
    rows_done = [0] * len(tp._groups)  # kept paths k of each group already placed by earlier steps
    rows_of: List[List[int]] = [[] for _ in tp._groups]  # the product's weight row of every kept path
    full_rows = [0] * len(tp._groups)  # paths of each group in the whole product before this step

    xs, ys, ps, cs = [], [], [], []
    column = 0
    for step in tp._steps:
        mul = step.rows // (step.cols // step.dim_l)
        n_sh = step.cols // step.dim_l
        block = cg[:, column : column + step.dim_a * step.cols].reshape(-1, step.dim_a, n_sh, step.dim_l)
        column += step.dim_a * step.cols
        full_rows[step.g] += step.rows
        if step.a not in kept_inputs or step.g not in kept_groups:
            continue
        for j, i, n, m in zip(*np.nonzero(block)):
            for u in range(mul):
                k = rows_done[step.g] + u * n_sh + n
                xs.append(in_offsets[step.a] + u * step.dim_a + i)
                ys.append(j)
                ps.append(group_offsets[step.g] + k * step.dim_l + m)
                cs.append(block[j, i, n, m])
        rows_done[step.g] += step.rows
        rows_of[step.g].extend(range(full_rows[step.g] - step.rows, full_rows[step.g]))
    order = np.argsort(np.asarray(ps, dtype=np.int64), kind="stable")

    out_dims = [irreps.dim for irreps in tp.irreps_outs]
    out_offsets = tuple(int(v) for v in np.cumsum([0] + out_dims[:-1]))
    blocks, channels, rows = [], [], []
    for t, blocks_t in enumerate(tp._blocks):
        for blk, weight_offset in zip(blocks_t, tp._block_offsets[t]):
            if blk.g not in kept_groups:
                continue
            first = [0] * blk.width
            for mul, start, row in blk.members:
                for w in range(mul):
                    first[start + w] = out_offsets[t] + row + w * blk.dim_l
            blocks.append((t, group_offsets[blk.g], k_kept[blk.g], blk.dim_l, blk.width, weight_offset,
                           len(channels)))
            channels.extend(first)
            rows.extend(rows_of[blk.g])

    def ints(values) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(values, dtype=np.int64))

    return KernelLayout(
        path_x=ints(xs)[order], path_y=ints(ys)[order], path_p=ints(ps)[order],
        path_c=np.ascontiguousarray(np.asarray(cs, dtype=np.float64)[order]),
        num_paths=int(group_offsets[-1]),
        blocks=ints(blocks).reshape(-1, len(BLOCK_FIELDS)),
        channels=ints(channels),
        out_offsets=out_offsets,
        weight_numel=tuple(tp.weight_numel),
        rows=ints(rows),
    )


_LAYOUTS: Dict[str, KernelLayout] = {}
_RESTRICTED = " @ "  # between a product's spec and the inputs and groups that a restricted layout keeps


def restricted_spec(spec: str, inputs: Sequence[int], groups: Sequence[int]) -> str:
    """The name of the layout of the product named by ``spec`` restricted to the paths from its input irreps
    ``inputs`` into its degree groups ``groups`` (indices, as in :func:`kernel_layout`), for :func:`layout_for`
    and the kernels' operators.

    Example::

        >>> restricted_spec("2x0e+1x1o | 1x0e+1x1o | 2x0e+1x1o", inputs=[0], groups=[0])
        '2x0e+1x1o | 1x0e+1x1o | 2x0e+1x1o @ inputs 0 groups 0'
    """
    ints = lambda values: ",".join(str(int(v)) for v in values)  # noqa: E731
    return f"{spec}{_RESTRICTED}inputs {ints(inputs)} groups {ints(groups)}"


def layout_for(spec: str) -> KernelLayout:
    """The layout of the product named by ``spec`` (``SphericalTensorProduct._spec``, or a
    :func:`restricted_spec` of it), built once per process."""
    layout = _LAYOUTS.get(spec)
    if layout is None:
        product, _, kept = spec.partition(_RESTRICTED)
        if kept:
            _, inputs, _, groups = (kept + " ").split(" ")[:4]
            parse = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
            layout = kernel_layout(_structure(product), parse(inputs), parse(groups))
        else:
            layout = kernel_layout(_structure(product))
        _LAYOUTS[spec] = layout
    return layout


def padded_paths(num_paths: int) -> int:
    """The columns of the node kernels' path features: ``num_paths`` padded with zeros to a multiple of 8, so that
    their loops along the paths run in whole vectors, without a scalar remainder."""
    return -(-num_paths // 8) * 8


@functools.lru_cache(maxsize=None)
def component_major_paths(spec: str) -> Tuple[np.ndarray, int]:
    """The column of every path feature ``p`` of the product named by ``spec`` in the order of the node kernels
    (:mod:`e3attn.kernels.segment_ops`): (degree group, component ``m``, path ``k``) instead of the layout's
    (group, ``k``, ``m``); and the number of columns (:func:`padded_paths`: the last ones are zeros)."""
    layout = layout_for(spec)
    groups = sorted({(int(b[1]), int(b[2]), int(b[3])) for b in layout.blocks})  # (offset, K, 2l+1)
    starts = np.asarray([g[0] for g in groups] + [layout.num_paths], dtype=np.int64)
    p = np.arange(layout.num_paths, dtype=np.int64)
    g = np.searchsorted(starts, p, side="right") - 1
    kdim = np.asarray([x[1] for x in groups], dtype=np.int64)[g]
    dim_l = np.asarray([x[2] for x in groups], dtype=np.int64)[g]
    local = p - starts[g]
    return starts[g] + (local % dim_l) * kdim + local // dim_l, padded_paths(layout.num_paths)
