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
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from e3attn.graph import radius_graph_pbc
from e3attn.models import EquivariantTransformer, energy_and_forces, save_checkpoint

import _common  # examples/_common.py: the script's folder is on sys.path

SPECIES = ("Cu", "Ni", "Au")
SCHEDULES = ("cosine", "plateau", "constant")
ENERGY_SCALES = ("force_rms", "energy_std")


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
    """Tensors of one structure, with its (periodic) graph."""
    dtype = torch.get_default_dtype()
    pos = torch.tensor(atoms.positions, dtype=dtype)
    cell = torch.tensor(atoms.cell.array, dtype=dtype)
    pbc = torch.tensor(atoms.pbc)
    edge_index, shifts = radius_graph_pbc(pos, cell, pbc, max_radius)
    unknown = sorted(set(atoms.get_chemical_symbols()) - set(SPECIES))
    if unknown:
        raise ValueError(f"structures may hold only the elements {SPECIES}, got {unknown}")
    sample = {
        "pos": pos,
        "species": torch.tensor([SPECIES.index(s) for s in atoms.get_chemical_symbols()]),
        "cell": cell,
        "edge_index": edge_index,
        "shifts": shifts,
    }
    if labelled:
        sample["energy"] = torch.tensor(atoms.get_potential_energy(), dtype=dtype)
        sample["forces"] = torch.tensor(atoms.get_forces(), dtype=dtype)
    return sample


def collate(samples) -> dict:
    """One batch: concatenated atoms, edges shifted by the atoms before them, one cell per structure."""
    sizes = torch.tensor([s["pos"].shape[0] for s in samples])
    offsets = torch.cumsum(sizes, 0) - sizes
    batch = {
        "pos": torch.cat([s["pos"] for s in samples]),
        "species": torch.cat([s["species"] for s in samples]),
        "batch": torch.arange(len(samples)).repeat_interleave(sizes),
        "cell": torch.stack([s["cell"] for s in samples]),
        "edge_index": torch.cat([s["edge_index"] + o for s, o in zip(samples, offsets)], dim=1),
        "shifts": torch.cat([s["shifts"] for s in samples]),
        "num_atoms": sizes,
    }
    if "energy" in samples[0]:
        batch["energy"] = torch.stack([s["energy"] for s in samples])
        batch["forces"] = torch.cat([s["forces"] for s in samples])
    return batch


def fit_references(samples, energy_scale: str = "force_rms") -> dict:
    """Least-squares energy per element and the scale of the model's output: the units the model learns in.

    ``energy_scale``: ``"force_rms"``, the RMS force component (eV/Angstrom, read as eV), or ``"energy_std"``,
    the standard deviation over the structures of the energy per atom left after the references (eV).
    """
    counts = torch.stack([torch.bincount(s["species"], minlength=len(SPECIES)) for s in samples]).double()
    energies = torch.stack([s["energy"] for s in samples]).double()
    refs = torch.linalg.lstsq(counts, energies[:, None]).solution[:, 0]
    if energy_scale == "force_rms":
        scale = torch.cat([s["forces"] for s in samples]).double().pow(2).mean().sqrt()
    elif energy_scale == "energy_std":
        scale = ((energies - counts @ refs) / counts.sum(1)).std(unbiased=False)
    else:
        raise ValueError(f"energy_scale: expected one of {ENERGY_SCALES}, got {energy_scale!r}")
    return {"species": list(SPECIES), "energy_references": refs.tolist(), "energy_scale": float(scale)}


# ------------------------------------------------------------------ model


def build_model(args) -> EquivariantTransformer:
    """One energy per structure from one-hot elements (and ones) on the atoms."""
    return EquivariantTransformer(
        "1x0e", args.hidden, "0e", args.max_radius, num_layers=args.layers, num_heads=args.heads, lmax=args.lmax,
        irreps_node_attr=f"{len(SPECIES)}x0e", reduce="sum", radial_neurons=args.radial_neurons,
        density_channels=args.density, avg_num_neighbors=args.avg_num_neighbors, layer_norm=args.layer_norm,
        basis=args.basis,
    )


