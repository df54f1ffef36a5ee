r"""Radius graph: e3attn against vesin, torch_cluster and a dense ``torch.cdist`` baseline.

Points are uniform in a cube whose side gives about ``--neighbours`` points inside a ball
of the cutoff :math:`r = 1` (fewer near the faces):

.. math:: \frac{N}{L^3} \cdot \frac{4}{3}\pi r^3 = \text{neighbours}

For every size :math:`N` each available method builds the full directed graph
(both ``i -> j`` and ``j -> i``, no self-loops):

* ``e3attn``: :func:`e3attn.graph.radius_graph`, output sorted by destination then source
  (SciPy KD-tree on CPU; torch_cluster, when installed, on other devices);
* ``e3attn[cells]``: the same function forced onto its plain-PyTorch cell list, the path
  used on GPUs without torch_cluster;
* ``vesin``: ``vesin.NeighborList(full_list=True)`` with its defaults (unsorted pairs,
  all CPU cores), given float64 NumPy points prepared outside the timed call; CPU only;
* ``torch_cluster``: ``torch_cluster.radius_graph`` with a neighbour cap well above the
  densest node (its default of 32 would truncate);
* ``dense``: all pair distances with ``torch.cdist``, thresholded, only up to
  ``--dense-max`` points (:math:`N^2` memory).

Time is the best of ``--repeats`` calls after one warm-up call, the methods taking turns
(so slow drifts of a shared machine hit all of them alike). Peak memory is measured by one
more call (see :func:`dense_vs_sparse.peak_mib`: peak resident set size above the size
before the call on Linux CPU, ``max_memory_allocated`` on CUDA). Ratios are to vesin's
time at the same :math:`N`. All methods must agree on the number of edges.

Usage::

    python benchmarks/radius_graph.py                   # 1e3, 1e4, 1e5 points, GPU when present
    python benchmarks/radius_graph.py --device cpu --threads 1
    python benchmarks/radius_graph.py --quick           # tiny sizes, a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from dense_vs_sparse import box_side, memory_method, peak_mib, sync  # noqa: E402

from e3attn.graph import _radius_graph, radius_graph  # noqa: E402

RADIUS = 1.0


def methods(pos: torch.Tensor, dense_max: int) -> Dict[str, Callable[[], int]]:
    """The available methods on ``pos``, each a call returning its number of edges."""
    out: Dict[str, Callable[[], int]] = {
        "e3attn": lambda: radius_graph(pos, RADIUS).shape[1],
        "e3attn[cells]": lambda: _radius_graph(pos, RADIUS, None, False, None, "cells").shape[1],
    }
    if pos.device.type == "cpu":
        try:
            import vesin
        except ImportError:
            pass
        else:
            points, box = pos.double().numpy(), np.zeros((3, 3))
            neighbours = vesin.NeighborList(cutoff=RADIUS, full_list=True)
            out["vesin"] = lambda: len(neighbours.compute(points, box, False, "i")[0])
    try:
        import torch_cluster
    except ImportError:
        pass
    else:
        out["torch_cluster"] = lambda: torch_cluster.radius_graph(pos, RADIUS, max_num_neighbors=256).shape[1]
    if pos.shape[0] <= dense_max:

        def dense() -> int:
            near = torch.cdist(pos, pos, compute_mode="donot_use_mm_for_euclid_dist") < RADIUS
            near.fill_diagonal_(False)
            return near.nonzero().shape[0]

        out["dense"] = dense
    return out


def run_size(n: int, args: argparse.Namespace, device: torch.device) -> List[dict]:
    """Time and peak memory of every method at ``n`` points."""
    gen = torch.Generator().manual_seed(n)
    pos = (torch.rand(n, 3, generator=gen) * box_side(n, args.neighbours, RADIUS)).to(device)
    calls = methods(pos, args.dense_max)
    edges = {name: call() for name, call in calls.items()}  # warm-up
    best = {name: float("inf") for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            sync(device)
            start = time.perf_counter()
            call()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - start)
    method = memory_method(device)
    rows = []
    for name, call in calls.items():
        rows.append(
            {
                "method": name,
                "num_points": n,
                "num_edges": edges[name],
                "time_ms": 1e3 * best[name],
                "ratio_to_vesin": best[name] / best["vesin"] if "vesin" in best else None,
                "peak_mib": peak_mib(call, method, device),
                "sorted": name in ("e3attn", "e3attn[cells]", "dense"),
            }
        )
    return rows


def format_row(row: dict) -> str:
    ratio = f"{row['ratio_to_vesin']:8.2f}" if row["ratio_to_vesin"] is not None else "       -"
    memory = f"{row['peak_mib']:9.1f}" if row["peak_mib"] is not None else "        -"
    return (
        f"{row['num_points']:>8d}  {row['method']:<14s}{row['num_edges']:>10d}"
        f"{row['time_ms']:>11.2f}{ratio}{memory}  {'yes' if row['sorted'] else 'no'}"
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--neighbours", type=float, default=20.0, help="mean neighbours inside the cutoff")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per method (best is kept)")
    parser.add_argument("--dense-max", type=int, default=10_000, help="largest N for the dense baseline")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: unchanged)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "radius_graph.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = [200, 1_000], 2
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    meta = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "neighbours": args.neighbours,
        "repeats": args.repeats,
        "memory": memory_method(device),
    }
    print(f"radius graph, r = {RADIUS}, ~{args.neighbours:g} neighbours, {device}, {meta['torch_threads']} threads")
    print(f"{'N':>8s}  {'method':<14s}{'edges':>10s}{'time ms':>11s}{'/ vesin':>8s}{'peak MiB':>9s}  sorted")
    results = []
    for n in args.sizes:
        rows = run_size(n, args, device)
        for row in rows:
            print(format_row(row))
        if len({row["num_edges"] for row in rows}) != 1:
            raise RuntimeError(f"methods disagree on the number of edges at N={n}: {rows}")
        results += rows
    report = {"meta": meta, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
