"""Molecular dynamics with a trained e3attn potential: energy conservation in NVE, next to EMT.

A potential trained on EMT-labelled Cu/Ni/Au structures (examples/molecules.py: loaded from
--checkpoint, or trained here) drives ASE's velocity Verlet through e3attn.calculator.E3AttnCalculator
on a periodic fcc copper crystal (108 atoms: 3 x 3 x 3 cubic cells) from 300 K, for 1,000 steps of
1 fs, then for the same time with steps of 0.5 and 0.25 fs; ASE's EMT itself runs the same dynamics
from the same start. Velocity Verlet conserves the energy of a smooth potential with exact forces up
to an error of order dt^2, so halving the step quarters the deviation of the total energy: a jump as
atoms cross the cutoff, or forces that are not the gradient of the energy, would show as a deviation
that does not shrink so.

Prints the largest deviation of the total energy from its start, per atom, for every run, and plots
total, potential and kinetic energy against time (PNG):

    python examples/md.py [--checkpoint model.pt] [--steps 1000] [--dt 1 0.5 0.25] [--atoms 100]
                          [--temperature 300] [--out md.png] [--json md.json]

--checkpoint loads the file when it exists and otherwise trains (--epochs) and saves it there.
"""
import math
import os

import numpy as np
import torch

import _common  # examples/_common.py: the script's folder is on sys.path


def copper(min_atoms: int):
    """fcc Cu (a = 3.61 Å) in the smallest cube of 4-atom cubic cells with at least ``min_atoms`` atoms."""
    from ase.build import bulk

    repeat = max(1, math.ceil((min_atoms / 4) ** (1 / 3) - 1e-9))
    return bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)


def thermalize(atoms, temperature_K: float, seed: int) -> None:
    """Maxwell-Boltzmann momenta, p ~ N(0, m kB T) per component, without centre-of-mass motion."""
    from ase.units import kB

    masses = atoms.get_masses()[:, None]
    momenta = np.sqrt(masses * kB * temperature_K) * np.random.default_rng(seed).normal(size=(len(atoms), 3))
    atoms.set_momenta(momenta - masses * momenta.sum(0) / masses.sum())


def run_nve(atoms, calc, dt: float, steps: int, label: str, quiet: bool = False) -> dict:
    """Velocity Verlet from ``atoms`` (positions and momenta) with ``calc``; energies in eV at every step."""
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs
    from tqdm import tqdm

    atoms = atoms.copy()
    atoms.calc = calc
    record = {"time_fs": [], "potential": [], "kinetic": []}

    def observe():  # after every step, and before the first
        record["time_fs"].append(dynamics.get_time() / fs)
        record["potential"].append(atoms.get_potential_energy())
        record["kinetic"].append(atoms.get_kinetic_energy())
        bar.update(min(dynamics.nsteps, 1))

    dynamics = VelocityVerlet(atoms, timestep=dt * fs)
    dynamics.attach(observe)
    with tqdm(total=steps, desc=f"{label}, dt = {dt:g} fs", disable=quiet) as bar:
        dynamics.run(steps)
    out = {key: np.array(value) for key, value in record.items()}
    out["total"] = out["potential"] + out["kinetic"]
    return out


def deviation_meV_per_atom(run: dict, num_atoms: int) -> float:
    """max_t |E(t) - E(0)| / N of the total energy, in meV/atom."""
    return 1000 * float(np.abs(run["total"] - run["total"][0]).max()) / num_atoms


def parity_figure(out) -> "os.PathLike[str]":
    """Where the parity plot of the training goes: ``md_parity.png`` beside the figure."""
    return _common.figure_name(out, "md.png").with_name("md_parity.png")


def load_or_train(args):
    """The calculator of ``args.checkpoint`` when that file exists, else of a potential trained on EMT data."""
    from e3attn.calculator import E3AttnCalculator

    dtype = getattr(torch, args.dtype)
    if args.checkpoint and os.path.exists(args.checkpoint):
        try:
            return E3AttnCalculator.from_checkpoint(args.checkpoint, device=args.device, dtype=dtype)
        except (OSError, ValueError) as err:
            _common.fail(f"--checkpoint: {err}")
    import molecules

    options = ["--epochs", str(args.epochs), "--device", args.device, "--seed", str(args.seed),
               "--out", str(parity_figure(args.out))]
    options += ["--smoke"] * args.smoke + ["--quiet"] * args.quiet
    options += ["--save", args.checkpoint] if args.checkpoint else []
    model, metrics = molecules.train(molecules.parse_args(options))
    units = metrics["units"]
    return E3AttnCalculator(model, units["species"], energy_references=units["energy_references"],
                            energy_scale=units["energy_scale"], device=args.device, dtype=dtype)


