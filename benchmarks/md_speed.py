r"""MD speed: the time of one energy + forces call of ``E3AttnCalculator`` against the number of atoms.

Fcc copper (``--sizes``: numbers of atoms, each ``4 n^3``) with the default model of ``examples/molecules.py``
(untrained: the time does not depend on the weights), driven through ASE (``atoms.get_forces()``, as an MD
step calls it) along a thermal-like trajectory: every coordinate vibrates about its lattice site,

.. math:: x_{ik}(t) = x^0_{ik} + a_{ik} \sin(\omega_{ik} t + \phi_{ik}),

with :math:`a \sim N(0, 0.1\,\text{Å})`, periods of 105 to 195 fs and random phases, one frame per fs (copper
at 300 K vibrates about 0.1 Å and moves about 0.003 Å per fs). The calculator with the default skin and
with ``skin=0`` (a new neighbour search every call) run in turns, ``--calls`` steps at a time, ``--repeats``
times; the table gives the medians of the per-call times of these turns, the time per atom and call, the
atom-steps per second and the searches per call, and, over ``--calls`` more calls with the skin, the process's
minor page faults and system CPU time per call (memory that the allocator gave back to the system and a call
faulted in again: the calculator's ``keep_memory``, ``--keep-memory auto`` its default, ``on`` or ``off``) and the
process's peak resident memory so far. ``--stress`` asks
for the stress too at every step, as constant-pressure dynamics does (the calculator computes it from the first
request on). ``--mace`` adds MACE's calculator (32x0e + 32x1o, two
interactions, correlation 3, r_max 4, untrained) on the same frames, run by ``--mace-python`` (a Python with
``mace-torch``, which pins its own e3nn: see ``benchmarks/README.md``) in a subprocess.

Example::

    python benchmarks/md_speed.py --threads 1 --sizes 108 864 4000 16384
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples", ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn._files import atomic_write  # noqa: E402
import _common  # noqa: E402
import molecules  # noqa: E402
from dense_vs_sparse import CLOCKS, cpu_name, sync  # noqa: E402

from e3attn.calculator import DEFAULT_SKIN, E3AttnCalculator  # noqa: E402
from e3attn.graph import radius_graph_pbc  # noqa: E402

LATTICE = 3.61  # fcc copper, Angstrom
AMPLITUDE = 0.1  # Angstrom
PERIODS = (105.0, 195.0)  # fs
DTYPES = {"float32": torch.float32, "float64": torch.float64}
KEEP_MEMORY = {"auto": None, "on": True, "off": False}  # --keep-memory: the calculator's keep_memory
GRAPHS = {"auto": None, "on": True, "off": False}  # --cuda-graphs: the calculator's cuda_graphs


def fcc_copper(num_atoms: int):
    """The cubic fcc copper crystal of ``num_atoms = 4 n^3`` atoms, periodic."""
    from ase.build import bulk

    n = round((num_atoms / 4) ** (1 / 3))
    if 4 * n**3 != num_atoms:
        raise ValueError(f"sizes must be numbers of atoms 4 n^3 (32, 108, 256, 500, 864, ...), got {num_atoms}")
    return bulk("Cu", "fcc", a=LATTICE, cubic=True).repeat((n, n, n))


class Trajectory:
    """The thermal-like frames of the module docstring: ``frame(t)`` at ``t`` fs."""

    def __init__(self, positions: np.ndarray, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.sites = positions
        self.amplitude = AMPLITUDE * rng.normal(size=positions.shape)
        self.omega = 2 * math.pi / rng.uniform(*PERIODS, size=positions.shape)
        self.phase = rng.uniform(0, 2 * math.pi, size=positions.shape)

    def frame(self, t: int) -> np.ndarray:
        return self.sites + self.amplitude * np.sin(self.omega * t + self.phase)


def per_call_seconds(run_steps, repeats: int, calls: int, warmup: int, labels: Sequence[str],
                     clock: str = "wall") -> Dict[str, float]:
    """Median over ``repeats`` turns of the mean time of ``calls`` steps, the ``labels`` interleaved in every turn;
    ``run_steps(label, k)`` runs ``k`` steps; ``clock``: ``"wall"`` or ``"cpu"`` (this process's CPU time)."""
    now = CLOCKS[clock]
    for label in labels:
        run_steps(label, warmup)
    times: Dict[str, List[float]] = {label: [] for label in labels}
    for _ in range(repeats):
        for label in labels:
            start = now()
            run_steps(label, calls)
            times[label].append((now() - start) / calls)
    return {label: statistics.median(values) for label, values in times.items()}


def measure_e3attn(num_atoms: int, model: torch.nn.Module, args) -> dict:
    """The per-call times with and without a skin at ``num_atoms`` atoms, the edges and the searches per call."""
    crystal = fcc_copper(num_atoms)
    trajectory = Trajectory(crystal.positions)
    runs = {}
    calculators = [("skin", args.skin, False), ("no skin", 0.0, False)]
    calculators += [("compiled", args.skin, args.compile)] if args.compile else []
    for label, skin, compile in calculators:
        atoms = crystal.copy()
        atoms.calc = E3AttnCalculator(model, list(molecules.SPECIES), device=args.device, dtype=DTYPES[args.dtype],
                                      skin=skin, cuda_graphs=False if compile else GRAPHS[args.cuda_graphs],
                                      keep_memory=KEEP_MEMORY[args.keep_memory], compile=compile)
        runs[label] = {"atoms": atoms, "t": 0}

    def run_steps(label: str, k: int) -> None:
        run = runs[label]
        for _ in range(k):
            run["atoms"].positions[:] = trajectory.frame(run["t"])
            run["atoms"].get_forces()
            if args.stress:
                run["atoms"].get_stress()  # the same call from the second step on (the calculator's cache)
            run["t"] += 1
        sync(torch.device(args.device))

    first_call = None
    if args.compile:  # tracing and compiling, timed apart from the calls
        start = CLOCKS[args.clock]()
        run_steps("compiled", 1)
        first_call = CLOCKS[args.clock]() - start
    seconds = per_call_seconds(run_steps, args.repeats, args.calls, args.warmup, list(runs), args.clock)
    skin = runs["skin"]["atoms"].calc
    row = {
        "atoms": num_atoms,
        "edges": _edges(skin, runs["skin"]["atoms"]),
        "skin_s": seconds["skin"],
        "no_skin_s": seconds["no skin"],
        "searches_per_call": skin.neighbour_list.builds / runs["skin"]["t"],
        "replays_per_call": skin._replayed.replays / runs["skin"]["t"] if skin._replayed is not None else 0.0,
        "compiled_s": seconds.get("compiled"),
        "compile_first_call_s": first_call,
    }
    row["page_faults_per_call"], row["system_s_per_call"] = page_faults(lambda: run_steps("skin", args.calls),
                                                                        args.calls)
    row["peak_rss_mib"] = peak_rss_mib()
    return row


def _usage():
    """This process's ``resource.getrusage`` (None where there is no ``resource`` module: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF)


def page_faults(run, calls: int):
    """The process's minor page faults and system CPU seconds per call of ``run()`` (``calls`` calls): memory
    that the allocator gave back to the system and the next call faults in again (None, None where the platform
    does not count them)."""
    before = _usage()
    run()
    after = _usage()
    if before is None:
        return None, None
    return (after.ru_minflt - before.ru_minflt) / calls, (after.ru_stime - before.ru_stime) / calls


def peak_rss_mib() -> Optional[float]:
    """The process's largest resident memory so far, in MiB (Linux's ``ru_maxrss``, in KiB; None elsewhere): with
    the sizes in increasing order, that of the largest size so far."""
    usage = _usage()
    return usage.ru_maxrss / 1024 if usage is not None and sys.platform.startswith("linux") else None


def _edges(calc: E3AttnCalculator, atoms) -> int:
    """The edges within the cutoff at the atoms' current positions."""
    lattice = torch.as_tensor(atoms.cell.array, dtype=calc.dtype, device=calc.device)
    pos = torch.as_tensor(atoms.positions, dtype=calc.dtype, device=calc.device)
    return int(radius_graph_pbc(pos, lattice, torch.as_tensor(atoms.pbc), calc.max_radius)[0].shape[1])


