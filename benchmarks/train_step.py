r"""Training speed: the time of one force-training step of the training command's model, and of one energy + forces
call of the same model with frozen weights (as the calculator calls it), today and with one part as it was before
(``--baseline``):

* ``geometry`` (the default): the edge geometry computed by every layer for itself instead of once for all the
  blocks (``e3attn.edge_geometry.shared_edge_geometry``);
* ``moments``: the angular densities' moments in PyTorch operations on every edge's terms instead of on their
  kernel (``e3attn.kernels.moments_ops``);
* ``adam``: PyTorch's Adam with its loop over the parameters instead of fused (``e3attn.train.adam``);
* ``checks``: the node kernels' arguments checked again in every call that their backward formulas make, instead
  of once, in the forward (``e3attn.kernels.segment_ops``).

The model is that of ``e3attn-train`` with its defaults (``--`` passes other model options, e.g. ``-- --heads 4``);
the batches hold ``--batch-size`` copies of an ASE molecule (``--molecule``, default ethanol) with random
displacements of 0.1 Å and random labels (the time does not depend on them). A step is what
``e3attn.train.fit`` does per batch: energies and forces with ``create_graph``, the loss, its backward and an
Adam step. The two settings run in turns, ``--steps`` steps at a time, ``--repeats`` times; the table gives the
medians of the per-step times and their ratio (before over today: the speed-up).

Example::

    python benchmarks/train_step.py --threads 1
    python benchmarks/train_step.py --threads 1 --molecule CH3COOH -- --layers 3
    python benchmarks/train_step.py --threads 1 --baseline moments
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
from typing import Dict, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without installing
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from dense_vs_sparse import cpu_name  # noqa: E402

import e3attn.models.transformer as transformer  # noqa: E402
from e3attn.models import energy_and_forces  # noqa: E402
from e3attn.train import cli, collate, to_sample  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
from e3attn.train.data import mean_neighbors  # noqa: E402
from e3attn.kernels import segment_ops  # noqa: E402
from e3attn.models.density import NeighbourDensity  # noqa: E402
from e3attn.train.loop import adam  # noqa: E402
from e3attn.train.model import build_model, check_model_options, loss_fn, predict  # noqa: E402

LOSS = dict(force_weight=cli.TRAINING_DEFAULTS["force_weight"], loss=cli.TRAINING_DEFAULTS["loss"])
"""The loss of the training command (its force weight and the Huber loss)."""
BASELINES = {"geometry": ("per-layer", "shared"), "moments": ("plain moments", "moments kernel"),
             "adam": ("Adam loop", "fused Adam"), "checks": ("checked in backward", "checked in forward")}
"""The two settings that each ``--baseline`` compares: before, today."""


class _NeverTrusted:
    """In place of ``segment_ops._TRUSTED``: a flag that the backward formulas set in vain."""

    def get(self) -> bool:
        return False

    def set(self, value: bool) -> None:
        return None

    def reset(self, token: None) -> None:
        return None


@contextlib.contextmanager
def setting(name: str):
    """The model as it is, or with the part that setting ``name`` names as it was before: every attention layer
    and density channel computing its own edge geometry, the moments in PyTorch operations, or the node kernels'
    backward formulas checking the arguments of every call. (The optimizer, ``"Adam loop"``, is chosen by the
    caller.)"""
    shared, moments, trusted = transformer.shared_edge_geometry, NeighbourDensity._moments, segment_ops._TRUSTED
    if name == "per-layer":
        transformer.shared_edge_geometry = lambda edge_vec, layers: [None] * len(layers)
    if name == "plain moments":
        NeighbourDensity._moments = NeighbourDensity._plain_moments
    if name == "checked in backward":
        segment_ops._TRUSTED = _NeverTrusted()
    try:
        yield
    finally:
        transformer.shared_edge_geometry, NeighbourDensity._moments, segment_ops._TRUSTED = shared, moments, trusted


def batches(name: str, batch_size: int, count: int, max_radius: float, seed: int = 0):
    """``count`` batches of ``batch_size`` displaced copies of the molecule ``name``, with random labels; the
    elements."""
    from ase.build import molecule
    from ase.calculators.singlepoint import SinglePointCalculator

    base = molecule(name)
    species = sorted(set(base.get_chemical_symbols()))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        samples = []
        for _ in range(batch_size):
            atoms = base.copy()
            atoms.positions += 0.1 * torch.randn(len(atoms), 3, generator=g, dtype=torch.float64).numpy()
            forces = torch.randn(len(atoms), 3, generator=g, dtype=torch.float64).numpy()
            atoms.calc = SinglePointCalculator(atoms, energy=float(torch.randn(1, generator=g)), forces=forces)
            samples.append(to_sample(atoms, species, max_radius))
        out.append(samples)
    return out, species


def parse_with_model(p: argparse.ArgumentParser, argv: List[str], model_argv: List[str]) -> argparse.Namespace:
    """``argv`` parsed by ``p`` (its ``--out`` and ``--molecule`` checked) with the training command's model options
    ``model_argv`` (what follows ``--``) as ``args.model``."""
    args = p.parse_args(argv)
    opt.check_files(p, results={"--out": args.out})
    from ase.build import molecule

    try:
        molecule(args.molecule)
    except KeyError:
        p.error(f"argument --molecule: {args.molecule!r} is not a molecule that ase.build.molecule knows "
                "(e.g. CH3CH2OH)")
    model = opt.ArgumentParser("the training command's model options")
    opt.add_model_options(model, avg_num_neighbors="auto", defaults=cli.MODEL_DEFAULTS)
    args.model = model.parse_args(model_argv)
    check_model_options(model, args.model, "the model options after --")
    return args


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    model_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = opt.ArgumentParser(__doc__.split("\n\n")[0])
    p.add_argument("--molecule", default="CH3CH2OH", help="an ASE molecule name (default CH3CH2OH, ethanol)")
    p.add_argument("--batch-size", type=opt.positive_int, default=cli.TRAINING_DEFAULTS["batch_size"])
    p.add_argument("--baseline", choices=sorted(BASELINES), default="geometry",
                   help="the part timed as it was before (default geometry: the edge geometry per layer)")
    p.add_argument("--threads", type=opt.positive_int, default=1)
    p.add_argument("--steps", type=opt.positive_int, default=10, help="steps per turn")
    p.add_argument("--repeats", type=opt.positive_int, default=5, help="turns of each setting")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 steps, 1 turn")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_step.json"))
    args = parse_with_model(p, argv, model_argv)
    if args.quick:
        args.steps, args.repeats = 2, 1
    return args


def _median_seconds(fn, items) -> float:
    times = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    groups, species = batches(args.molecule, args.batch_size, args.steps + 1, args.model.max_radius)
    if args.model.avg_num_neighbors == "auto":
        args.model.avg_num_neighbors = mean_neighbors([s for group in groups for s in group])
    model = build_model(args.model, len(species))
    units = {"species": species, "energy_references": [0.0] * len(species), "energy_scale": 1.0}
    optimizers = {"Adam loop": torch.optim.Adam(model.parameters(), lr=1e-3), None: adam(model, 1e-3)}
    data = [collate(group) for group in groups]
    frozen = build_model(args.model, len(species)).requires_grad_(False)
    frozen.load_state_dict(model.state_dict())

    def train_step(batch, name):
        optimizer = optimizers.get(name, optimizers[None])
        loss = loss_fn(predict(model, batch, units, create_graph=True), batch, units, **LOSS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def call(batch):
        attr = torch.nn.functional.one_hot(batch["species"], len(species)).to(batch["pos"].dtype)
        energy_and_forces(frozen, batch["pos"], batch=batch["batch"], node_attr=attr, edge_index=batch["edge_index"])

    settings = BASELINES[args.baseline]
    for name in settings:  # warm up: the kernels' compilation, the caches
        with setting(name):
            train_step(data[0], name)
            call(data[0])
    times: Dict[str, Dict[str, List[float]]] = {s: {"step": [], "call": []} for s in settings}
    for _ in range(args.repeats):
        for name in settings:
            with setting(name):
                times[name]["step"].append(_median_seconds(lambda batch: train_step(batch, name), data[1:]))
                times[name]["call"].append(_median_seconds(call, data[1:]))
    result = {s: {k: statistics.median(v) for k, v in times[s].items()} for s in settings}
    ratios = {k: statistics.median(a / b for a, b in zip(times[settings[0]][k], times[settings[1]][k]))
              for k in ("step", "call")}
    atoms, edges = int(data[1]["pos"].shape[0]), int(data[1]["edge_index"].shape[1])
    print(f"{args.molecule} x {args.batch_size} ({atoms} atoms, {edges} edges), {args.threads} thread(s), "
          f"{cpu_name()}, torch {torch.__version__}")
    print(f"| {args.baseline} | force-training step (ms) | energy + forces, frozen (ms) |")
    print("|---|---|---|")
    for s in settings:
        print(f"| {s} | {1e3 * result[s]['step']:.1f} | {1e3 * result[s]['call']:.2f} |")
    print(f"| speed-up ({settings[0]} / {settings[1]}, median of turns) | {ratios['step']:.2f}x | "
          f"{ratios['call']:.2f}x |")
    report = {"meta": {"machine": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                       "threads": args.threads, "molecule": args.molecule, "baseline": args.baseline, "batch_size": args.batch_size,
                       "atoms": atoms, "edges": edges, "steps": args.steps, "repeats": args.repeats,
                       "model": {k: v for k, v in vars(args.model).items()}},
              "seconds": times, "median_seconds": result, "speedup": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
