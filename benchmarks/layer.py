r"""The attention layer against the e3nn guide's formulation: time, peak memory, edges per second.

Both compute the same layer on the same graph with the same number of weights:

* ``e3attn``: :class:`e3attn.attention.EquivariantAttention` (the radial networks' last layers contracted at
  the nodes, :mod:`e3attn.node_contraction`, on numba kernels on the CPU and, with ``--cuda-kernels``, on
  Triton kernels on CUDA; without it, on CUDA, the plain formulation);
* ``plain`` (with ``--plain``): the same layer with its tensor product as plain tensor operations;
* a peer (with ``--peer oeq``, CUDA): the baseline with its tensor products on OpenEquivariance (:mod:`peers`);
* ``baseline``: the e3nn guide's formulation (seed document 003), written in ``guide.py`` from e3nn's
  ``o3.Linear``, ``o3.FullyConnectedTensorProduct`` (``shared_weights=False``, keys and values
  separately), ``nn.FullyConnectedNet([basis, 16, weight_numel])`` per tensor product, the
  dot product ``o3.FullyConnectedTensorProduct(query, key, "0e")`` (one per head), the smooth
  cutoff, and a scatter softmax (``index_add``). Before timing, ``e3attn``'s weights are copied
  into it and the outputs compared (``max_rel_diff``: up to the 0.16 % difference between
  e3nn's Monte-Carlo normalisation constant of silu and e3attn's exact one).

Configurations: ``guide`` (irreps ``10x0e+5x1o`` in, ``11x0e+4x1o`` query, ``12x0e+3x1o`` key,
``14x0e+6x1o`` out, lmax 3, 1 head) and ``large`` (``64x0e+32x1o+16x2e`` for all four, lmax 2,
4 heads); both with 10 basis functions and 16 hidden neurons. Points are uniform in a cube whose
side is adjusted (:func:`cloud`) so that the radius graph of cutoff 1.0 has ``--degree`` edges
per node on average (faces included); the graph is built once, outside the timed calls.

Measured per (configuration, nodes, method):

* ``fwd_ms``: forward under ``torch.no_grad()``; ``fwdbwd_ms``: forward and backward of
  ``out.pow(2).sum()`` with respect to the parameters, the features and the positions (as in
  training on energies and forces' inputs). Best of ``--repeats`` calls after a warm-up call, the
  two methods taking turns; the median is in the JSON as well.
* ``fwd_mib`` / ``fwdbwd_mib``: peak memory of one call above the memory in use before it
  (``dense_vs_sparse.peak_mib``: on Linux CPU the peak resident set size, after returning free
  heap memory to the system and resetting the kernel's high-water mark; on CUDA
  ``max_memory_allocated``), measured after the timings. It counts every page touched, so it
  is an upper estimate.
* ``edges_per_s`` (forward+backward) and, for ``e3attn``, the ratios ``speedup`` (baseline time /
  e3attn time, forward+backward) and ``memory_ratio`` (e3attn peak / baseline peak).

Cases whose estimated baseline memory exceeds ``--max-gb`` are skipped for both methods (recorded
with the reason), as are those whose estimated time exceeds ``--max-seconds`` per call.

Usage::

    python benchmarks/layer.py                          # both configurations at 1e3 and 1e4 nodes
    python benchmarks/layer.py --device cpu --threads 1
    python benchmarks/layer.py --quick                  # tiny sizes, a smoke test
    python benchmarks/layer.py --forces --plain         # + force-training step, + e3attn without compiled kernels
    python benchmarks/layer.py --device cuda --forces --plain --cuda-kernels  # e3attn on the Triton kernels
    python benchmarks/layer.py --device cuda --forces --plain --cuda-kernels --peer oeq  # + guide on OpenEquivariance
    python benchmarks/layer.py --busy 1 --threads 2     # e3attn beside a busy process it starts and stops
    OMP_WAIT_POLICY=PASSIVE python benchmarks/layer.py --busy 1 --threads 2  # idle OpenMP threads sleep
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
from dense_vs_sparse import box_side, cpu_name, memory_method, peak_mib, sync  # noqa: E402
from guide import RADIUS, GuideAttention  # noqa: E402
from peers import PEERS, build_peer  # noqa: E402

from e3attn import kernels  # noqa: E402
from e3attn.attention import EquivariantAttention  # noqa: E402
from e3attn.graph import radius_graph  # noqa: E402

CONFIGS = {
    "guide": {"irreps": ("10x0e + 5x1o", "11x0e + 4x1o", "12x0e + 3x1o", "14x0e + 6x1o"), "lmax": 3, "num_heads": 1},
    "large": {"irreps": ("64x0e + 32x1o + 16x2e",) * 4, "lmax": 2, "num_heads": 4},
}
# default numbers of nodes and timed calls (the baseline needs ~0.8 ms per edge on the large configuration)
DEFAULTS = {"guide": {"sizes": [1_000, 10_000], "repeats": 7}, "large": {"sizes": [100, 1_000], "repeats": 3}}
METHODS = ("baseline", "e3attn")
PEER_TOLERANCE = 1e-3  # largest relative difference of a peer's output from the baseline's (same weights, float32)


# ----------------------------------------------------------------------------- measurement


class PlainFormulation(torch.nn.Module):
    """``layer`` with its tensor product as plain tensor operations (the compiled kernels switched off)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        previous = kernels.set_fused_kernels(False)  # autograd records the backward: no switch needed there
        try:
            return self.layer(*args)
        finally:
            kernels.set_fused_kernels(previous)


