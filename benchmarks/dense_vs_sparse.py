r"""Dense versus sparse attention: time and peak memory as the number of nodes grows.

The same attention is evaluated in two representations:

* **dense** (transformer form): all :math:`N \times N` query-key pairs as
  matrices, the graph entering only as a mask;
* **sparse** (graph form): only the :math:`E` edges, with segment softmax and
  scatter sums.

for two mechanisms, *plain* dot-product attention
(:func:`e3attn.plain.dense_attention` / :func:`e3attn.plain.graph_attention`,
4 heads of size 16) and the *equivariant* layer
(``EquivariantAttention.dense`` / ``EquivariantAttention.__call__``), and two
densities: the **complete** graph (every pair is an edge, :math:`E = N^2`) and a
**radius** graph with about ``--neighbours`` neighbours per node (points
uniform in a cube whose side is chosen so that a ball of the cutoff radius holds
that many points on average; nodes near the faces have fewer).

Measured for every (mechanism, density, form, N):

* ``fwd_s``: wall time of a forward pass under ``torch.no_grad()``;
* ``fwdbwd_s``: wall time of a forward plus backward pass (gradients
  of ``out.sum()`` with respect to the inputs and the parameters);

  both the best of repeated calls (at least 3 unless they take 3 s, and at
  least ``--min-time`` seconds in all), after a warm-up call. On CUDA the
  clock is the wall clock (with synchronisation). On CPU it is, by default,
  the CPU time of the process (``time.process_time``): on a shared machine
  the wall time of a call grows with the load of other processes, its CPU time
  does not. With one thread (``--threads 1``) it is the wall time the call takes
  on an idle core; with several threads it is their sum. ``--clock wall``
  measures wall time instead;
* ``fwd_mb`` / ``fwdbwd_mb``: peak memory above the memory in use before the
  call, in MiB. On CUDA this is ``torch.cuda.max_memory_allocated`` (bytes held
  by tensors). On CPU (Linux) it is the peak resident set size: free heap
  memory is returned to the system (``malloc_trim``), the kernel's high-water
  mark is reset (``/proc/self/clear_refs``), the call runs, and ``VmHWM`` minus
  the resident size before the call is reported. It counts every page the call
  touched, including allocator overhead, so it is an honest upper estimate of
  what the tensors need; elsewhere memory is not measured.

For the plain mechanism the graph (edges, or the mask of the dense form) is
built once outside the timed region; the equivariant layer builds its own
radius graph (sparse) or all pair vectors (dense) inside the timed call.
Series are run in increasing :math:`N`; a size whose memory or time,
extrapolated from the previous size in proportion to the number of pairs
evaluated (:math:`N^2` dense, :math:`E` sparse), would exceed ``--max-gb`` or
``--max-seconds`` is skipped and recorded with the reason.

The crossover is the smallest measured :math:`N` from which the sparse form is
faster than the dense one at every larger measured :math:`N`, with a
log-log interpolation of the size where the two times are equal.

Usage::

    python benchmarks/dense_vs_sparse.py                 # full run, GPU when present
    python benchmarks/dense_vs_sparse.py --quick         # tiny sizes, a smoke test
    python benchmarks/dense_vs_sparse.py --device cpu --sizes 16 64 256 1024
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
from e3attn.graph import complete_graph, radius_graph  # noqa: E402
from e3attn.plain import dense_attention, graph_attention  # noqa: E402

KINDS = ("plain", "equivariant")
DENSITIES = ("complete", "radius")
FORMS = ("dense", "sparse")
PASSES = ("fwd", "fwdbwd")
PLAIN_HEADS, PLAIN_DIM = 4, 16
EQUIVARIANT_IRREPS = "16x0e + 8x1o"
EQUIVARIANT_LMAX = 2
EQUIVARIANT_HEADS = 4


@dataclass
class Case:
    """One form of one problem: ``run()`` evaluates it, ``leaves`` get gradients, ``pairs`` are evaluated."""

    run: Callable[[], torch.Tensor]
    leaves: List[torch.Tensor]
    pairs: int
    edges: int


# ----------------------------------------------------------------------------- problems


def box_side(n: int, neighbours: float, radius: float = 1.0) -> float:
    r"""Side :math:`L` of the cube holding ``n`` uniform points with ``neighbours`` inside a ball of ``radius``.

    .. math:: \frac{n}{L^3} \cdot \frac{4}{3}\pi r^3 = \text{neighbours}
    """
    return (n * 4.0 / 3.0 * math.pi * radius**3 / neighbours) ** (1.0 / 3.0)


def plain_cases(n: int, density: str, neighbours: float, device: torch.device, gen: torch.Generator) -> Dict[str, Case]:
    """Dense and sparse plain attention on the same queries, keys, values and graph."""
    q, k, v = (torch.randn(n, PLAIN_HEADS, PLAIN_DIM, generator=gen).to(device).requires_grad_() for _ in range(3))
    if density == "complete":
        edge_index, mask = complete_graph(n).to(device), None
    else:
        pos = torch.rand(n, 3, generator=gen) * box_side(n, neighbours)
        edge_index = radius_graph(pos, 1.0).to(device)
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)
        mask[edge_index[1], edge_index[0]] = True
    heads_first = [x.transpose(0, 1) for x in (q, k, v)]  # [H, N, d] views, built once
    edges = edge_index.shape[1]
    return {
        "dense": Case(lambda: dense_attention(*heads_first, mask=mask)[0], [q, k, v], n * n, edges),
        "sparse": Case(lambda: graph_attention(q, k, v, edge_index)[0], [q, k, v], edges, edges),
    }


def equivariant_cases(
    n: int, density: str, neighbours: float, device: torch.device, gen: torch.Generator
) -> Dict[str, Case]:
    """The equivariant layer evaluated densely (``layer.dense``) and sparsely (``layer(...)``)."""
    from e3attn.attention import EquivariantAttention

    side = box_side(n, neighbours)
    pos = (torch.rand(n, 3, generator=gen) * side).to(device)
    max_radius = 1.0 if density == "radius" else 1.05 * math.sqrt(3.0) * side  # complete: every pair in range
    irreps = EQUIVARIANT_IRREPS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        layer = EquivariantAttention(
            irreps, irreps, irreps, irreps, max_radius, lmax=EQUIVARIANT_LMAX, num_heads=EQUIVARIANT_HEADS
        ).to(device)
        f = layer.irreps_input.randn(n, -1).to(device).requires_grad_()
    leaves = [f, *layer.parameters()]
    edges = radius_graph(pos, max_radius).shape[1]
    return {
        "dense": Case(lambda: layer.dense(f, pos), leaves, n * n, edges),
        "sparse": Case(lambda: layer(f, pos), leaves, edges, edges),
    }


PROBLEMS = {"plain": plain_cases, "equivariant": equivariant_cases}


# ----------------------------------------------------------------------------- measurement


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) to finish its queued work, so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(case: Case, backward: bool) -> None:
    if backward:
        case.run().sum().backward()
        for leaf in case.leaves:
            leaf.grad = None
    else:
        with torch.no_grad():
            case.run()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def clock_name(device: torch.device, requested: str = "auto") -> str:
    """``"cpu"`` (process CPU time) on a CPU device, ``"wall"`` on CUDA, unless ``requested`` says otherwise."""
    if requested != "auto":
        return requested
    return "cpu" if device.type == "cpu" else "wall"


def _seconds(case: Case, backward: bool, device: torch.device, min_time: float, clock: str) -> float:
    """Best time of repeated calls: at least 3 calls (unless they take 3 s) and ``min_time`` seconds in all."""
    now = CLOCKS[clock]
    times: List[float] = []
    while not times or (len(times) < 3 and sum(times) < 3.0) or (sum(times) < min_time and len(times) < 50):
        sync(device)
        start = now()
        _step(case, backward)
        sync(device)
        times.append(now() - start)
    return min(times)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def memory_method(device: torch.device, requested: str = "auto") -> str:
    """``"cuda"``, ``"rss"`` (Linux CPU) or ``"none"``: how peak memory is measured on ``device``."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "cuda"
    return "rss" if Path("/proc/self/clear_refs").exists() and platform.system() == "Linux" else "none"


