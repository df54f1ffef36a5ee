r"""A force-training step compiled as one graph (``e3attn.train.compiled.CompiledStep``) against the eager step.

The model is that of ``e3attn-train`` with its defaults (``--`` passes other model options), the batches as in
``benchmarks/train_step.py`` (``--batch-size`` displaced copies of ``--molecule``, random labels, one shape). The
eager step is what ``e3attn.train.fit`` does per batch (energies and forces with ``create_graph``, the loss, its
backward); the compiled step computes the same loss and weight gradients in one traced and compiled graph. Both
end with the same fused Adam step. Reports the seconds of the first compiled call (tracing and compiling, with
torch's caches as they are: set ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`` for a cold compile), the largest
difference of the weight gradients relative to each weight's largest gradient, and the medians of the per-step
times, the two steps in turns, ``--steps`` at a time, ``--repeats`` times. ``--python-wrapper`` also times, in the
same turns, the graph compiled with inductor's default Python wrapper instead of the C++ wrapper that e3attn asks
for on the CPU (``e3attn._tracing.CPU_INDUCTOR_OPTIONS``); ``--one-unit`` the graph compiled with the C++ wrapper
and the kernels in one translation unit at ``-O3`` (e3attn compiles the wrapper apart, at ``-O1``);
``--wrapper-o0`` the wrapper compiled apart at ``-O0``; ``--inductor-index-add`` the graph whose
``index_add`` are left to inductor (e3attn makes them calls of ATen's, ``e3attn._tracing.index_adds_as_calls``);
``--unsorted`` the step whose graph sorts the batch's edges by destination, as every traced step did before
2026-11-30 (e3attn's takes the sorted edges of ``collate``'s batches as they are:
``e3attn._tracing.edges_sorted_by_caller``).
Each of them is compiled at its own first call, after the step's, and its seconds are reported too.
``--serial-builds`` compiles every graph with inductor's own builds, the C++ wrapper and then the kernels, where
e3attn compiles the two side by side (``e3attn._cpp_builds``): two runs with empty caches, one with it, compare
the first calls.

Example::

    python benchmarks/compiled_step.py --threads 1
    python benchmarks/compiled_step.py --threads 2 --dtype float64 --backend none   # the traced graph uncompiled
    python benchmarks/compiled_step.py --threads 2 --python-wrapper                 # C++ against Python wrapper
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compiled_step.py --threads 2 --one-unit  # cold compiles
    python benchmarks/compiled_step.py --threads 2 --frames benchmarks/data/organic/aspirin_train.xyz \
        --inductor-index-add --wrapper-o0      # batches of aspirin's frames (benchmarks/organic_data.py)
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/compiled_step.py --threads 2 --serial-builds
    python benchmarks/compiled_step.py --threads 1 --unsorted                       # the sort kept in the graph
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import e3attn._tracing  # noqa: E402
from dense_vs_sparse import cpu_name  # noqa: E402
from train_step import LOSS, batches, parse_with_model  # noqa: E402

from e3attn._tracing import cpu_inductor_options, index_adds_as_calls  # noqa: E402
from e3attn.train import cli, collate  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
from e3attn.train.compiled import CompiledStep  # noqa: E402
from e3attn.train.data import DataError, mean_neighbors, read_structures, to_sample  # noqa: E402
from e3attn.train.loop import adam  # noqa: E402
from e3attn.train.model import build_model, loss_fn, predict  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    model_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--molecule", default="CH3CH2OH", help="an ASE molecule name (default CH3CH2OH, ethanol)")
    p.add_argument("--frames", metavar="FILE",
                   help="batches of the first structures of FILE (any file ASE reads) instead of copies of --molecule")
    p.add_argument("--batch-size", type=opt.positive_int, default=cli.TRAINING_DEFAULTS["batch_size"])
    p.add_argument("--threads", type=opt.positive_int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--backend", default="inductor", help="torch.compile backend, or none (default inductor)")
    p.add_argument("--python-wrapper", action="store_true",
                   help="also time the step compiled by inductor with its Python wrapper (CPU, --backend inductor)")
    p.add_argument("--one-unit", action="store_true",
                   help="also time the step compiled with the C++ wrapper and the kernels in one translation unit "
                        "(CPU, --backend inductor)")
    p.add_argument("--wrapper-o0", action="store_true",
                   help="also time the step whose C++ wrapper is compiled at -O0 (CPU, --backend inductor)")
    p.add_argument("--inductor-index-add", action="store_true",
                   help="also time the step whose index_add are left to inductor (CPU, --backend inductor)")
    p.add_argument("--unsorted", action="store_true",
                   help="also time the step whose graph sorts the batch's edges (not taken as sorted)")
    p.add_argument("--serial-builds", action="store_true",
                   help="compile with inductor's own builds: the C++ wrapper, then the kernels (CPU)")
    p.add_argument("--steps", type=opt.positive_int, default=10, help="steps per turn")
    p.add_argument("--repeats", type=opt.positive_int, default=5, help="turns of each step")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_step.json"))
    args = parse_with_model(p, argv, model_argv)
    if args.frames and not Path(args.frames).is_file():
        p.error(f"argument --frames: no such file: {args.frames}")
    for name in ("python_wrapper", "one_unit", "wrapper_o0", "inductor_index_add", "serial_builds"):
        if getattr(args, name) and args.backend != "inductor":
            p.error(f"argument --{name.replace('_', '-')}: only with --backend inductor")
    return args


def frame_batches(path: str, batch_size: int, count: int, max_radius: float) -> Tuple[List[List[dict]], List[str]]:
    """``count`` batches of ``batch_size`` of the first structures of the file ``path``, with random labels (only
    their sizes matter here); the elements."""
    from ase.calculators.singlepoint import SinglePointCalculator

    try:
        structures = read_structures(path, "--frames")
    except DataError as err:
        raise SystemExit(str(err)) from None
    if len(structures) < batch_size * count:
        raise SystemExit(f"argument --frames: {path} has {len(structures)} structures, fewer than --batch-size "
                         f"times --steps ({batch_size * count})")
    species = sorted({symbol for atoms in structures for symbol in atoms.get_chemical_symbols()})
    g = torch.Generator().manual_seed(0)
    samples = []
    for atoms in structures[: batch_size * count]:
        atoms = atoms.copy()
        forces = torch.randn(len(atoms), 3, generator=g, dtype=torch.float64).numpy()
        atoms.calc = SinglePointCalculator(atoms, energy=float(torch.randn(1, generator=g)), forces=forces)
        samples.append(to_sample(atoms, species, max_radius))
    return [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)], species


def inductor_with(patches: dict, index_adds: bool = True) -> Callable:
    """Inductor with its configuration patched by ``patches`` (a ``torch.compile`` backend), the ``index_add`` of
    the graph made calls of ATen's first where ``index_adds``, as e3attn does on its traced graphs."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    unknown = sorted(set(patches) - set(config.get_config_copy()))
    if unknown:  # else the variant would fail to compile and be timed as traced
        raise SystemExit(f"this torch's inductor has no option {', '.join(unknown)}: the variant cannot be timed")

    def backend(graph: torch.fx.GraphModule, example_inputs: list):
        if index_adds:
            index_adds_as_calls(graph)
        return compile_fx(graph, example_inputs, config_patches=patches)

    return backend