def _calls(model: torch.nn.Module, f: torch.Tensor, pos: torch.Tensor, edge_index: torch.Tensor):
    """Forward (no grad), forward+backward and force-training calls of ``model``."""
    leaves = [f, pos, *model.parameters()]

    def fwd() -> None:
        with torch.no_grad():
            model(f, pos, edge_index)

    def fwdbwd() -> None:
        model(f, pos, edge_index).pow(2).sum().backward()
        for leaf in leaves:
            leaf.grad = None

    def force() -> None:
        # energy E = sum of out^2 (invariant), forces -dE/dpos with create_graph, loss E^2 + |F|^2, backward
        energy = model(f, pos, edge_index).pow(2).sum()
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        (energy.pow(2) + forces.pow(2).sum()).backward()
        for leaf in leaves:
            leaf.grad = None

    return {"fwd": fwd, "fwdbwd": fwdbwd, "force": force}


def cloud(n: int, degree: float, gen: torch.Generator, dtype: torch.dtype = torch.float32):
    r"""``n`` uniform points in a cube and their radius graph (cutoff 1), ``degree`` edges per node on average.

    The side starts from :func:`dense_vs_sparse.box_side` (the bulk density) and is rescaled by
    :math:`(\bar d / d)^{1/3}` until the measured mean degree :math:`\bar d` is within 1 % (at most
    8 times: small clouds cannot reach every degree).
    """
    unit = torch.rand(n, 3, generator=gen, dtype=dtype)
    side = box_side(n, degree, RADIUS)
    for _ in range(8):
        edge_index = radius_graph(unit * side, RADIUS)
        measured = edge_index.shape[1] / max(n, 1)
        if measured == 0 or abs(measured / degree - 1) < 0.01:
            break
        side *= (measured / degree) ** (1 / 3)
    return unit * side, edge_index


def build(config: str, n: int, degree: float, device: torch.device, seed: int, peer: Optional[str] = None):
    """The models with the same weights (and the ``peer``, :mod:`peers`), the inputs and the graph of one case."""
    spec = CONFIGS[config]
    gen = torch.Generator().manual_seed(seed + n)
    torch.manual_seed(seed)
    layer = EquivariantAttention(*spec["irreps"], RADIUS, lmax=spec["lmax"], num_heads=spec["num_heads"])
    baseline = GuideAttention(*spec["irreps"], lmax=spec["lmax"], num_heads=spec["num_heads"])
    baseline.copy_from(layer)
    pos, edge_index = cloud(n, degree, gen)
    f = torch.randn(n, layer.irreps_input.dim, generator=gen)
    layer, baseline = layer.to(device), baseline.to(device)
    pos, f, edge_index = pos.to(device).requires_grad_(), f.to(device).requires_grad_(), edge_index.to(device)
    models = {"baseline": baseline, "e3attn": layer, "plain": PlainFormulation(layer)}
    if peer:
        models[peer] = build_peer(peer, baseline, device)
    return models, f, pos, edge_index


