r"""The CPU kernels against the machine's arithmetic peak (a roofline in one run).

For the layer of ``benchmarks/layer.py`` (configurations ``guide`` and ``large``, same graphs), this script
times the custom operators alone on the layer's own inputs, the gathered node features, the spherical
harmonics, the radial network's hidden features and its folded last layers. The kernels the layer runs on
the CPU, its radial weights contracted at the nodes (:class:`e3attn.node_contraction.NodeContraction`), are:

* ``node_forward``: ``e3attn::path_features``, ``e3attn::node_expand`` (the logits' contraction) and
  ``e3attn::node_outer`` (the output), as in the layer's forward;
* ``node_backward``: the calls of the layer's backward (the path features' gradient, two ``node_expand`` and
  two ``node_outer``), all gradients.

It counts their floating-point operations from the product's structure (:func:`node_flops`: a multiply-add is
2), and those of forming keys and values on every edge instead (:func:`flops`, what the contraction at the nodes
saves), and reports GFLOP/s next to two references measured in the same process with the same thread count:

* ``peak``: ``torch.mm`` of two 1024 x 1024 float32 matrices (the BLAS's best case: the machine's attainable
  peak);
* ``blas``: the weight product of the layer, :math:`w = h L` for all edges ``[E, hidden] @ [hidden, numel]``,
  as one ``torch.mm``: the same arithmetic as the kernels' dominant part, in the BLAS's hands.

The floors are the time the arithmetic would need at the ``peak`` rate: ``node_floor_ms`` that of the node
kernels, ``edge_floor_ms`` that of the per-edge formulation; no implementation of the same arithmetic can beat
them on this machine. Times are medians of ``--repeats`` calls after a warm-up call, the
measurements taking turns.

Usage::

    python benchmarks/kernels.py --threads 1
    python benchmarks/kernels.py --configs guide --sizes 1000 --threads 1 2
    python benchmarks/kernels.py --quick        # tiny sizes, a smoke test
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn.train import options as opt  # noqa: E402
from dense_vs_sparse import cpu_name  # noqa: E402
from layer import CONFIGS, DEFAULTS, build, write  # noqa: E402

from e3attn.kernels import segment_ops  # noqa: E402
from e3attn.kernels.layout import KernelLayout, layout_for  # noqa: E402


def flops(layout: KernelLayout, hidden_sizes: Sequence[int]) -> Dict[str, int]:
    r"""Floating-point operations per edge of forming keys and values on every edge, by counting: in tiles of
    edges that store nothing per edge (the per-edge kernels of earlier versions), what the node kernels replace.

    Per non-zero Clebsch-Gordan coefficient, the path features cost 3 (:math:`y \mathrel{+}= c\,x\,Y`) and their
    backward 5; per output block (:math:`K` paths, :math:`W` channels, :math:`2l+1` components, hidden size
    :math:`H`) the weights :math:`w = h L` cost :math:`2HKW` and their contraction with :math:`y` :math:`2KW(2l+1)`.
    The backward recomputes :math:`y` and :math:`w`, contracts :math:`w` and the output gradient into the
    gradient of :math:`y`, forms the gradient of :math:`w` (:math:`2KW(2l+1)`) and multiplies it by :math:`L`
    and by :math:`h` (:math:`2HKW` each). ``weights`` is the share of :math:`w = hL` and its two gradients.
    """
    coefficients = len(layout.path_c)
    weights = contractions = 0
    for output, _, k, dim_l, width, _, _ in layout.blocks:
        weights += 2 * int(hidden_sizes[output]) * int(k) * int(width)
        contractions += 2 * int(k) * int(width) * int(dim_l)
    forward = 3 * coefficients + weights + contractions
    backward = 3 * coefficients + 3 * weights + 2 * contractions + 5 * coefficients
    return {"forward": forward, "backward": backward, "weights_forward": weights, "weights_backward": 3 * weights}


def node_flops(layer, layout: KernelLayout, edges: int, num_nodes: int) -> Dict[str, int]:
    r"""Floating-point operations of the layer's kernels at the nodes (:mod:`e3attn.kernels.segments`), in all.

    Per edge, with :math:`J` = heads x hidden and :math:`P` paths, each of :math:`D(y, Q)`, :math:`C(a, Q)` and
    the sum :math:`U = \sum a^T y` costs :math:`2JP`; per node and block of an output (:math:`K` paths,
    :math:`W` channels, :math:`2l+1` components), each of :math:`E`, :math:`R` and :math:`X` costs
    :math:`2 H K W (2l+1)`. The forward runs :math:`D + U` per edge, :math:`E` (keys) and :math:`R` (values) per
    node; the backward :math:`D + 2C + 2U` per edge, :math:`E + R + X` (keys) and :math:`E + X` (values) per node;
    the path features cost 3 (forward) and 5 (backward) per Clebsch-Gordan coefficient and edge.
    """
    nodes = layer.nodes
    per_edge = 2 * nodes.num_heads * nodes.hidden * nodes.num_paths
    keys, values = (2 * nodes.hidden * sum(int(k) * int(w) * int(m) for t, _, k, m, w, _, _ in layout.blocks if t == out)
                    for out in (0, 1))
    coefficients = len(layout.path_c)
    return {"node_forward": edges * (2 * per_edge + 3 * coefficients) + num_nodes * (keys + values),
            "node_backward": edges * (5 * per_edge + 5 * coefficients) + num_nodes * (3 * keys + 2 * values)}


def node_calls(layer, x, src, dst, sh, seed: int) -> Dict[str, Callable[[], object]]:
    """The layer's calls of the node kernels in its forward and in its backward, on the layer's inputs (random
    gradients and attention weights: the kernels' time does not depend on the values)."""
    nodes, num = layer.nodes, sh.shape[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        keys, values = layer.radial.output_layers()
        lk = keys.reshape(-1).index_select(0, nodes._key_weights)
        lv = values.reshape(-1).index_select(0, nodes._value_weights)
        zk = layer.dot.project_query(layer.query(x)).flatten(1).index_select(1, nodes._key_columns)
        y = segment_ops.path_features(nodes.spec, x, src, sh)
    assert bool((dst[1:] >= dst[:-1]).all()), "the graphs of layer.py are sorted by destination"
    rowptr = torch.searchsorted(dst, torch.arange(x.shape[0] + 1))
    a, gt = (torch.randn(num, nodes.num_heads * nodes.hidden, generator=g) for _ in range(2))
    go, gy = torch.randn(x.shape[0], nodes._dims[1][3], generator=g), torch.randn(y.shape, generator=g)
    (kb, kd), (vb, vd) = (nodes._key_blocks, nodes._dims[0]), (nodes._value_blocks, nodes._dims[1])
    return {
        "node_forward": lambda: (segment_ops.path_features(nodes.spec, x, src, sh),
                                 segment_ops.node_expand(y, None, zk, lk, kb, rowptr, kd),
                                 segment_ops.node_outer(a, y, lv, None, vb, rowptr, vd)),
        "node_backward": lambda: (segment_ops.path_features_backward(nodes.spec, x, src, sh, gy, [True, True]),
                                  segment_ops.node_expand(y, a, go, lv, vb, rowptr, vd),
                                  segment_ops.node_outer(a, y, None, go, vb, rowptr, vd),
                                  segment_ops.node_expand(None, gt, zk, lk, kb, rowptr, kd),
                                  segment_ops.node_outer(gt, y, lk, zk, kb, rowptr, kd)),
    }


def kernel_inputs(config: str, n: int, degree: float, seed: int):
    """The layer, the destinations of its edges and the product's inputs for one case of ``layer.py``: the node
    features, the sources of the edges, their harmonics, the radial networks' hidden features and last layers."""
    models, f, pos, edge_index = build(config, n, degree, torch.device("cpu"), seed)
    layer = models["e3attn"]
    src, dst = edge_index
    with torch.no_grad():
        edge_vec = pos[src] - pos[dst]
        hidden = layer.radial.hidden_features(layer.embedding(edge_vec.norm(dim=-1)))
        sh = layer.sh(edge_vec)
        linear = layer.radial.output_layers()
    return layer, dst, (f.detach(), src, sh, hidden, linear)


def median_ms(calls: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median time of every call in ms, after a warm-up call, the calls taking turns."""
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(times) for name, times in samples.items()}


def run_case(config: str, n: int, threads: int, args: argparse.Namespace) -> dict:
    """One row: the kernels' times and rates against the peak and the BLAS on the same weight product."""
    torch.set_num_threads(threads)
    layer, dst, (x, index, sh, hidden, linear) = kernel_inputs(config, n, args.degree, args.seed)
    layout = layout_for(layer.tp._spec)
    edges = sh.shape[0]
    count = flops(layout, [h.shape[1] for h in hidden])
    node_count = node_flops(layer, layout, edges, n)
    square = torch.randn(1024, 1024)
    # the weight product w = h L of every output, as one matrix product per output
    factors = [(h.contiguous(), w.contiguous()) for h, w in zip(hidden, linear)]
    calls = {
        **node_calls(layer, x, index, dst, sh, args.seed),
        "peak": lambda: square @ square,
        "blas": lambda: [h @ w for h, w in factors],
    }
    times = median_ms(calls, args.repeats)
    rate = {name: node_count[name] / (times[name] * 1e6) for name in node_count}
    peak = 2 * 1024**3 / (times["peak"] * 1e6)
    blas = count["weights_forward"] * edges / (times["blas"] * 1e6)
    row = {"config": config, "nodes": n, "edges": edges, "threads": threads, "flops_per_edge": count,
           "node_flops": node_count, **{f"{k}_ms": v for k, v in times.items()},
           **{f"{k}_gflops": v for k, v in rate.items()}, "peak_gflops": peak, "blas_gflops": blas,
           "edge_floor_ms": (count["forward"] + count["backward"]) * edges / (peak * 1e6),
           "node_floor_ms": sum(node_count.values()) / (peak * 1e6)}
    print(f"{config:>6} {n:>6} {edges:>8} {threads:>3} "
          + " ".join(f"{times[k]:9.2f} {rate[k]:7.1f}" for k in ("node_forward", "node_backward"))
          + f" {blas:7.1f} {peak:7.1f} {row['node_floor_ms']:9.2f} {row['edge_floor_ms']:9.2f}", flush=True)
    return row


HEADER = (f"{'config':>6} {'nodes':>6} {'edges':>8} {'thr':>3} "
          + " ".join(f"{name + ' ms':>9} {'GFLOP/s':>7}" for name in ("node fwd", "node bwd"))
          + f" {'blas':>7} {'peak':>7} {'node flr':>9} {'edge flr':>9}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--sizes", type=opt.positive_int, nargs="+", default=None, help="numbers of nodes (default: layer.py's)")
    p.add_argument("--threads", type=opt.positive_int, nargs="+", default=[1])
    p.add_argument("--degree", type=opt.positive_float, default=14.0, help="mean number of edges per node")
    p.add_argument("--repeats", type=opt.positive_int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke test")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.json")
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    if args.quick:
        args.sizes, args.repeats = [16], 2
    if min(args.sizes or [1]) < 1 or args.repeats < 1 or min(args.threads) < 1:
        p.error("--sizes, --threads and --repeats must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run every case, print the table, write the JSON."""
    args = parse_args(argv)
    print(f"device {cpu_name()} (cpu), float32; GFLOP/s of the layer's kernels at the nodes, of the BLAS on "
          "w = h L, of a 1024^3 mm; floors at the peak (ms) of the node kernels and of forming w per edge")
    print(HEADER)
    rows = [run_case(config, n, threads, args) for config in args.configs
            for n in (args.sizes or DEFAULTS[config]["sizes"]) for threads in args.threads]
    report = {"meta": {"device": cpu_name(), "torch": torch.__version__, "repeats": args.repeats,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "results": rows}
    write(report, args.out)
    return report


if __name__ == "__main__":
    main()