def predict(model, batch: dict, units: dict, amp: bool = False, create_graph: bool = False):
    """Energies (eV) and forces (eV/Angstrom) of a batch (on the model's device)."""
    node_attr = torch.nn.functional.one_hot(batch["species"], len(SPECIES)).to(batch["pos"].dtype)
    with torch.autocast(batch["pos"].device.type, dtype=torch.bfloat16, enabled=amp):
        energy, forces = energy_and_forces(
            model, batch["pos"], batch=batch["batch"], node_attr=node_attr, edge_index=batch["edge_index"],
            shifts=batch["shifts"], cell=batch["cell"], create_graph=create_graph,
        )
    refs = torch.tensor(units["energy_references"], dtype=energy.dtype, device=energy.device)
    reference = torch.zeros_like(energy).index_add_(0, batch["batch"], refs[batch["species"]])
    scale = units["energy_scale"]
    return scale * energy.float() + reference, scale * forces.float()


def loss_fn(energy, forces, batch, units, force_weight, energy_weight=1.0):
    """Energy per atom and force components, both in units of the energy scale (``--energy-scale``)."""
    e = (energy - batch["energy"]) / batch["num_atoms"].to(energy.dtype) / units["energy_scale"]
    f = (forces - batch["forces"]) / units["energy_scale"]
    return energy_weight * e.pow(2).mean() + force_weight * f.pow(2).mean()


def evaluate(model, samples, units, device, amp=False, batch_size=16) -> dict:
    """Energy MAE per atom and force MAE (meV) on ``samples``, with the predictions."""
    model.eval()
    true_e, pred_e, true_f, pred_f = [], [], [], []
    for start in range(0, len(samples), batch_size):
        batch = to_device(collate(samples[start : start + batch_size]), device)
        energy, forces = predict(model, batch, units, amp)
        n = batch["num_atoms"].to(energy.dtype)
        true_e.append(batch["energy"] / n)
        pred_e.append(energy.detach() / n)
        true_f.append(batch["forces"].flatten())
        pred_f.append(forces.detach().flatten())
    out = {k: torch.cat(v).double().cpu() for k, v in
           {"true_energy": true_e, "pred_energy": pred_e, "true_forces": true_f, "pred_forces": pred_f}.items()}
    out["energy_mae_meV_per_atom"] = 1000 * (out["pred_energy"] - out["true_energy"]).abs().mean().item()
    out["force_mae_meV_per_A"] = 1000 * (out["pred_forces"] - out["true_forces"]).abs().mean().item()
    return out


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


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


# ------------------------------------------------------------------ processes and devices


def init_distributed(args):
    """``(rank, world_size, device)``; with ``--ddp``, joins the process group torchrun set up."""
    device = torch.device(args.device)
    if not args.ddp:
        return 0, 1, device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def synced_max(value: float, ddp: bool, device) -> float:
    """``value``, the largest over the processes with ``--ddp`` (so that every replica takes the same decisions)."""
    if not ddp:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def progress(args, epochs_done: float, seconds: float) -> float:
    """Fraction of the training done: of the epochs, or of the time budget when that runs out first."""
    done = epochs_done / args.epochs
    if args.time_budget:
        done = max(done, seconds / args.time_budget)
    return min(done, 1.0)