def variants() -> dict:
    """The other compiled steps that the options time: name, the option's destination, inductor's configuration,
    whether the ``index_add`` become calls (:func:`inductor_with`)."""
    options = cpu_inductor_options()
    return {"python wrapper": ("python_wrapper", dict(cpp_wrapper=False), True),
            "one unit": ("one_unit", dict(cpp_wrapper=True, cpp_wrapper_build_separate=False), True),
            "wrapper -O0": ("wrapper_o0", {**options, "aot_inductor.compile_wrapper_opt_level": "O0"}, True),
            "inductor's index_add": ("inductor_index_add", options, False)}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        if args.frames:
            groups, species = frame_batches(args.frames, args.batch_size, args.steps, args.model.max_radius)
        else:
            groups, species = batches(args.molecule, args.batch_size, args.steps, args.model.max_radius)
        if args.model.avg_num_neighbors == "auto":
            args.model.avg_num_neighbors = mean_neighbors([s for group in groups for s in group])
        model = build_model(args.model, len(species))
        data = [collate(group) for group in groups]
    finally:
        torch.set_default_dtype(default)
    units = {"species": species, "energy_references": [0.0] * len(species), "energy_scale": 1.0}
    optimizer = adam(model, 1e-6)  # a small step: the weights, and so the times, barely change
    compiled = CompiledStep(model, units, LOSS, backend=None if args.backend == "none" else args.backend)
    others = {name: CompiledStep(model, units, LOSS, backend=inductor_with(patches, calls))
              for name, (option, patches, calls) in variants().items() if getattr(args, option)}
    if args.unsorted:
        others["edges sorted in the graph"] = CompiledStep(model, units, LOSS, backend=compiled.backend)
        others["edges sorted in the graph"]._sorted_edges = False

    def eager(batch):
        optimizer.zero_grad()
        loss = loss_fn(predict(model, batch, units, create_graph=True), batch, units, **LOSS)
        loss.backward()
        return loss.detach()

    def step(fn, batch):
        loss = fn(batch)
        optimizer.step()
        return loss

    first_calls = {}
    with contextlib.ExitStack() as stack:
        if args.serial_builds:  # e3attn's side-by-side builds left out
            stack.enter_context(mock.patch.object(e3attn._tracing, "objects_built_in_parallel", contextlib.nullcontext))
        for name, step_fn in {"compiled": compiled, **others}.items():
            start = time.perf_counter()
            step_fn(data[0])
            first_calls[name] = time.perf_counter() - start
    compile_seconds = first_calls["compiled"]
    differences = []
    for batch in data[:3]:
        compiled_loss = compiled(batch)
        compiled_grads = [p.grad.clone() for p in model.parameters()]
        eager_loss = eager(batch)
        differences.append(max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                               for a, b in zip(compiled_grads, (p.grad for p in model.parameters()))))
        differences.append(float((compiled_loss - eager_loss).abs() / eager_loss.abs()))
    steps = {"eager": eager, "compiled": compiled, **others}
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            for batch in data:
                step(fn, batch)
            times[name].append((time.perf_counter() - start) / len(data))
    medians = {k: statistics.median(v) for k, v in times.items()}
    speedup = statistics.median(a / b for a, b in zip(times["eager"], times["compiled"]))
    atoms, edges = int(data[0]["pos"].shape[0]), int(data[0]["edge_index"].shape[1])
    name = Path(args.frames).name if args.frames else args.molecule
    print(f"{name} x {args.batch_size} ({atoms} atoms, {edges} edges), {args.dtype}, {args.threads} "
          f"thread(s), {cpu_name()}, torch {torch.__version__}, backend {args.backend}")
    builds = "inductor's serial builds" if args.serial_builds else "wrapper and kernels built side by side"
    print(f"first compiled call (trace + compile, {builds}): {compile_seconds:.1f} s; largest relative difference "
          f"of the loss and weight gradients: {max(differences):.1e}")
    print(f"force-training step: eager {1e3 * medians['eager']:.1f} ms, compiled {1e3 * medians['compiled']:.1f} ms, "
          f"speed-up {speedup:.2f}x (median of turns)")
    for name in others:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["compiled"]))
        print(f"compiled, {name}: first call {first_calls[name]:.1f} s, step {1e3 * medians[name]:.1f} ms; "
              f"e3attn's compiled step {ratio:.2f}x as fast (median of turns)")
    report = {"meta": {"machine": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                       "threads": args.threads, "dtype": args.dtype, "backend": args.backend,
                       "molecule": args.molecule, "frames": args.frames, "batch_size": args.batch_size,
                       "atoms": atoms, "edges": edges,
                       "steps": args.steps, "repeats": args.repeats, "serial_builds": args.serial_builds,
                       "unsorted": args.unsorted,
                       "model": dict(vars(args.model))},
              "compile_seconds": compile_seconds, "first_call_seconds": first_calls,
              "largest_relative_difference": max(differences),
              "seconds": times, "median_seconds": medians, "speedup": speedup}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