def weight_counts(models: Dict[str, torch.nn.Module]) -> Dict[str, int]:
    """Number of trainable weights of every model."""
    return {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}


def max_rel_diff(models: Dict[str, torch.nn.Module], f, pos, edge_index) -> float:
    """Largest difference of e3attn's output from the baseline's, relative to the largest output."""
    with torch.no_grad():
        a, b = (models[m](f, pos, edge_index) for m in ("e3attn", "baseline"))
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def run_case(config: str, n: int, args: argparse.Namespace, device: torch.device,
             previous: Optional[dict]) -> List[dict]:
    """Rows of both methods for one (configuration, number of nodes)."""
    methods = METHODS + (("plain",) if args.plain else ()) + ((args.peer,) if args.peer else ())
    models, f, pos, edge_index = build(config, n, args.degree, device, args.seed, args.peer)
    edges = edge_index.shape[1]
    base = {"config": config, "nodes": n, "edges": edges, "mean_degree": edges / n, "weights": weight_counts(models)}
    reason = _too_big(previous, edges, args)
    if reason:
        return [dict(base, method=m, skipped=reason) for m in methods]
    base["max_rel_diff"] = max_rel_diff(models, f, pos, edge_index)
    if args.peer:
        base["peer_rel_diff"] = max_rel_diff({"e3attn": models[args.peer], "baseline": models["baseline"]}, f, pos,
                                             edge_index)
        # the same function as the baseline's (float32 rounding), or its timings compare different layers
        print(f"{config:>6} {n:>6} {edges:>8} {args.peer:>8}  output vs the baseline's: {base['peer_rel_diff']:.1e}"
              + ("  DIFFERENT" if base["peer_rel_diff"] > PEER_TOLERANCE else ""), flush=True)
    calls = {m: _calls(models[m], f, pos, edge_index) for m in methods}
    method = memory_method(device, args.memory)
    rows = {m: dict(base, method=m, skipped=None) for m in methods}
    for kind in ("fwd", "fwdbwd") + (("force",) if args.forces else ()):
        samples: Dict[str, List[float]] = {m: [] for m in methods}
        for m in methods:
            calls[m][kind]()  # warm-up
        for _ in range(args.repeats or DEFAULTS[config]["repeats"]):
            for m in methods:
                sync(device)
                start = time.perf_counter()
                calls[m][kind]()
                sync(device)
                samples[m].append(time.perf_counter() - start)
        for m in methods:
            rows[m][f"{kind}_ms"] = 1e3 * min(samples[m])
            rows[m][f"{kind}_median_ms"] = 1e3 * statistics.median(samples[m])
    for m in methods:  # after the timings: measuring returns free memory to the system
        for kind in ("fwd", "fwdbwd"):
            rows[m][f"{kind}_mib"] = peak_mib(calls[m][kind], method, device)
        rows[m]["edges_per_s"] = edges / (rows[m]["fwdbwd_ms"] / 1e3)
    bl = rows["baseline"]
    for m in methods[1:]:
        row = rows[m]
        row["speedup"] = bl["fwdbwd_ms"] / row["fwdbwd_ms"]
        row["speedup_fwd"] = bl["fwd_ms"] / row["fwd_ms"]
        if args.forces:
            row["speedup_force"] = bl["force_ms"] / row["force_ms"]
        if row["fwdbwd_mib"] is not None and bl["fwdbwd_mib"]:
            row["memory_ratio"] = row["fwdbwd_mib"] / bl["fwdbwd_mib"]
    return [rows[m] for m in methods]


