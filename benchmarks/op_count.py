r"""Operations per step, by the module that caused them: what a GPU launches, counted on the CPU.

Where a step is bound by the host (small systems; the layer's guide rows on a GPU), its time follows the number
of operations it dispatches, each a kernel launch on a GPU, more than their size. This script counts them,
exactly and without a GPU, for three steps:

* ``train``: a force-training step of the training command's model (its defaults) on a batch of
  ``--batch-size`` ethanol molecules: energies and forces with ``create_graph``, the loss, its backward (what
  ``e3attn.train.fit`` does per batch, as ``benchmarks/train_step.py`` times it);
* ``md``: an energy + forces call of :class:`~e3attn.calculator.E3AttnCalculator` on fcc copper (the molecules
  example's model, ``--atoms`` atoms), between two searches of its neighbour list (as ``benchmarks/md_speed.py``
  times it);
* ``layer:CONFIG:NODES``: the force step of ``benchmarks/layer.py`` (``guide`` or ``large``).

Every ATen operation that is not a view (a view launches nothing) counts, and every Triton kernel launch. Each
is put down to the line of e3attn whose forward code caused it: directly, or through the autograd node that
runs it in a backward, followed back to the forward operation that recorded it (for the second derivatives of a
force step, through the first derivative's node; PyTorch's anomaly mode keeps those tracebacks). The totals are
split by phase: ``forward`` (for the energy, with the forces' first backward inside), ``loss`` and ``backward``
(the loss's, in a training step). Beside them, the memory the step keeps for its derivatives: the bytes of the
storages autograd saves (each counted once, saved inputs and parameters included), in the GPU's layout with the
variables above; it depends on the sizes, not on the machine.

The layer's own kernels count as one operation each. A dispatch mode records the operations, so e3attn calls
them through their registered operators rather than its eager shortcuts (the same kernels). With
``E3ATTN_KERNEL_BACKEND=triton`` (and ``E3ATTN_CUDA_KERNELS=1``) the CPU tensors take the GPU's code path, its
Triton kernels in Triton's interpreter: the count of a CUDA step. Under the dispatch mode the CPU's eager-only
kernels (the edge geometry and the softmax of :mod:`e3attn.kernels.geometry_ops` and
:mod:`e3attn.kernels.softmax_ops`) step aside for the plain formulation, so without that variable the counts
are those of the same code path with numba's node kernels: an upper bound of an eager CPU step.

Usage::

    python benchmarks/op_count.py                                  # train and md
    python benchmarks/op_count.py --cases layer:guide:60 --top 20
    E3ATTN_KERNEL_BACKEND=triton E3ATTN_CUDA_KERNELS=1 python benchmarks/op_count.py --cases layer:guide:60
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import traceback
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples", ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402

PACKAGE = str(ROOT / "e3attn")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_NO_LAUNCH = {"aten::detach", "aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
              "aten::empty_like", "aten::_local_scalar_dense", "aten::lift_fresh"}  # allocations and reads


def _site(frames: Sequence[traceback.FrameSummary]) -> str:
    """``module:function`` of the innermost frame in e3attn, but the forces' ``autograd.grad`` calls."""
    for frame in reversed(frames):
        if frame.filename.startswith(PACKAGE) and frame.name not in ("energy_and_forces", "_energy_and_gradients"):
            return f"{Path(frame.filename).relative_to(PACKAGE).with_suffix('')}:{frame.name}".replace("/", ".")
    return "(outside e3attn)"


def _recorded_by(node) -> str:
    """The forward site of an autograd node: through the nodes whose backward created it, to the first."""
    while "parent_" in node.metadata:
        node = node.metadata["parent_"]
    text = node.metadata.get("traceback_", "")
    text = "".join(text) if isinstance(text, list) else text
    return _site([traceback.FrameSummary(f, int(n), name) for f, n, name in _FRAME.findall(text)])


class OperationCounter(TorchDispatchMode):
    """Counts the non-view ATen operations (and, see :func:`count_triton`, Triton launches) by phase and site."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.by_site: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.by_phase: collections.Counter = collections.Counter()
        self.paused = False

    def record(self, name: str, site: str) -> None:
        self.by_site[site] += 1
        self.by_op[name] += 1
        self.by_phase[self.phase] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func._schema.name not in _NO_LAUNCH:
            node = torch._C._current_autograd_node()
            self.record(func._schema.name, _recorded_by(node) if node is not None
                        else _site(traceback.extract_stack()[:-1]))
        return func(*args, **(kwargs or {}))


def count_triton(counter: OperationCounter) -> Callable[[], None]:
    """Count every launch of a Triton kernel in the interpreter (its own tensor operations not); returns the undo."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return lambda: None
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counter.record(f"triton::{self.fn.__name__}", _site(traceback.extract_stack()[:-1]))
        counter.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused = False

    InterpretedFunction.run = counted
    return lambda: setattr(InterpretedFunction, "run", run)