# ------------------------------------------------------------------ MACE, in its own Python

MACE_SCRIPT = r'''
import json, statistics, sys, time
import numpy as np, torch
from ase import Atoms
torch.serialization.add_safe_globals([slice])  # e3nn 0.4.4 torch.loads its own constants, holding slices
from e3nn import o3
from mace import modules
from mace.calculators import MACECalculator

frames_path, out_path, device, threads, dtype = sys.argv[1:6]
calls, repeats, warmup = map(int, sys.argv[6:9])
now = time.process_time if sys.argv[9] == "cpu" else time.perf_counter
torch.set_num_threads(int(threads))
torch.set_default_dtype(getattr(torch, dtype))
block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
model = modules.ScaleShiftMACE(
    r_max=4.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=3, interaction_cls=block, interaction_cls_first=block,
    num_interactions=2, num_elements=3, hidden_irreps=o3.Irreps("32x0e + 32x1o"), MLP_irreps=o3.Irreps("16x0e"),
    atomic_energies=np.zeros(3), avg_num_neighbors=18.0, atomic_numbers=[28, 29, 79], correlation=3,
    gate=torch.nn.functional.silu, atomic_inter_scale=1.0, atomic_inter_shift=0.0,
)
calc = MACECalculator(models=model, device=device, default_dtype=dtype)
data, results = np.load(frames_path), []
for key in sorted((k for k in data.files if k.startswith("frames_")), key=lambda k: int(k[7:])):
    frames = data[key]
    atoms = Atoms(f"Cu{frames.shape[1]}", positions=frames[0], cell=data["cell_" + key[7:]], pbc=True)
    atoms.calc = calc
    for frame in frames[:warmup]:
        atoms.positions[:] = frame
        atoms.get_forces()
    times = []
    for r in range(repeats):
        start = now()
        for frame in frames[warmup + r * calls: warmup + (r + 1) * calls]:
            atoms.positions[:] = frame
            atoms.get_forces()
        times.append((now() - start) / calls)
    results.append({"atoms": frames.shape[1], "mace_s": statistics.median(times)})
json.dump(results, open(out_path, "w"))
'''