def peak_mib(fn: Callable[[], None], method: str, device: torch.device) -> Optional[float]:
    """Peak memory of ``fn()`` above the memory in use just before, in MiB (see the module docstring)."""
    if method == "none":
        fn()
        return None
    if method == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _proc_status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak resident set size to the current one
    fn()
    return max(_proc_status("VmHWM") - base, 0) / 2**20


def measure(case: Case, device: torch.device, method: str, min_time: float, clock: str) -> Dict[str, Optional[float]]:
    """Warm up, then peak memory and median time of the forward and the forward+backward pass."""
    _step(case, backward=True)
    result = {
        "fwd_mb": peak_mib(lambda: _step(case, False), method, device),
        "fwdbwd_mb": peak_mib(lambda: _step(case, True), method, device),
    }
    for name in PASSES:
        result[f"{name}_s"] = _seconds(case, name == "fwdbwd", device, min_time, clock)
    return result


def _too_big(previous: Optional[dict], pairs: int, max_gb: float, max_seconds: float) -> Optional[str]:
    """Reason to skip, extrapolating the previous size of the series linearly in the number of pairs."""
    if previous is None:
        return None
    scale = pairs / max(previous["pairs"], 1)
    memory = max(previous["fwdbwd_mb"] or 0.0, previous["fwd_mb"] or 0.0) * scale / 1024
    seconds = previous["fwdbwd_s"] * scale
    if memory > max_gb:
        return f"estimated {memory:.1f} GB > --max-gb {max_gb:g}"
    if seconds > max_seconds:
        return f"estimated {seconds:.0f} s per call > --max-seconds {max_seconds:g}"
    return None