def parse_args(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--train", type=_common.positive_int, default=240, help="training structures")
    p.add_argument("--test", type=_common.positive_int, default=60, help="held-out structures")
    p.add_argument("--epochs", type=_common.positive_int, default=100, help="at most this many epochs")
    p.add_argument("--batch-size", type=_common.positive_int, default=8,
                   help="structures per batch (per process with --ddp)")
    p.add_argument("--time-budget", type=_common.non_negative_float, default=210.0, metavar="SECONDS",
                   help="stop training after this many seconds, 0 for no limit (the learning rate schedule "
                        "follows the time; the default keeps the whole run within 5 minutes on one CPU thread)")
    p.add_argument("--lr", type=_common.positive_float, default=1e-2, help="Adam learning rate")
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                   help="learning rate: cosine decay to 0 over the epochs (or the time budget), "
                        "halving on a plateau of the training loss, or constant")
    p.add_argument("--force-weight", type=_common.non_negative_float, default=3.0, help="weight of the force term")
    p.add_argument("--energy-weight", type=_common.non_negative_float, default=1.0,
                   help="weight of the energy-per-atom term")
    p.add_argument("--energy-scale", choices=ENERGY_SCALES, default="force_rms",
                   help="unit of the model's output energy: the RMS force component (times 1 Angstrom) or the "
                        "standard deviation of the energy per atom after the per-element references")
    p.add_argument("--max-radius", type=_common.positive_float, default=4.0, help="cutoff in Angstrom")
    p.add_argument("--hidden", type=_common.irreps, default="16x0e + 8x1o", help="hidden irreps")
    p.add_argument("--layers", type=_common.positive_int, default=1, help="attention blocks")
    p.add_argument("--heads", type=_common.positive_int, default=4,
                   help="attention heads (must divide every multiplicity of --hidden)")
    p.add_argument("--lmax", type=_common.non_negative_int, default=1, help="largest degree of the edge harmonics")
    p.add_argument("--radial-neurons", type=_common.positive_int, default=16, help="hidden size of the radial MLPs")
    p.add_argument("--basis", choices=("smooth_finite", "gaussian", "bessel"), default="bessel",
                   help="radial basis of the edge lengths")
    p.add_argument("--density", type=_common.non_negative_int, default=32, metavar="K",
                   help="neighbour-density channels per block (0: attention only)")
    p.add_argument("--avg-num-neighbors", type=_common.positive_float, default=10.0,
                   help="normalisation of the density sums")
    p.add_argument("--layer-norm", choices=("post", "pre", "none"), default="post",
                   help="equivariant layer norm after every block, on every block's input, or none")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast (CUDA only)")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel; launch with torchrun")
    p.add_argument("--save", default=None, help="write a checkpoint here after training")
    p.add_argument("--predict", default=None, metavar="CHECKPOINT", help="load a checkpoint and predict")
    p.add_argument("--structures", default=None, help="with --predict: a file ASE reads (default: new EMT data)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.smoke:
        args.train, args.test, args.epochs = min(args.train, 8), min(args.test, 4), min(args.epochs, 2)
        args.batch_size = min(args.batch_size, 4)
    if args.amp and not args.device.startswith("cuda"):
        warnings.warn("--amp needs a CUDA device: running in float32 on the CPU", stacklevel=2)
        args.amp = False
    return args


# ------------------------------------------------------------------ training and prediction


def fit(model, train_set, units, args, device, rank: int = 0, world: int = 1):
    """Train ``model`` (DDP-wrapped with ``--ddp``); returns the mean loss of every epoch and the seconds taken.

    Adam with the schedule of ``--schedule``; with ``--time-budget`` no epoch starts that would not end
    within it, and the cosine schedule follows the time.
    """
    from tqdm import tqdm

    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed) if args.ddp else None
    loader = DataLoader(train_set, args.batch_size, shuffle=sampler is None, sampler=sampler, collate_fn=collate,
                        generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3) \
        if args.schedule == "plateau" else None
    bar = tqdm(range(args.epochs), desc="training", disable=rank != 0 or args.quiet)
    losses = []
    start, epoch_time = time.perf_counter(), 0.0
    for epoch in bar:
        elapsed = synced_max(time.perf_counter() - start, args.ddp, device)
        if args.time_budget and epoch > 0 and elapsed + epoch_time > args.time_budget:
            break  # the next epoch would not finish within the budget
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        total = 0.0
        for step, batch in enumerate(loader):
            if args.schedule == "cosine":
                done = progress(args, epoch + step / len(loader), elapsed + step / len(loader) * epoch_time)
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * 0.5 * (1.0 + math.cos(math.pi * done))
            batch = to_device(batch, device)
            energy, forces = predict(model, batch, units, args.amp, create_graph=True)
            loss = loss_fn(energy, forces, batch, units, args.force_weight, args.energy_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        losses.append(total / len(loader))
        if plateau is not None:
            plateau.step(synced_max(losses[-1], args.ddp, device))
        epoch_time = synced_max(time.perf_counter() - start, args.ddp, device) - elapsed
        bar.set_postfix(loss=f"{losses[-1]:.3e}")
    return losses, time.perf_counter() - start


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
    losses, train_time = fit(model, train_set, units, args, device, rank, world)

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
        from ase.io import read

        structures = read(args.structures, index=":")
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
