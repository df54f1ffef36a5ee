r"""Energies and forces of metal clusters and crystals, labelled offline with ASE's EMT calculator.

The data are made here, nothing is downloaded: 13-atom icosahedra, cuboctahedra and
decahedra and 8-atom periodic fcc cells of Cu, Ni and Au (mixed: a quarter of the atoms
swapped for another element), randomly strained and rattled, labelled with ASE's
effective-medium-theory calculator (``ase.calculators.emt.EMT``). The model is an
:class:`e3attn.models.EquivariantTransformer` with one-hot elements as node attributes
and one energy per structure; forces are :math:`-\partial E / \partial x` by autograd
(:func:`e3attn.models.energy_and_forces`), crystals use the periodic graph of
:func:`e3attn.radius_graph_pbc`. Energies are fitted relative to a least-squares
reference energy per element and in units of the RMS force component (``--energy-scale``).

The checkpoint (``--save``) holds the model and what turns its output into eV: the element
order (``species``), the reference energy of each element (``energy_references``) and the
scale (``energy_scale``), the format :meth:`e3attn.calculator.E3AttnCalculator.from_checkpoint`
reads. Prediction (``--predict``) goes through that ASE calculator, as any ASE user would.

The defaults are the most accurate model found for a 5-minute run on one CPU thread
(docs/guide/accuracy.rst): one attention block with a 32-channel neighbour density next to
the attention, Bessel radial basis, lmax 1, force weight 3, cosine schedule over a
210-second training budget (``--time-budget 0 --epochs N`` trains a fixed number of epochs).

Train (prints the held-out energy and force MAE, saves a parity plot and a checkpoint):

    python examples/molecules.py [--epochs 30] [--device cuda] [--amp] [--save model.pt] [--out parity.png]

Several processes (DistributedDataParallel; nccl on GPUs, gloo on CPUs):

    torchrun --nproc_per_node 2 examples/molecules.py --ddp

Predict with a checkpoint (new EMT-labelled structures, or any file ASE reads):

    python examples/molecules.py --predict model.pt [--structures file.xyz]
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from e3attn import train as training
from e3attn.models import EquivariantTransformer, save_checkpoint
from e3attn.train import collate, evaluate, fit, init_distributed, predict  # noqa: F401  (used by the docs, tests)
from e3attn.train.options import add_model_options, add_training_options, amp_only_on_cuda, check_compile

import _common  # examples/_common.py: the script's folder is on sys.path

SPECIES = ("Cu", "Ni", "Au")


# ------------------------------------------------------------------ data


def make_structures(num: int, seed: int):
    """``num`` EMT-labelled structures (``ase.Atoms`` with energy and forces), reproducible from ``seed``."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.cluster import Decahedron, Icosahedron, Octahedron

    rng = np.random.default_rng(seed)
    templates = [
        lambda s: Icosahedron(s, 2),
        lambda s: Octahedron(s, 3, 1),
        lambda s: Decahedron(s, 2, 2, 0),
        lambda s: bulk(s, "fcc", cubic=True).repeat((2, 1, 1)),
    ]
    structures = []
    for _ in range(num):
        host = SPECIES[rng.integers(len(SPECIES))]
        atoms = templates[rng.integers(len(templates))](host)
        symbols = atoms.get_chemical_symbols()
        for i in np.flatnonzero(rng.random(len(atoms)) < 0.25):
            symbols[i] = SPECIES[rng.integers(len(SPECIES))]
        atoms.set_chemical_symbols(symbols)
        atoms.set_cell(atoms.cell * rng.uniform(0.96, 1.04), scale_atoms=True)
        atoms.positions += rng.normal(0.0, 0.12, atoms.positions.shape)
        atoms.calc = EMT()
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
        structures.append(atoms)
    return structures


def to_sample(atoms, max_radius: float, labelled: bool = True) -> dict:
    """Tensors of one structure of :data:`SPECIES`, with its (periodic) graph (:func:`e3attn.train.to_sample`)."""
    return training.to_sample(atoms, SPECIES, max_radius, training.LabelKeys() if labelled else None)


def fit_references(samples, energy_scale: str = "force_rms") -> dict:
    """Reference energies of :data:`SPECIES` and the energy scale (:func:`e3attn.train.fit_references`)."""
    return training.fit_references(samples, SPECIES, energy_scale)


# ------------------------------------------------------------------ model


def build_model(args) -> EquivariantTransformer:
    """One energy per structure from one-hot elements (and ones) on the atoms."""
    return training.build_model(args, len(SPECIES))


