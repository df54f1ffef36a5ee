r"""Radius graphs, open and periodic: e3attn against vesin (and torch_cluster, a dense ``cdist``).

Three systems of :math:`N` points, each with about ``--neighbours`` neighbours inside the
cutoff :math:`r`:

* ``open``: uniform points in a cube, :math:`r = 1`, no periodicity:
  :math:`\frac{N}{L^3} \cdot \frac{4}{3}\pi r^3 = \text{neighbours}`;
* ``fcc``: a periodic fcc copper crystal (:math:`a = 3.61` Å, cubic supercell of
  :math:`4 n^3 \approx N` atoms), :math:`r = 5` Å (42 neighbours, whatever ``--neighbours``);
* ``triclinic``: uniform random points in a periodic triclinic cell, :math:`r = 3` Å.

Every method builds the full directed graph (both ``i -> j`` and ``j -> i``, with the image
shifts for periodic systems) and all must agree on the number of edges:

* ``e3attn``: :func:`e3attn.graph.radius_graph` / :func:`~e3attn.graph.radius_graph_pbc`,
  output sorted by destination, source and shift (vesin on CPU; torch_cluster, when
  installed, on other devices);
* ``e3attn[cells]``: ``radius_graph`` forced onto its plain-PyTorch cell list, the path of
  GPUs without torch_cluster (open system only);
* ``vesin``: ``vesin.NeighborList(full_list=True)``, unsorted pairs (and shifts), the
  object reused between calls as in a simulation: vesin's own time, the baseline of the
  ratios; CPU only;
* ``vesin[sorted]``: the same with vesin's own ``sorted=True`` (pairs sorted by their first
  point only);
* ``torch_cluster``: ``torch_cluster.radius_graph`` with a neighbour cap well above the
  densest node (its default of 32 would truncate), open system only;
* ``dense``: all pair distances with ``torch.cdist``, thresholded, open system up to
  ``--dense-max`` points (:math:`N^2` memory).

Each thread count of ``--threads`` is measured in turn: :func:`torch.set_num_threads` and
vesin's ``n_threads``. The methods take turns for ``--repeats`` rounds after one warm-up call
(so slow drifts of a shared machine hit all of them alike) and the median of the rounds is
reported, as wall-clock time and as the CPU time of the process (all its threads; the
steadier measure on a loaded machine, equal to the wall-clock time of one unhindered
thread). Peak memory is measured by one more call (see :func:`dense_vs_sparse.peak_mib`).

Usage::

    python benchmarks/radius_graph.py                   # 1e3, 1e4, 1e5 points, 1 and 2 threads
    python benchmarks/radius_graph.py --sizes 10000 100000 --threads 1 2 --repeats 15
    python benchmarks/radius_graph.py --quick           # tiny sizes, a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
from dense_vs_sparse import box_side, memory_method, peak_mib, sync  # noqa: E402

from e3attn.graph import radius_graph, radius_graph_pbc  # noqa: E402
from e3attn.graph.radius import _radius_graph  # noqa: E402

SYSTEMS = ("open", "fcc", "triclinic")
FCC_A, FCC_RADIUS, TRICLINIC_RADIUS = 3.61, 5.0, 3.0
# the triclinic cell's shape (rows = lattice vectors), scaled to the wanted volume
TRICLINIC_SHAPE = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.95, 0.0], [-0.15, 0.2, 1.05]], dtype=torch.float64)

Call = Callable[[], int]


def system(name: str, n: int, neighbours: float) -> Tuple[torch.Tensor, Optional[torch.Tensor], float]:
    """``(pos, cell or None, r)`` of about ``n`` points of the system ``name`` (float64 for periodic ones)."""
    gen = torch.Generator().manual_seed(n)
    if name == "open":
        return torch.rand(n, 3, generator=gen) * box_side(n, neighbours, 1.0), None, 1.0
    if name == "fcc":
        reps = max(1, round((n / 4) ** (1 / 3)))
        basis = torch.tensor([[0.0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=torch.float64)
        grid = torch.stack(torch.meshgrid(*[torch.arange(reps, dtype=torch.float64)] * 3, indexing="ij"), -1)
        pos = (grid.reshape(-1, 1, 3) + basis).reshape(-1, 3) * FCC_A
        return pos, torch.eye(3, dtype=torch.float64) * (reps * FCC_A), FCC_RADIUS
    volume = n * 4.0 / 3.0 * np.pi * TRICLINIC_RADIUS**3 / neighbours
    cell = TRICLINIC_SHAPE * (volume / float(torch.linalg.det(TRICLINIC_SHAPE))) ** (1 / 3)
    return torch.rand(n, 3, generator=gen, dtype=torch.float64) @ cell, cell, TRICLINIC_RADIUS


def vesin_calls(pos: torch.Tensor, cell: Optional[torch.Tensor], r: float, threads: int) -> Dict[str, Call]:
    """vesin's full list, unsorted and sorted, on float64 NumPy inputs prepared outside the timed call."""
    try:
        import vesin
    except ImportError:
        return {}
    points = pos.double().numpy()
    box = np.zeros((3, 3)) if cell is None else cell.double().numpy()
    quantities = "ij" if cell is None else "ijS"
    out = {}
    for name, ordered in (("vesin", False), ("vesin[sorted]", True)):
        search = vesin.NeighborList(cutoff=r, full_list=True, sorted=ordered, n_threads=threads)
        out[name] = lambda search=search: len(search.compute(points, box, cell is not None, quantities, copy=False)[0])
    return out