def _too_big(previous: Optional[dict], edges: int, args: argparse.Namespace) -> Optional[str]:
    """Reason to skip, extrapolating the baseline of the previous size linearly in the number of edges."""
    if previous is None or previous.get("skipped"):
        return None
    scale = edges / max(previous["edges"], 1)
    gigabytes = (previous.get("fwdbwd_mib") or 0.0) * scale / 1024
    seconds = previous["fwdbwd_ms"] / 1e3 * scale
    if gigabytes > args.max_gb:
        return f"baseline estimated at {gigabytes:.1f} GB > --max-gb {args.max_gb:g}"
    if seconds > args.max_seconds:
        return f"baseline estimated at {seconds:.0f} s per call > --max-seconds {args.max_seconds:g}"
    return None


# ----------------------------------------------------------------------------- on a busy machine

# a busy-loop process that ends by itself after the given number of seconds
_SPIN = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int, seconds: float):
    """``count`` processes each keeping one core busy, stopped on exit (and ending by themselves after
    ``seconds`` in any case)."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them start spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def busy_comparison(args: argparse.Namespace, device: torch.device) -> List[dict]:
    """e3attn's forward+backward quiet on 1 thread, quiet on ``--threads`` and beside ``--busy`` busy
    processes on ``--threads``, the three taking turns; per case the ratios to the quiet 1-thread time."""
    threads = args.threads or os.cpu_count() or 1
    rows = []
    for config in args.configs:
        for n in sorted(args.sizes or DEFAULTS[config]["sizes"]):
            models, f, pos, edge_index = build(config, n, args.degree, device, args.seed)
            call = _calls(models["e3attn"], f, pos, edge_index)["fwdbwd"]
            settings = {"quiet_1": (1, 0), f"quiet_{threads}": (threads, 0), f"busy_{threads}": (threads, args.busy)}
            samples: Dict[str, List[float]] = {name: [] for name in settings}
            for _ in range(args.repeats or DEFAULTS[config]["repeats"]):
                for name, (count, busy) in settings.items():
                    torch.set_num_threads(count)
                    with busy_processes(busy, args.max_seconds) if busy else contextlib.nullcontext():
                        call()  # warm-up (a changed thread count, the busy cores)
                        start = time.perf_counter()
                        call()
                        samples[name].append(time.perf_counter() - start)
            row = {"config": config, "nodes": n, "edges": edge_index.shape[1], "busy_processes": args.busy}
            row.update({f"{name}_ms": 1e3 * statistics.median(times) for name, times in samples.items()})
            quiet = row["quiet_1_ms"]
            row.update({f"{name}_vs_quiet_1": row[f"{name}_ms"] / quiet for name in settings if name != "quiet_1"})
            print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
            rows.append(row)
    torch.set_num_threads(threads)
    return rows


# ----------------------------------------------------------------------------- reporting


HEADER = (f"{'config':>6} {'nodes':>6} {'edges':>8} {'method':>8} {'fwd ms':>9} {'fwd+bwd ms':>11} "
          f"{'speed-up':>8} {'fwd MiB':>8} {'f+b MiB':>8} {'mem ratio':>9} {'Medges/s':>9} {'force ms':>9} "
          f"{'speed-up':>8}")


def format_row(row: dict) -> str:
    """One line of the printed table."""
    head = f"{row['config']:>6} {row['nodes']:>6} {row['edges']:>8} {row['method']:>8}"
    if row["skipped"]:
        return f"{head}  skipped ({row['skipped']})"

    def num(key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if value is not None else "-".rjust(len(format(0.0, fmt)))

    return (f"{head} {num('fwd_ms', '9.1f')} {num('fwdbwd_ms', '11.1f')} {num('speedup', '8.2f')} "
            f"{num('fwd_mib', '8.1f')} {num('fwdbwd_mib', '8.1f')} {num('memory_ratio', '9.2f')} "
            f"{row['edges_per_s'] / 1e6:9.3f} {num('force_ms', '9.1f')} {num('speedup_force', '8.2f')}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--device", type=opt.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--sizes", type=opt.positive_int, nargs="+", default=None, help="numbers of nodes (default: see DEFAULTS)")
    p.add_argument("--degree", type=opt.positive_float, default=14.0, help="mean number of edges per node")
    p.add_argument("--repeats", type=opt.positive_int, default=None, help="timed calls per method, best reported (default: DEFAULTS)")
    p.add_argument("--threads", type=opt.positive_int, default=None, help="torch CPU threads (default: one per core)")
    p.add_argument("--max-gb", type=float, default=8.0, help="skip cases whose baseline would need more memory")
    p.add_argument("--max-seconds", type=float, default=60.0, help="skip cases whose baseline would take longer")
    p.add_argument("--memory", choices=("auto", "cuda", "rss", "none"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke test")
    p.add_argument("--forces", action="store_true",
                   help="also time a force-training step (forces by create_graph, loss on energy and forces)")
    p.add_argument("--busy", type=int, default=0, metavar="K",
                   help="instead of the comparison with the baseline: e3attn quiet (1 and --threads threads) and "
                        "beside K busy processes that this script starts and stops (medians)")
    p.add_argument("--plain", action="store_true",
                   help="also time e3attn with its tensor product as plain tensor operations (no compiled kernels)")
    p.add_argument("--cuda-kernels", action="store_true",
                   help="e3attn on CUDA runs its Triton kernels (e3attn.kernels.set_cuda_kernels(True); by default "
                        "eager calls on CUDA take the plain formulation)")
    p.add_argument("--peer", choices=PEERS, default=None,
                   help="also time the guide's layer with its tensor products on a peer's kernels (benchmarks/peers.py)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "layer.json")
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    kernels.set_cuda_kernels(True if args.cuda_kernels else None)
    if args.quick:
        args.sizes, args.repeats = [16, 32], 1
    if min(args.sizes or [1]) < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--sizes and --repeats must be positive")
    if args.peer and torch.device(args.device).type != "cuda":
        p.error(f"--peer {args.peer} runs on CUDA only, got --device {args.device}")
    if args.busy < 0 or args.busy > (os.cpu_count() or 1):
        p.error(f"--busy must be between 0 and the number of cores ({os.cpu_count()})")
    return args


def setup(args: argparse.Namespace) -> Tuple[torch.device, dict]:
    """Set the threads; the device and the description of the machine and the run for the JSON."""
    device = torch.device(args.device)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_type": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "e3nn": __import__("e3nn").__version__, "python": platform.python_version(),
        "repeats": {name: args.repeats or DEFAULTS[name]["repeats"] for name in args.configs if name in DEFAULTS},
        "degree": args.degree, "timing": "best of repeats (methods alternating), median in *_median_ms",
        "configs": {name: CONFIGS[name] for name in args.configs if name in CONFIGS},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # PASSIVE: idle OpenMP threads sleep (busy machines)
    }
    print(f"device {meta['device']} ({device.type}, {meta['threads']} threads)")
    return device, meta


def write(report: dict, path: Path) -> None:
    """Write the JSON report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=1)
    print(f"wrote {path}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run every case, print the table, write the JSON."""
    args = parse_args(argv)
    device, meta = setup(args)
    meta.update(dtype="float32", memory_method=memory_method(device, args.memory), cuda_kernels=args.cuda_kernels, peer=args.peer)
    if args.busy:
        report = {"meta": meta, "busy": busy_comparison(args, device)}
        write(report, args.out)
        return report
    print(f"peak memory: {meta['memory_method']}")
    print(HEADER)
    rows: List[dict] = []
    for config in args.configs:
        previous = None
        for n in sorted(args.sizes or DEFAULTS[config]["sizes"]):
            case = run_case(config, n, args, device, previous)
            for row in case:
                print(format_row(row), flush=True)
            rows.extend(case)
            previous = case[0]
    report = {"meta": meta, "results": rows}
    write(report, args.out)
    return report


if __name__ == "__main__":
    main()