def train_case(batch_size: int):
    """The force-training step of ``benchmarks/train_step.py`` (the command's defaults), phases marked."""
    import train_step
    from e3attn.train.data import mean_neighbors

    args = train_step.parse_args(["--batch-size", str(batch_size)])
    groups, species = train_step.batches(args.molecule, batch_size, 1, args.model.max_radius)
    args.model.avg_num_neighbors = mean_neighbors(groups[0])
    model = train_step.build_model(args.model, len(species))
    units = {"species": species, "energy_references": [0.0] * len(species), "energy_scale": 1.0}
    batch = train_step.collate(groups[0])

    def step(counter: Optional[OperationCounter]) -> None:
        prediction = train_step.predict(model, batch, units, create_graph=True)
        if counter is not None:
            counter.phase = "loss"
        loss = train_step.loss_fn(prediction, batch, units, **train_step.LOSS)
        if counter is not None:
            counter.phase = "backward"
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step, {"atoms": int(batch["pos"].shape[0]), "edges": int(batch["edge_index"].shape[1])}


def md_case(num_atoms: int):
    """An energy + forces call of the calculator on fcc copper, between searches of its neighbour list."""
    import md_speed
    import molecules
    from e3attn.calculator import E3AttnCalculator

    torch.manual_seed(0)
    model = molecules.build_model(molecules.parse_args([]))
    atoms = md_speed.fcc_copper(num_atoms)
    atoms.calc = E3AttnCalculator(model, list(molecules.SPECIES), device="cpu", dtype=torch.float32)
    trajectory = md_speed.Trajectory(atoms.positions.copy())
    frame = iter(range(1, 10**9))
    atoms.get_forces()  # the search

    def step(counter: Optional[OperationCounter]) -> None:
        atoms.positions = trajectory.frame(next(frame))
        atoms.get_forces()

    return step, {"atoms": num_atoms}


def layer_case(config: str, nodes: int):
    """The force step of ``benchmarks/layer.py``."""
    import layer

    models, f, pos, edge_index = layer.build(config, nodes, 14.0, torch.device("cpu"), seed=0)
    force = layer._calls(models["e3attn"], f, pos, edge_index)["force"]
    return (lambda counter: force()), {"nodes": nodes, "edges": int(edge_index.shape[1])}


def build_case(name: str, args: argparse.Namespace):
    if name == "train":
        return train_case(args.batch_size)
    if name == "md":
        return md_case(args.atoms)
    kind, _, rest = name.partition(":")
    config, _, nodes = rest.partition(":")
    if kind != "layer" or config not in ("guide", "large"):
        opt.fail(f"--cases: expected train, md or layer:guide|large[:NODES], got {name!r}", prog="op_count.py")
    return layer_case(config, int(nodes or 60))


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The bytes of the storages that autograd keeps for backward while it is active, each storage counted once
    (inputs and parameters that are saved included): what a step holds for its derivatives."""

    def __init__(self) -> None:
        self.storages: Dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = max(self.storages.get(storage.data_ptr(), 0), storage.nbytes())
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> "SavedBytes":
        super().__enter__()
        return self

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / 2**20


def count(step: Callable, warmup: int = 1) -> OperationCounter:
    """The operations of one call of ``step(counter)`` after ``warmup`` calls, and (``counter.saved``) the bytes it
    keeps for backward."""
    for _ in range(warmup):
        step(None)
    counter = OperationCounter()
    counter.saved = SavedBytes()
    undo = count_triton(counter)
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=False), counter, counter.saved:
            step(counter)
    finally:
        undo()
    return counter


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["train", "md"], help="train, md, layer:CONFIG[:NODES]")
    p.add_argument("--batch-size", type=opt.positive_int, default=8, help="molecules per training batch")
    p.add_argument("--atoms", type=opt.positive_int, default=108, help="atoms of the MD call (4 n^3)")
    p.add_argument("--top", type=int, default=15, help="sites listed per case")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "op_count.json"))
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, dict]:
    import warnings

    args = parse_args(argv)
    torch.set_num_threads(1)
    from e3attn.kernels.backends import cpu_backend

    report: Dict[str, dict] = {}
    for name in args.cases:
        step, sizes = build_case(name, args)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            counter = count(step)
        total = sum(counter.by_phase.values())
        report[name] = {"sizes": sizes, "total": total, "by_phase": dict(counter.by_phase),
                        "by_site": dict(counter.by_site.most_common()), "by_op": dict(counter.by_op.most_common()),
                        "backend": cpu_backend(), "saved_mib": counter.saved.mib}
        phases = ", ".join(f"{k} {v}" for k, v in counter.by_phase.items())
        print(f"{name} {sizes}: {total} operations ({phases}); kernels: {cpu_backend()}; "
              f"saved for backward {counter.saved.mib:.2f} MiB")
        for site, n in counter.by_site.most_common(args.top):
            print(f"  {n:6d}  {site}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(Path(args.out), "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