def methods(name: str, pos: torch.Tensor, cell: Optional[torch.Tensor], r: float, dense_max: int, threads: int):
    """The available methods on this system, each a call returning its number of edges."""
    if cell is not None:
        out: Dict[str, Call] = {"e3attn": lambda: radius_graph_pbc(pos, cell, True, r)[0].shape[1]}
        if pos.device.type == "cpu":
            out.update(vesin_calls(pos, cell, r, threads))
        return out
    out = {
        "e3attn": lambda: radius_graph(pos, r).shape[1],
        "e3attn[cells]": lambda: _radius_graph(pos, r, None, False, None, "cells").shape[1],
    }
    if pos.device.type == "cpu":
        out.update(vesin_calls(pos, None, r, threads))
    try:
        import torch_cluster
    except ImportError:
        pass
    else:
        out["torch_cluster"] = lambda: torch_cluster.radius_graph(pos, r, max_num_neighbors=256).shape[1]
    if pos.shape[0] <= dense_max:

        def dense() -> int:
            near = torch.cdist(pos, pos, compute_mode="donot_use_mm_for_euclid_dist") < r
            near.fill_diagonal_(False)
            return near.nonzero().shape[0]

        out["dense"] = dense
    return out


def run_case(name: str, n: int, threads: int, args: argparse.Namespace, device: torch.device) -> List[dict]:
    """Median wall-clock and CPU times and peak memory of every method on one system."""
    torch.set_num_threads(threads)
    pos, cell, r = system(name, n, args.neighbours)
    pos, cell = pos.to(device), (None if cell is None else cell.to(device))
    calls = methods(name, pos, cell, r, args.dense_max, threads)
    edges = {method: call() for method, call in calls.items()}  # warm-up
    wall: Dict[str, List[float]] = {method: [] for method in calls}
    cpu: Dict[str, List[float]] = {method: [] for method in calls}
    for _ in range(args.repeats):
        for method, call in calls.items():
            sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            sync(device)
            wall[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
    wall_ms = {method: 1e3 * statistics.median(times) for method, times in wall.items()}
    cpu_ms = {method: 1e3 * statistics.median(times) for method, times in cpu.items()}
    memory = memory_method(device)
    rows = []
    for method, call in calls.items():
        rows.append(
            {
                "system": name,
                "num_points": pos.shape[0],
                "threads": threads,
                "method": method,
                "num_edges": edges[method],
                "wall_ms": wall_ms[method],
                "cpu_ms": cpu_ms[method],
                "wall_ratio_to_vesin": wall_ms[method] / wall_ms["vesin"] if "vesin" in wall_ms else None,
                "cpu_ratio_to_vesin": cpu_ms[method] / cpu_ms["vesin"] if "vesin" in cpu_ms else None,
                "peak_mib": peak_mib(call, memory, device),
                "sorted": method in ("e3attn", "e3attn[cells]", "dense") or method == "vesin[sorted]",
            }
        )
    if len({row["num_edges"] for row in rows}) != 1:
        raise RuntimeError(f"methods disagree on the number of edges for {name} at N={pos.shape[0]}: {rows}")
    return rows


def format_row(row: dict) -> str:
    def ratio(value: Optional[float]) -> str:
        return f"{value:7.2f}" if value is not None else "      -"

    memory = f"{row['peak_mib']:9.1f}" if row["peak_mib"] is not None else "        -"
    return (
        f"{row['system']:<10s}{row['num_points']:>8d}{row['threads']:>4d}  {row['method']:<14s}{row['num_edges']:>10d}"
        f"{row['wall_ms']:>10.2f}{ratio(row['wall_ratio_to_vesin'])}{row['cpu_ms']:>10.2f}"
        f"{ratio(row['cpu_ratio_to_vesin'])}{memory}"
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = opt.ArgumentParser(__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=opt.positive_int, nargs="+", default=[1_000, 10_000, 100_000], help="numbers of points")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to measure")
    parser.add_argument("--threads", type=opt.positive_int, nargs="+", default=[1, 2], help="thread counts, measured in turn")
    parser.add_argument("--neighbours", type=opt.positive_float, default=20.0, help="mean neighbours inside the cutoff")
    parser.add_argument("--repeats", type=opt.positive_int, default=9, help="timed rounds (the median is reported)")
    parser.add_argument("--dense-max", type=int, default=10_000, help="largest N for the dense baseline")
    parser.add_argument("--device", type=opt.device, default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "radius_graph.json",
                        help="JSON report")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 thread and 2 rounds: a smoke test")
    args = parser.parse_args(argv)
    opt.check_files(parser, results={"--out": args.out})
    if args.quick:
        args.sizes, args.threads, args.repeats = [200, 1_000], [1], 2
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    threads_before = torch.get_num_threads()
    meta = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "neighbours": args.neighbours,
        "repeats": args.repeats,
        "memory": memory_method(device),
    }
    print(f"radius graphs, ~{args.neighbours:g} neighbours, {device}, medians of {args.repeats} rounds")
    print(
        f"{'system':<10s}{'N':>8s}{'thr':>4s}  {'method':<14s}{'edges':>10s}{'wall ms':>10s}{'/vesin':>7s}"
        f"{'cpu ms':>10s}{'/vesin':>7s}{'peak MiB':>9s}"
    )
    results = []
    try:
        for threads in args.threads:
            for name in args.systems:
                for n in args.sizes:
                    rows = run_case(name, n, threads, args, device)
                    for row in rows:
                        print(format_row(row), flush=True)
                    results += rows
    finally:
        torch.set_num_threads(threads_before)
    report = {"meta": meta, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out, "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