def plot_energies(axes, runs: dict, num_atoms: int) -> None:
    """Left axes: total, potential and kinetic energy of the first run; right axes: the total energy of every run."""
    left, right = axes
    label, first = next(iter(runs.items()))
    start = first["total"][0]
    for key, color, shift in [("total", "k", start), ("potential", "C0", start), ("kinetic", "C3", 0.0)]:
        name = key if shift == 0.0 else f"{key} $- E_{{tot}}(0)$"
        left.plot(first["time_fs"], 1000 * (first[key] - shift) / num_atoms, color=color, lw=1, label=name)
    left.set_xlabel("time (fs)")
    left.set_ylabel("energy per atom (meV)")
    left.set_title(label)
    left.legend(fontsize=8, ncol=3, loc="upper center")
    left.margins(y=0.3)
    for label, run in runs.items():
        right.plot(run["time_fs"], 1000 * (run["total"] - run["total"][0]) / num_atoms, lw=1,
                   label=f"{label}: {deviation_meV_per_atom(run, num_atoms):.3f} meV/atom")
    right.set_xlabel("time (fs)")
    right.set_ylabel("$E_{tot}(t) - E_{tot}(0)$ per atom (meV)")
    right.set_title("total energy (legend: largest deviation)")
    right.legend(fontsize=8)


def parse_args(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--checkpoint", default=None,
                   help="potential of examples/molecules.py --save: loaded when the file exists, else trained and saved")
    p.add_argument("--epochs", type=_common.positive_int, default=30, help="training epochs when there is no checkpoint")
    p.add_argument("--atoms", type=_common.positive_int, default=100, help="at least this many atoms (a cube of 4-atom fcc cells)")
    p.add_argument("--temperature", type=_common.non_negative_float, default=300.0, help="initial temperature (K)")
    p.add_argument("--steps", type=_common.positive_int, default=1000, help="steps of the first --dt; every run covers the same time")
    p.add_argument("--dt", type=_common.positive_float, nargs="+", default=[1.0, 0.5, 0.25], help="time steps of the model's runs (fs)")
    p.add_argument("--emt-dt", type=_common.positive_float, nargs="*", default=None,
                   help="time steps of EMT's runs (fs; default: the first --dt; none: no EMT)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the model's dtype in MD")
    p.add_argument("--json", default=None, help="also write the deviations and settings here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    loaded = args.checkpoint is not None and os.path.exists(args.checkpoint)  # else trained, and saved there
    figure = _common.figure_name(args.out, "md.png")
    _common.check_files(p, inputs={"--checkpoint": args.checkpoint} if loaded else {},
                        outputs={"--json": args.json, **({} if loaded else {"--checkpoint": args.checkpoint})},
                        figures={"--out": figure, **({} if loaded else {"the parity plot": parity_figure(args.out)})})
    if args.smoke:
        args.atoms, args.steps, args.epochs = min(args.atoms, 4), min(args.steps, 4), min(args.epochs, 1)
    if args.emt_dt is None:
        args.emt_dt = args.dt[:1]
    return args


def main(argv=None) -> dict:
    from ase.calculators.emt import EMT
    from ase.units import kB

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    calc = load_or_train(args)
    atoms = copper(args.atoms)
    thermalize(atoms, args.temperature, args.seed)
    duration = args.steps * args.dt[0]
    runs = {}
    for name, calculator, time_steps in [("model", calc, args.dt), ("EMT", EMT(), args.emt_dt)]:
        for dt in time_steps:
            runs[f"{name}, dt = {dt:g} fs"] = run_nve(atoms, calculator, dt, round(duration / dt), name, args.quiet)
    n = len(atoms)
    deviations = {label: deviation_meV_per_atom(run, n) for label, run in runs.items()}
    plt = _common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    plot_energies(axes, runs, n)
    fig.suptitle(f"NVE velocity Verlet, fcc Cu, {n} atoms")
    fig.tight_layout()
    path = _common.figure_path(args.out, "md.png")
    _common.save_figure(fig, path)
    plt.close(fig)
    print(f"NVE, fcc Cu, {n} atoms, {duration:g} fs from {args.temperature:g} K; "
          f"largest |E_tot(t) - E_tot(0)| per atom:")
    for label, run in runs.items():
        temperature = 2 * run["kinetic"].mean() / (3 * n * kB)
        print(f"  {label:20s} {deviations[label]:8.4f} meV/atom   (mean temperature {temperature:5.1f} K)")
    print(f"figure saved to {path}")
    result = {"num_atoms": n, "duration_fs": duration, "temperature_K": args.temperature, "dtype": args.dtype,
              "deviation_meV_per_atom": deviations}
    if args.json:
        _common.write_json(result, args.json)
    return {**result, "figure": str(path)}


if __name__ == "__main__":
    main()
