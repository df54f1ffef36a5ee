r"""The attention layer eager against ``torch.compile(layer, fullgraph=True, dynamic=True)``.

For each configuration of ``benchmarks/layer.py`` and number of nodes, the same layer runs eagerly
and compiled on the same radius graph (built once, passed explicitly). The compiled module is
compiled once (the time of the first forward and of the first forward+backward are reported as
``compile_fwd_s`` / ``compile_fwdbwd_s``) and reused for every size: ``dynamic=True`` keeps the
numbers of nodes and edges symbolic, and ``recompiles`` counts the extra compilations dynamo made
after the first size (expected 0). Compiled, the layer calls the same custom operators as in eager
mode (on the CPU ``e3attn::path_features``, ``e3attn::node_expand``, ``e3attn::node_outer`` and
their gradients), which the compiler calls as they are, while the code around them is compiled; the
input checks that need the data on the host are skipped.

Times are the best of ``--repeats`` calls (eager and compiled alternating); ``max_abs_diff`` is
the largest difference of the two outputs and ``max_grad_rel_diff`` that of the gradients with
respect to the positions, the features and the parameters, relative to the largest gradient.
``--quick`` runs the guide configuration on 12, 24 and 2,500 nodes, forward+backward only, which
compiles in about a minute.

Usage::

    python benchmarks/compile.py                      # guide configuration, 1e3 and 1e4 nodes
    python benchmarks/compile.py --quick              # tiny sizes, a smoke test
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn.train import options as opt  # noqa: E402
from dense_vs_sparse import sync  # noqa: E402
from layer import CONFIGS, RADIUS, cloud, setup, write  # noqa: E402

from e3attn.attention import EquivariantAttention  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _timed(call, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - start


def _recompiles() -> int:
    """Compilations dynamo has made so far (frames compiled)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].get(key, 0) for key in ("unique_graphs",)))


def _differences(layer, compiled, leaves, f, pos, edge_index) -> Dict[str, float]:
    """Largest differences of the outputs and of the gradients (positions, features, parameters, relative)."""
    outs, grads = [], []
    for model in (layer, compiled):
        out = model(f, pos, edge_index)
        grads.append(torch.autograd.grad(out.pow(2).sum(), leaves))
        outs.append(out.detach())
    scale = max([float(g.abs().max()) for g in grads[0] if g.numel()], default=1.0)
    return {
        "max_abs_diff": float((outs[0] - outs[1]).abs().max()) if outs[0].numel() else 0.0,
        "max_grad_rel_diff": max([float((a - b).abs().max()) for a, b in zip(*grads) if a.numel()], default=0.0)
        / max(scale, 1e-300),
    }


def run(args: argparse.Namespace, device: torch.device) -> List[dict]:
    """Rows for every (configuration, size)."""
    rows = []
    dtype = DTYPES[args.dtype]
    for config in args.configs:
        spec = CONFIGS[config]
        torch.manual_seed(args.seed)
        layer = EquivariantAttention(*spec["irreps"], RADIUS, lmax=spec["lmax"], num_heads=spec["num_heads"])
        layer = layer.to(device=device, dtype=dtype)
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        graphs_before = 0
        for i, n in enumerate(sorted(args.sizes)):
            gen = torch.Generator().manual_seed(args.seed + n)
            pos, edge_index = cloud(n, args.degree, gen, dtype)
            f = torch.randn(n, layer.irreps_input.dim, generator=gen, dtype=dtype)
            pos, f, edge_index = pos.to(device).requires_grad_(), f.to(device).requires_grad_(), edge_index.to(device)
            leaves = [f, pos, *layer.parameters()]

            def fwd(model):
                with torch.no_grad():
                    model(f, pos, edge_index)

            def fwdbwd(model):
                model(f, pos, edge_index).pow(2).sum().backward()
                for leaf in leaves:
                    leaf.grad = None

            calls = {"fwd": fwd, "fwdbwd": fwdbwd}
            row = {"config": config, "nodes": n, "edges": edge_index.shape[1]}
            first = {kind: _timed(lambda: calls[kind](compiled), device) for kind in args.passes}
            if i == 0:
                row.update({f"compile_{kind}_s": seconds for kind, seconds in first.items()})
                graphs_before = _recompiles()
            else:
                row["recompiles"] = _recompiles() - graphs_before
            row.update(_differences(layer, compiled, leaves, f, pos, edge_index))
            for kind in args.passes:
                samples: Dict[str, List[float]] = {"eager": [], "compiled": []}
                calls[kind](layer)
                for _ in range(args.repeats):
                    for name, model in (("eager", layer), ("compiled", compiled)):
                        samples[name].append(_timed(lambda: calls[kind](model), device))
                for name, times in samples.items():
                    row[f"{name}_{kind}_ms"] = 1e3 * min(times)
                    row[f"{name}_{kind}_median_ms"] = 1e3 * statistics.median(times)
                row[f"speedup_{kind}"] = row[f"eager_{kind}_ms"] / row[f"compiled_{kind}_ms"]
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = (f"{'config':>6} {'nodes':>6} {'edges':>8} {'eager fwd':>10} {'comp fwd':>9} {'eager f+b':>10} "
          f"{'comp f+b':>9} {'speed-up f+b':>12} {'out diff':>9} {'grad diff':>9}")


def format_row(row: dict) -> str:
    """One line of the printed table (times in ms; ``-`` for a pass not run)."""

    def num(key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-".rjust(len(format(0.0, fmt)))

    line = (f"{row['config']:>6} {row['nodes']:>6} {row['edges']:>8} {num('eager_fwd_ms', '10.1f')} "
            f"{num('compiled_fwd_ms', '9.1f')} {num('eager_fwdbwd_ms', '10.1f')} {num('compiled_fwdbwd_ms', '9.1f')} "
            f"{num('speedup_fwdbwd', '12.2f')} {row['max_abs_diff']:9.1e} {row['max_grad_rel_diff']:9.1e}")
    if "recompiles" in row:
        return line + f"  ({row['recompiles']} recompilations)"
    compile_times = ", ".join(f"{key[8:-2]} {value:.1f} s" for key, value in row.items() if key.startswith("compile_"))
    return line + f"  (first calls, compiling: {compile_times})"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line options (see ``--help``)."""
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--device", type=opt.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["guide"])
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--sizes", type=opt.positive_int, nargs="+", default=[1_000, 10_000], help="numbers of nodes")
    p.add_argument("--degree", type=opt.positive_float, default=14.0, help="mean number of edges per node")
    p.add_argument("--repeats", type=opt.positive_int, default=5)
    p.add_argument("--passes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"],
                   help="forward under no_grad (compiled separately) and/or forward+backward")
    p.add_argument("--threads", type=opt.positive_int, default=None, help="torch CPU threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat: a smoke test")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile.json")
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    if args.quick:
        # 2,500 nodes: more than 32,766 edges, where a sort lowered by inductor would recompile
        args.configs, args.sizes, args.repeats, args.passes = ["guide"], [12, 24, 2_500], 1, ["fwdbwd"]
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run, print the table, write the JSON."""
    args = parse_args(argv)
    device, meta = setup(args)
    meta.update(dtype=args.dtype, compile="torch.compile(layer, fullgraph=True, dynamic=True)",
                configs={name: CONFIGS[name] for name in args.configs})
    print(HEADER)
    report = {"meta": meta, "results": run(args, device)}
    write(report, args.out)
    return report


if __name__ == "__main__":
    main()