def plot_parity(result: dict, path) -> None:
    plt = _common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    panels = [
        ("energy", "energy per atom (eV)", result["energy_mae_meV_per_atom"], "meV/atom"),
        ("forces", "force component (eV/Å)", result["force_mae_meV_per_A"], "meV/Å"),
    ]
    for ax, (key, label, mae, unit) in zip(axes, panels):
        true, pred = result[f"true_{key}"].numpy(), result[f"pred_{key}"].numpy()
        lo, hi = min(true.min(), pred.min()), max(true.max(), pred.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.scatter(true, pred, s=6, alpha=0.6)
        ax.set_xlabel(f"EMT {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(f"held-out MAE {mae:.1f} {unit}")
    fig.suptitle("e3attn on EMT-labelled Cu/Ni/Au clusters and crystals")
    fig.tight_layout()
    _common.save_figure(fig, path)
    plt.close(fig)


def parse_args(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--train", type=_common.positive_int, default=240, help="training structures")
    p.add_argument("--test", type=_common.positive_int, default=60, help="held-out structures")
    add_training_options(p, epochs=100, time_budget=210.0)
    add_model_options(p, avg_num_neighbors=10.0)
    p.add_argument("--save", default=None, help="write a checkpoint here after training")
    p.add_argument("--predict", default=None, metavar="CHECKPOINT", help="load a checkpoint and predict")
    p.add_argument("--structures", default=None, help="with --predict: a file ASE reads (default: new EMT data)")
    args = p.parse_args(argv)
    if args.smoke:
        args.train, args.test, args.epochs = min(args.train, 8), min(args.test, 4), min(args.epochs, 2)
        args.batch_size = min(args.batch_size, 4)
    if args.predict is not None:
        if args.save is not None:
            p.error("argument --save: --predict loads a checkpoint and trains nothing, so there is nothing to save")
        _common.check_files(p, inputs={"--predict": args.predict, "--structures": args.structures})
    else:
        if args.structures is not None:
            p.error("argument --structures: it names the structures that --predict predicts; give --predict too")
        _common.check_files(p, outputs={"--save": args.save},
                            figures={"--out": _common.figure_name(args.out, "parity.png")})
        training.check_model_options(p, args)  # before any data
    check_compile(p, args)
    return amp_only_on_cuda(args)


# ------------------------------------------------------------------ training and prediction


def train(args):
    """Train on EMT data; returns ``(model, metrics)`` (the model unwrapped from DDP)."""
    rank, world, device = init_distributed(args)
    torch.manual_seed(args.seed)
    train_set = [to_sample(a, args.max_radius) for a in make_structures(args.train, args.seed)]
    test_set = [to_sample(a, args.max_radius) for a in make_structures(args.test, args.seed + 10_000)]
    units = fit_references(train_set, args.energy_scale)

    model = build_model(args).to(device)
    module = model
    if args.ddp:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    losses, _, train_time, _ = fit(model, train_set, units, args, device, rank, world)
    del model  # a DDP wrapper holds the process group: it goes before the group's teardown below, never after

    result = evaluate(module, test_set, units, device, args.amp)
    metrics = {
        "energy_mae_meV_per_atom": result["energy_mae_meV_per_atom"],
        "force_mae_meV_per_A": result["force_mae_meV_per_A"],
        "train_losses": losses,
        "epochs": len(losses),
        "train_seconds": train_time,
        "num_train": len(train_set),
        "num_test": len(test_set),
        "world_size": world,
        "units": units,  # species, energy_references, energy_scale: what the checkpoint and the calculator need
    }
    if rank == 0:
        path = _common.figure_path(args.out, "parity.png")
        plot_parity(result, path)
        metrics["figure"] = str(path)
        if args.save:
            save_checkpoint(module, args.save, **units, metrics={k: metrics[k] for k in
                                                                 ("energy_mae_meV_per_atom", "force_mae_meV_per_A")})
        print(f"trained {len(losses)} epochs in {train_time:.0f} s ({train_time / max(len(losses), 1):.1f} s/epoch)")
        print(f"held-out ({len(test_set)} structures): energy MAE {metrics['energy_mae_meV_per_atom']:.1f} meV/atom, "
              f"force MAE {metrics['force_mae_meV_per_A']:.1f} meV/A; parity plot saved to {path}")
    if args.ddp:
        dist.barrier()  # rank 0's plot and checkpoint done: no rank tears the group down with work in flight
        dist.destroy_process_group()
    return module, metrics


def predict_main(args) -> dict:
    """Load ``args.predict`` as an ASE calculator, predict energies and forces, and compare with EMT's labels."""
    from e3attn.calculator import E3AttnCalculator

    try:
        calc = E3AttnCalculator.from_checkpoint(args.predict, device=args.device)
    except (OSError, ValueError) as err:
        _common.fail(f"--predict: {err}")
    if args.structures:
        from e3attn.train import DataError, read_structures

        try:
            structures = read_structures(args.structures, "--structures")
        except DataError as err:
            _common.fail(str(err))
    else:
        structures = make_structures(args.test, args.seed + 20_000)
    labelled = all(a.calc is not None for a in structures)
    energies, energy_errors, force_errors = [], [], []
    for atoms in structures:
        energy, forces = calc.get_potential_energy(atoms), calc.get_forces(atoms)
        energies.append(energy)
        print(f"{atoms.get_chemical_formula():>12s}  predicted energy {energy:10.4f} eV")
        if labelled:  # the labels stay on the structures' own (single-point) calculators
            energy_errors.append(abs(energy - atoms.get_potential_energy()) / len(atoms))
            force_errors.append(np.abs(forces - atoms.get_forces()).ravel())
    metrics = {"energies": energies}
    if labelled:
        metrics["energy_mae_meV_per_atom"] = 1000 * float(np.mean(energy_errors))
        metrics["force_mae_meV_per_A"] = 1000 * float(np.concatenate(force_errors).mean())
        print(f"against EMT: energy MAE {metrics['energy_mae_meV_per_atom']:.1f} meV/atom, "
              f"force MAE {metrics['force_mae_meV_per_A']:.1f} meV/A")
    return metrics


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.predict:
        return predict_main(args)
    return train(args)[1]


if __name__ == "__main__":
    main()