def measure_mace(sizes: Sequence[int], args) -> Dict[int, float]:
    """MACE's per-call seconds by number of atoms, from ``args.mace_python`` in a subprocess (empty on failure,
    with its error printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        frames, steps = {}, args.warmup + args.repeats * args.calls
        for n in sizes:
            crystal = fcc_copper(n)
            trajectory = Trajectory(crystal.positions)
            frames[f"frames_{n}"] = np.stack([trajectory.frame(t) for t in range(steps)])
            frames[f"cell_{n}"] = crystal.cell.array
        np.savez(Path(tmp) / "frames.npz", **frames)
        (Path(tmp) / "mace_speed.py").write_text(MACE_SCRIPT)
        out = Path(tmp) / "mace.json"
        command = [args.mace_python, str(Path(tmp) / "mace_speed.py"), str(Path(tmp) / "frames.npz"), str(out),
                   args.device, str(args.threads), args.dtype, str(args.calls), str(args.repeats), str(args.warmup), args.clock]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"MACE run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}", file=sys.stderr)
            return {}
        return {row["atoms"]: row["mace_s"] for row in json.loads(out.read_text())}


# ------------------------------------------------------------------ command line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = _common.ArgumentParser(__doc__)
    p.add_argument("--sizes", type=_common.positive_int, nargs="+", default=None,
                   help="numbers of atoms, each 4 n^3 (default 108 864 4000 16384; with --quick 32 108)")
    p.add_argument("--device", type=_common.device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=_common.positive_int, default=1, help="torch.set_num_threads")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the process's CPU time (less disturbed by other tenants of the CPU; "
                        "with 1 thread on the CPU only)")
    p.add_argument("--skin", type=_common.non_negative_float, default=DEFAULT_SKIN, help="the skin in Angstrom")
    p.add_argument("--cuda-graphs", nargs="?", choices=sorted(GRAPHS), const="on", default="auto",
                   help="the calculator's cuda_graphs (replaying its call as a CUDA graph between searches, on CUDA "
                        "with the skin): auto (its default, None), on (the bare option) or off")
    p.add_argument("--keep-memory", choices=sorted(KEEP_MEMORY), default="auto",
                   help="the calculator's keep_memory: auto (its default, None: from large calls on), on or off")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time the calculator with compile=BACKEND (default inductor) and the skin, in the same "
                        "turns, and its first call (tracing and compiling)")
    p.add_argument("--stress", action="store_true",
                   help="ask for the stress too at every step (as constant-pressure dynamics does)")
    p.add_argument("--calls", type=_common.positive_int, default=10, help="steps per timed turn")
    p.add_argument("--repeats", type=_common.positive_int, default=7, help="timed turns of each calculator")
    p.add_argument("--warmup", type=_common.positive_int, default=5, help="untimed steps first")
    p.add_argument("--mace", action="store_true", help="also time MACE's calculator (needs --mace-python)")
    p.add_argument("--mace-python", default=None, metavar="PATH", help="a Python with mace-torch installed")
    p.add_argument("--mace-max-atoms", type=_common.positive_int, default=4000, help="MACE only up to this size")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 turns of 2 steps")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "md_speed.json"), help="JSON report")
    args = p.parse_args(argv)
    _common.check_files(p, results={"--out": args.out})
    if args.quick:
        args.calls, args.repeats, args.warmup = 2, 2, 1
    if args.sizes is None:
        args.sizes = [32, 108] if args.quick else [108, 864, 4000, 16384]
    args.sizes = sorted(args.sizes)  # increasing: the peak memory so far is that of the size
    if args.clock == "cpu" and (args.threads > 1 or args.device != "cpu"):
        p.error("--clock cpu measures one thread on the CPU: use it with --threads 1 --device cpu")
    if args.cuda_graphs == "on" and not args.device.startswith("cuda"):
        p.error("--cuda-graphs on needs a CUDA --device")
    if args.mace and not args.mace_python:
        p.error("--mace needs --mace-python PATH (a Python with mace-torch, see benchmarks/README.md)")
    for n in args.sizes:
        try:
            fcc_copper(n)
        except ValueError as error:
            p.error(str(error))
    return args


def format_table(rows: List[dict]) -> str:
    lines = ["| atoms | edges | skin: ms/call | us/atom | atom-steps/s | searches/call | page faults/call | "
             "system ms/call | peak RSS MiB | no skin: ms/call | compiled: ms/call (first call s) | MACE: ms/call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mace = f"{r['mace_s'] * 1e3:,.1f}" if r.get("mace_s") else "-"
        faults = f"{r['page_faults_per_call']:,.0f}" if r.get("page_faults_per_call") is not None else "-"
        system = f"{r['system_s_per_call'] * 1e3:,.1f}" if r.get("system_s_per_call") is not None else "-"
        rss = f"{r['peak_rss_mib']:,.0f}" if r.get("peak_rss_mib") is not None else "-"
        compiled = (f"{r['compiled_s'] * 1e3:,.2f} ({r['compile_first_call_s']:.1f})" if r.get("compiled_s")
                    else "-")
        lines.append(f"| {r['atoms']:,} | {r['edges']:,} | {r['skin_s'] * 1e3:,.2f} | {r['skin_s'] * 1e6 / r['atoms']:.1f} "
                     f"| {r['atoms'] / r['skin_s']:,.0f} | {r['searches_per_call']:.2f} | {faults} | {system} "
                     f"| {rss} | {r['no_skin_s'] * 1e3:,.2f} | {compiled} | {mace} |")
    return "\n".join(lines)


def _load_average() -> Optional[float]:
    """The 1-minute load average of the host (None where the platform has none): other tenants of the CPU."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = molecules.build_model(molecules.parse_args([]))
    rows = [measure_e3attn(n, model, args) for n in args.sizes]
    if args.mace:
        mace = measure_mace([n for n in args.sizes if n <= args.mace_max_atoms], args)
        for row in rows:
            row["mace_s"] = mace.get(row["atoms"])
    meta = {"host": platform.node(), "cpu": cpu_name(), "device": args.device, "threads": args.threads,
            "dtype": args.dtype, "skin": args.skin, "cuda_graphs": args.cuda_graphs, "compile": args.compile,
            "keep_memory": args.keep_memory, "stress": args.stress, "clock": args.clock,
            "load_average": _load_average(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    report = {"meta": meta, "results": rows}
    graphs = f", cuda_graphs {args.cuda_graphs}" if args.device.startswith("cuda") else ""
    memory = f", keep_memory {args.keep_memory}" + (", with stress" if args.stress else "")
    print(f"{meta['cpu']} ({meta['host']}), {args.device}, {args.threads} thread(s), {args.dtype}, skin {args.skin} A"
          f"{graphs}{memory}, {args.clock} clock, load average {meta['load_average']}")
    print(format_table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(Path(args.out), "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