def run_series(
    kind: str, density: str, sizes: Sequence[int], args: argparse.Namespace, device: torch.device
) -> List[dict]:
    """Both forms of one (mechanism, density) over the sizes, in increasing order."""
    rows: List[dict] = []
    previous: Dict[str, Optional[dict]] = {form: None for form in FORMS}
    method = memory_method(device, args.memory)
    for n in sorted(sizes):
        cases = PROBLEMS[kind](n, density, args.neighbours, device, torch.Generator().manual_seed(args.seed + n))
        for form, case in cases.items():
            row = {"kind": kind, "density": density, "form": form, "n": n, "pairs": case.pairs,
                   "edges": case.edges, "mean_degree": case.edges / n}
            row["skipped"] = _too_big(previous[form], case.pairs, args.max_gb, args.max_seconds)
            if row["skipped"] is None:
                try:
                    row.update(measure(case, device, method, args.min_time, clock_name(device, args.clock)))
                    previous[form] = row
                except (RuntimeError, MemoryError) as error:  # out of memory despite the estimate
                    row["skipped"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            rows.append(row)
            print(format_row(row), flush=True)
        del cases
    return rows


# ----------------------------------------------------------------------------- reporting


def format_row(row: dict) -> str:
    """One line of the table printed while the benchmark runs."""
    head = f"{row['kind']:>11} {row['density']:>8} {row['form']:>6} N={row['n']:>5} E={row['edges']:>9}"
    if row["skipped"]:
        return f"{head}  skipped ({row['skipped']})"
    mem = "" if row["fwdbwd_mb"] is None else f"  mem fwd {row['fwd_mb']:9.1f} MiB  fwd+bwd {row['fwdbwd_mb']:9.1f} MiB"
    return f"{head}  fwd {row['fwd_s'] * 1e3:10.2f} ms  fwd+bwd {row['fwdbwd_s'] * 1e3:10.2f} ms{mem}"


def crossover(rows: List[dict], kind: str, density: str, key: str) -> dict:
    r"""Where the sparse form becomes faster than the dense one.

    ``n``: smallest measured :math:`N` from which sparse is faster at every larger
    measured size (``None`` when dense wins at the largest common size);
    ``interpolated``: the :math:`N` where the log-log interpolated times are equal,
    between the last size where dense wins and ``n``.
    """
    times = {form: {r["n"]: r[key] for r in rows if (r["kind"], r["density"], r["form"]) == (kind, density, form)
                    and not r["skipped"]} for form in FORMS}
    common = sorted(set(times["dense"]) & set(times["sparse"]))
    ratio = {n: times["sparse"][n] / times["dense"][n] for n in common}
    first = None
    for n in reversed(common):
        if ratio[n] >= 1:
            break
        first = n
    result = {"n": first, "interpolated": None, "sizes": common}
    if first is not None and first != common[0]:
        n0 = common[common.index(first) - 1]  # dense faster (or equal) here
        a, b = math.log(ratio[n0]), math.log(ratio[first])  # a >= 0 > b
        result["interpolated"] = math.exp(math.log(n0) + a / (a - b) * (math.log(first) - math.log(n0)))
    return result


def describe_crossover(kind: str, density: str, key: str, c: dict) -> str:
    """A sentence for the crossover of one (mechanism, density, pass)."""
    what = f"{kind:>11} {density:>8} {'fwd+bwd' if key == 'fwdbwd_s' else 'fwd':>7}:"
    if not c["sizes"]:
        return f"{what} no size measured in both forms"
    if c["n"] is None:
        return f"{what} dense faster at the largest size measured in both forms (N = {c['sizes'][-1]}): no crossover"
    if c["interpolated"] is None:
        return f"{what} sparse faster from the smallest size measured (N = {c['n']})"
    return f"{what} sparse faster from N = {c['n']} (times equal near N = {c['interpolated']:.0f})"


def plot(rows: List[dict], path: Path, title: str, clock: str = "wall") -> None:
    """Time (fwd, fwd+bwd) and peak memory against N, one line per (form, density), one row per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    panels = [
        ("fwd_s", f"forward, {clock} time [s]"),
        ("fwdbwd_s", f"forward + backward, {clock} time [s]"),
        ("fwdbwd_mb", "peak memory, fwd+bwd [MiB]"),
    ]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(15, 4.2 * len(kinds)), squeeze=False)
    styles = {("dense", "complete"): "C0-o", ("sparse", "complete"): "C1-s",
              ("dense", "radius"): "C0--o", ("sparse", "radius"): "C1--s"}
    for axes_row, kind in zip(axes, kinds):
        for ax, (key, label) in zip(axes_row, panels):
            for (form, density), style in styles.items():
                pts = [(r["n"], r[key]) for r in rows if (r["kind"], r["form"], r["density"]) == (kind, form, density)
                       and not r["skipped"] and r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{form}, {density} graph", mfc="none")
            ax.set(xscale="log", yscale="log", xlabel="N (nodes)", ylabel=label, title=f"{kind} attention")
            ax.grid(True, which="both", alpha=0.3)
        axes_row[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` where there is one, else the platform's name for it."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--device", type=opt.device, default="cuda" if torch.cuda.is_available() else "cpu")
    sizes = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    p.add_argument("--sizes", type=opt.positive_int, nargs="+", default=sizes, help="numbers of nodes N")
    p.add_argument("--quick", action="store_true", help="tiny sizes (8, 16) and short timings: a smoke test")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--densities", nargs="+", choices=DENSITIES, default=list(DENSITIES))
    p.add_argument("--neighbours", type=opt.positive_float, default=16.0, help="mean neighbours of the radius graph")
    p.add_argument("--max-gb", type=float, default=4.0, help="skip sizes estimated to need more memory")
    p.add_argument("--max-seconds", type=float, default=10.0, help="skip sizes estimated to take longer per call")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of repeated calls per timing")
    p.add_argument("--memory", choices=("auto", "cuda", "rss", "none"), default="auto")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto", help="auto: cpu on CPU, wall on CUDA")
    p.add_argument("--threads", type=opt.positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dense_vs_sparse.json")
    p.add_argument("--fig", type=Path, default=ROOT / "benchmarks" / "results" / "dense_vs_sparse.png")
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out}, figures={"--fig": args.fig})
    if args.quick:
        args.sizes, args.min_time = [8, 16], min(args.min_time, 0.01)
    if min(args.sizes) < 1:
        p.error("--sizes must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the benchmark, write the JSON and the figure, print the table and the crossovers."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_type": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "dtype": str(torch.get_default_dtype()), "memory_method": memory_method(device, args.memory),
        "clock": clock_name(device, args.clock),
        "sizes": sorted(args.sizes), "neighbours": args.neighbours,
        "max_gb": args.max_gb, "max_seconds": args.max_seconds,
        "plain": {"heads": PLAIN_HEADS, "head_dim": PLAIN_DIM},
        "equivariant": {"irreps": EQUIVARIANT_IRREPS, "lmax": EQUIVARIANT_LMAX, "heads": EQUIVARIANT_HEADS},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    where = f"{meta['device']} ({device.type}, {meta['threads']} thread{'s' * (meta['threads'] > 1)})"
    print(f"device {where}, clock: {meta['clock']}, memory: {meta['memory_method']}")
    rows = [row for kind in args.kinds for density in args.densities
            for row in run_series(kind, density, args.sizes, args, device)]
    crossovers = {}
    print("\ncrossover (sparse faster than dense):")
    for kind in args.kinds:
        for density in args.densities:
            for key in ("fwd_s", "fwdbwd_s"):
                c = crossover(rows, kind, density, key)
                crossovers[f"{kind}/{density}/{key[:-2]}"] = c
                print("  " + describe_crossover(kind, density, key, c))
    report = {"meta": meta, "results": rows, "crossover": crossovers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out, "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=1)
    plot(rows, args.fig, f"dense vs sparse attention on {where}", meta["clock"])
    print(f"\nwrote {args.out} and {args.fig}")
    return report


if __name__ == "__main__":
    main()
