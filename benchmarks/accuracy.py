r"""Accuracy at equal time: e3attn's model and a NequIP-style peer trained on the same EMT data.

Both models are trained on the structures, split, loss, optimiser, schedule and time budget of
``examples/molecules.py`` (its functions do the data, the training loop and the evaluation), one
after the other in one process, and evaluated on the same held-out structures:

* ``e3attn``: ``examples/molecules.py``'s model with its defaults (or the options after ``--``);
* ``nequip``: a NequIP-style interatomic potential written here with e3nn (Batzner et al. 2022):
  per layer a self-interaction, a ``uvu`` tensor product of the neighbours' features with the
  spherical harmonics of the edge, weighted by an MLP of a Bessel basis times a polynomial
  cutoff, **summed** over the neighbours (divided by a constant), a linear map, a species-dependent
  self-connection and a gate; a two-layer readout gives the energy of every atom.

With ``--organic NAME ...`` the data are instead the GFN2-xTB sets of ``benchmarks/organic_data.py``
(``<--data>/<NAME>_train.xyz`` and ``_test.xyz``, keys ``REF_energy`` / ``REF_forces``): e3attn is trained by the
training command, ``python -m e3attn.train`` in a process of its own with its defaults (or the options after
``--``; with ``--processes N``, as N DDP processes under torchrun sharing the ``--threads``), 5% of the training
file for validation, the best model by validation loss; the peer is trained on the same split with the same loop
(:mod:`e3attn.train`), both within ``--time-budget`` seconds, and both are evaluated on the test file. With
``--mace-python PATH`` (the Python of an environment with mace-torch, which pins e3nn 0.4.4), MACE is trained and
evaluated on the same files with its own commands, ``mace_run_train`` and ``mace_eval_configs`` from that Python's
folder, once per ``--mace-settings`` (``CHANNELSxMAX_L``), within the same budget (its epochs calibrated on a
2-epoch run, or ``--mace-epochs``); see ``benchmarks/mace_peer.py``.

Prints a table and writes JSON (``--out``, default ``benchmarks/results/accuracy.json``) with the
energy MAE (meV/atom), force MAE (meV/A), parameters, epochs and training time of each model.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/accuracy.py --time-budget 240
    OMP_NUM_THREADS=1 python benchmarks/accuracy.py --time-budget 240 -- --hidden "32x0e + 16x1o"
    python benchmarks/accuracy.py --quick      # seconds: tiny data and models (the test suite's smoke run)
    OMP_NUM_THREADS=2 python benchmarks/accuracy.py --organic aspirin ethanol --threads 2 --time-budget 600 \
        --mace-python /path/to/mace-venv/bin/python --mace-settings 32x1 64x0 16x2
    python benchmarks/accuracy.py --organic ethanol --threads 2 --processes 2 --models e3attn   # two DDP processes
"""
from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from e3nn import nn, o3

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

from e3attn._files import atomic_write  # noqa: E402
from e3attn.train import options as opt  # noqa: E402
import mace_peer  # noqa: E402  (benchmarks/mace_peer.py, next to this file)
import molecules  # noqa: E402  (examples/molecules.py: data, training loop, evaluation)

MODELS = ("e3attn", "nequip", "mace")


def bessel_basis(r: torch.Tensor, max_radius: float, number: int, p: int = 6) -> torch.Tensor:
    r"""NequIP's radial basis: :math:`\sqrt{2/r_c}\,\sin(n\pi r/r_c)/r` times the polynomial cutoff :math:`f_p(r/r_c)`."""
    n = torch.arange(1, number + 1, dtype=r.dtype, device=r.device)
    x = (r / max_radius)[:, None]
    bessel = math.sqrt(2.0 / max_radius) * (math.pi / max_radius) * n * torch.sinc(n * x)  # sin(n pi x) / r
    d = x.clamp(max=1.0)
    envelope = 1 - (p + 1) * (p + 2) / 2 * d**p + p * (p + 2) * d ** (p + 1) - p * (p + 1) / 2 * d ** (p + 2)
    return bessel * envelope * (x < 1)


class Interaction(torch.nn.Module):
    """One NequIP layer: linear, edge convolution (sum over the neighbours), linear, self-connection, gate."""

    def __init__(self, irreps_in: o3.Irreps, irreps_hidden: o3.Irreps, irreps_attr: o3.Irreps, lmax: int,
                 num_basis: int, radial_neurons: int, avg_num_neighbors: float) -> None:
        super().__init__()
        self.irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        scalars = o3.Irreps([(mul, ir) for mul, ir in irreps_hidden if ir.l == 0])
        gated = o3.Irreps([(mul, ir) for mul, ir in irreps_hidden if ir.l > 0])
        gates = o3.Irreps(f"{gated.num_irreps}x0e") if gated.num_irreps else o3.Irreps("")
        acts = [torch.nn.functional.silu if ir.p == 1 else torch.tanh for _, ir in scalars]
        self.gate = nn.Gate(scalars, acts, gates, [torch.sigmoid] * len(gates), gated)
        irreps_mid, instructions = [], []
        for i, (mul, ir_in) in enumerate(irreps_in):
            for j, (_, ir_sh) in enumerate(self.irreps_sh):
                for ir_out in ir_in * ir_sh:
                    if ir_out in self.gate.irreps_in:
                        instructions.append((i, j, len(irreps_mid), "uvu", True))
                        irreps_mid.append((mul, ir_out))
        self.linear_in = o3.Linear(irreps_in, irreps_in)
        self.tp = o3.TensorProduct(irreps_in, self.irreps_sh, o3.Irreps(irreps_mid), instructions,
                                   shared_weights=False, internal_weights=False)
        self.radial = nn.FullyConnectedNet([num_basis, radial_neurons, radial_neurons, self.tp.weight_numel],
                                           torch.nn.functional.silu)
        self.linear_out = o3.Linear(o3.Irreps(irreps_mid).simplify(), self.gate.irreps_in)
        self.self_connection = o3.FullyConnectedTensorProduct(irreps_in, irreps_attr, self.gate.irreps_in)
        self.num_basis, self.avg_num_neighbors = num_basis, avg_num_neighbors
        self.residual = irreps_in == self.gate.irreps_out

    def forward(self, h, attr, edge_index, edge_vec, max_radius):
        src, dst = edge_index
        r = edge_vec.norm(dim=1)
        weights = self.radial(bessel_basis(r, max_radius, self.num_basis))
        sh = o3.spherical_harmonics(self.irreps_sh, edge_vec, normalize=True, normalization="component")
        messages = self.tp(self.linear_in(h)[src], sh, weights)
        aggregated = torch.zeros(h.shape[0], messages.shape[1], dtype=h.dtype, device=h.device)
        aggregated = aggregated.index_add(0, dst, messages) / math.sqrt(self.avg_num_neighbors)
        out = self.gate(self.linear_out(aggregated) + self.self_connection(h, attr))
        return h + out if self.residual else out


class NequIPStyle(torch.nn.Module):
    r"""A NequIP-style energy model, called like :class:`~e3attn.models.EquivariantTransformer` with ``reduce="sum"``.

    .. math::

        h^{(0)}_i = W a_i, \qquad
        h^{(t+1)}_i = \mathrm{Gate}\Big(W_2 \frac{1}{\sqrt{\nu}} \sum_{j} R(r_{ij}) \big(W_1 h^{(t)}_j \otimes Y(\hat r_{ij})\big)
            + h^{(t)}_i \otimes a_i\Big) \,(+\, h^{(t)}_i), \qquad
        E = \sum_i \mathrm{MLP}(h^{(T), 0e}_i)
    """

    def __init__(self, num_species: int, irreps_hidden: str, max_radius: float, *, num_layers: int = 3,
                 lmax: int = 2, num_basis: int = 8, radial_neurons: int = 32, avg_num_neighbors: float = 10.0) -> None:
        super().__init__()
        self.max_radius = max_radius
        self.irreps_attr = o3.Irreps(f"{num_species}x0e")
        irreps_hidden = o3.Irreps(irreps_hidden)
        self.embedding = o3.Linear(self.irreps_attr, o3.Irreps([(m, ir) for m, ir in irreps_hidden if ir.l == 0]))
        layers, irreps = [], self.embedding.irreps_out
        for _ in range(num_layers):
            layers.append(Interaction(irreps, irreps_hidden, self.irreps_attr, lmax, num_basis, radial_neurons,
                                      avg_num_neighbors))
            irreps = layers[-1].gate.irreps_out
        self.layers = torch.nn.ModuleList(layers)
        readout = f"{max(irreps.count('0e') // 2, 1)}x0e"
        self.readout = torch.nn.Sequential(o3.Linear(irreps, readout), torch.nn.SiLU(), o3.Linear(readout, "0e"))

    def forward(self, pos, x=None, batch=None, edge_index=None, edge_vec=None, *, node_attr=None):
        if edge_vec is None:
            edge_vec = pos[edge_index[0]] - pos[edge_index[1]]
        h = self.embedding(node_attr)
        for layer in self.layers:
            h = layer(h, node_attr, edge_index, edge_vec, self.max_radius)
        energy = self.readout(h)[:, 0]
        batch = torch.zeros_like(energy, dtype=torch.long) if batch is None else batch
        num_graphs = int(batch.max()) + 1 if batch.numel() else 0
        return energy.new_zeros(num_graphs).index_add(0, batch, energy)


def cpu_name() -> str:
    """The processor's model name (Linux), or the platform's machine type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def build(name: str, args) -> torch.nn.Module:
    """The model ``name`` for the options ``args``."""
    if name == "e3attn":
        return molecules.build_model(args)
    return NequIPStyle(len(molecules.SPECIES), args.peer_hidden, args.max_radius, num_layers=args.peer_layers,
                       lmax=args.peer_lmax, avg_num_neighbors=args.avg_num_neighbors)


def parse_args(argv: Optional[Sequence[str]] = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passed = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = opt.ArgumentParser(__doc__)
    p.add_argument("--models", nargs="+", choices=MODELS, default=None,
                   help="default: e3attn and nequip, and mace with --mace-python")
    p.add_argument("--time-budget", type=float, default=240.0, help="training seconds per model")
    p.add_argument("--epochs", type=opt.positive_int, default=1000, help="at most this many epochs per model")
    p.add_argument("--threads", type=opt.positive_int, default=1, help="torch.set_num_threads")
    p.add_argument("--processes", type=opt.positive_int, default=1,
                   help="with --organic: e3attn's training command as this many DDP processes under torchrun "
                        "(--ddp, each with --threads / --processes threads; default 1: one process with --threads)")
    p.add_argument("--peer-hidden", default="32x0e + 16x1o + 8x2e", help="hidden irreps of the NequIP-style peer")
    p.add_argument("--peer-layers", type=int, default=2)
    p.add_argument("--peer-lmax", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny data, models and budget (seconds; for the tests)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "accuracy.json")
    p.add_argument("--organic", nargs="+", metavar="NAME", default=None,
                   help="train on <--data>/<NAME>_train.xyz, test on _test.xyz (benchmarks/organic_data.py) with the "
                        "training command, instead of the EMT data")
    p.add_argument("--data", type=Path, default=ROOT / "benchmarks" / "data" / "organic",
                   help="folder of the --organic files")
    p.add_argument("--mace-python", type=Path, default=None, metavar="PYTHON",
                   help="with --organic: also train MACE with the commands next to this Python (its own venv)")
    p.add_argument("--mace-settings", nargs="+", default=["32x1"], metavar="CxL",
                   help="MACE's --num_channels x --max_L, one run each (default 32x1)")
    p.add_argument("--mace-epochs", type=int, default=None,
                   help="MACE's --max_num_epochs (default: as many as fit in --time-budget, from a 2-epoch run)")
    p.add_argument("--mace-radius", type=float, default=5.0, help="MACE's --r_max (default 5.0, its own default)")
    args = p.parse_args(own)
    opt.check_files(p, results={"--out": args.out})
    if args.threads % args.processes:
        p.error(f"argument --processes: must divide --threads ({args.threads}), got {args.processes}")
    if args.processes > 1 and not args.organic:
        p.error("argument --processes: only with --organic (the training command's --ddp)")
    if args.mace_python is not None and not (args.organic and (args.mace_python.parent / "mace_run_train").exists()):
        p.error("--mace-python needs --organic and a Python whose folder has mace_run_train")
    args.models = args.models or ["e3attn", "nequip"] + (["mace"] if args.mace_python else [])
    if "mace" in args.models and args.mace_python is None:
        p.error("--models mace needs --mace-python (and --organic)")
    for name in args.organic or []:
        missing = [f"{name}_{split}.xyz" for split in ("train", "test") if not (args.data / f"{name}_{split}.xyz").is_file()]
        if missing:
            p.error(f"argument --data: {str(args.data)!r} has no {' or '.join(missing)} (make them with "
                    f"python benchmarks/organic_data.py --molecules {name} --out {args.data})")
    for setting in args.mace_settings:
        try:
            mace_peer.parse_setting(setting)
        except ValueError as err:
            p.error(f"--mace-settings: {err}")
    if args.organic:
        args.passed = passed
        return args
    options = ["--device", "cpu", "--quiet", "--epochs", str(args.epochs), "--time-budget", str(args.time_budget)]
    if args.quick:
        options += ["--smoke"]
        args.peer_hidden, args.peer_layers = "4x0e + 2x1o", 1
    args.train_args = molecules.parse_args(options + passed)
    if args.quick:
        args.train_args.hidden = "4x0e + 4x1o"
    return args


def training_command(name: str, args) -> List[str]:
    """The options of ``e3attn-train`` for the organic set ``name`` (the command's defaults otherwise)."""
    options = ["--train-file", str(args.data / f"{name}_train.xyz"), "--test-file", str(args.data / f"{name}_test.xyz"),
               "--energy-key", "REF_energy", "--forces-key", "REF_forces", "--device", "cpu", "--quiet",
               "--time-budget", str(args.time_budget), "--epochs", str(args.epochs)]
    if args.quick:
        options += ["--hidden", "4x0e + 4x1o", "--epochs", "2", "--valid-fraction", "0.25"]
    return options + args.passed


def run_command(options: List[str], threads: int, processes: int = 1, seconds: Optional[float] = None) -> dict:
    """Run ``python -m e3attn.train options`` in its own process (this checkout's e3attn), or as ``processes`` DDP
    processes under torchrun (``--standalone``: on this machine, a free port) sharing ``threads``; returns its
    metrics (rank 0's). With ``seconds``, a run that has not ended by then is stopped (all its processes) and
    reported, rather than left to hang the benchmark."""
    launcher = [sys.executable, "-m", "e3attn.train"] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
        "-m", "e3attn.train", "--ddp"]
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "metrics.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads // processes),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        # a session of its own: a timeout stops torchrun's workers with it
        process = subprocess.Popen([*launcher, *options, "--metrics", str(metrics)], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            state = "after writing its metrics" if metrics.exists() else "before writing its metrics"
            raise SystemExit(f"e3attn-train did not end within {seconds:.0f} s ({state}); stopped") from None
        if process.returncode != 0:
            raise SystemExit(f"e3attn-train failed ({process.returncode}): {stderr.strip()[-2000:]}")
        print(stdout.strip(), flush=True)
        return json.loads(metrics.read_text())


def command_seconds(args) -> Optional[float]:
    """How long a run of the training command may take in all: its ``--time-budget`` twice (the data read, the
    evaluation of the test file and a loaded machine on top) and 10 minutes; no limit without a budget."""
    return 2 * args.time_budget + 600.0 if args.time_budget else None


def organic_rows(args) -> List[dict]:
    """Per molecule of ``--organic``: e3attn by the training command, the peer by e3attn.train's loop on the
    same split, data and budget."""
    from e3attn.train import cli, evaluate, fit

    rows: List[dict] = []
    for name in args.organic:
        options = training_command(name, args)
        for model_name in (m for m in args.models if m != "mace"):
            if model_name == "e3attn":
                metrics = run_command(options, args.threads, args.processes, command_seconds(args))
                params = metrics["parameters"]
            else:
                command = cli.parse_args(options)
                species, samples, units = cli.load_data(command)
                args.avg_num_neighbors, args.max_radius = command.avg_num_neighbors, command.max_radius
                torch.manual_seed(command.seed)
                model = NequIPStyle(len(species), args.peer_hidden, args.max_radius, num_layers=args.peer_layers,
                                    lmax=args.peer_lmax, avg_num_neighbors=args.avg_num_neighbors)
                result = fit(model, samples["train"], units, command, torch.device("cpu"),
                             valid_set=samples["valid"] or None)
                test = evaluate(model, samples["test"], units, torch.device("cpu"))
                metrics = {"epochs": len(result.train_losses), "train_seconds": result.seconds,
                           "num_train": len(samples["train"]), "compiled_steps": result.compiled,
                           "test": {k: v for k, v in test.items() if not k.startswith(("true_", "pred_"))}}
                params = sum(p.numel() for p in model.parameters())
            rows.append({"molecule": name, "model": model_name, "parameters": params, "epochs": metrics["epochs"],
                         "processes": args.processes if model_name == "e3attn" else 1,
                         "train_seconds": metrics["train_seconds"], "num_train": metrics["num_train"],
                         "num_test": metrics["test"]["num_structures"],
                         "compiled_steps": metrics.get("compiled_steps", False),
                         "energy_mae_meV_per_atom": metrics["test"]["energy_mae_meV_per_atom"],
                         "force_mae_meV_per_A": metrics["test"]["force_mae_meV_per_A"]})
            _print_row(rows[-1])
        if "mace" in args.models:
            with tempfile.TemporaryDirectory() as folder:
                for setting in args.mace_settings:
                    rows.append(mace_peer.run_mace(args.mace_python, name, args.data, setting, args.time_budget,
                                                   args.threads, args.mace_radius, Path(folder), args.mace_epochs))
                    _print_row(rows[-1])
    return rows


def _print_row(r: dict) -> None:
    print(f"{r['molecule']:14s} {r['model']:10s} {r['epochs']:4d} epochs {r['train_seconds']:7.1f} s   "
          f"test energy MAE {r['energy_mae_meV_per_atom']:.2f} meV/atom, force MAE {r['force_mae_meV_per_A']:.2f} meV/A",
          flush=True)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.organic:
        if args.quick:
            args.peer_hidden, args.peer_layers = "4x0e + 2x1o", 1
        report = {"meta": {"machine": cpu_name(), "python": platform.python_version(), "torch": torch.__version__,
                           "threads": args.threads, "e3attn_processes": args.processes,
                           "time_budget_s": args.time_budget, "data": str(args.data),
                           "training_command_options": args.passed, "load_average_start": os.getloadavg(),
                           "peer": {"hidden": args.peer_hidden, "layers": args.peer_layers, "lmax": args.peer_lmax}},
                  "results": organic_rows(args)}
        report["meta"]["load_average_end"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.out, "w") as file:  # the old file whole or the new one
            json.dump(report, file, indent=1)
        return report
    train_args = args.train_args
    def samples(num: int, seed: int) -> list:
        return [molecules.to_sample(a, train_args.max_radius) for a in molecules.make_structures(num, seed)]

    train_set, test_set = samples(train_args.train, train_args.seed), samples(train_args.test, train_args.seed + 10_000)
    units = molecules.fit_references(train_set, train_args.energy_scale)
    args.avg_num_neighbors = train_args.avg_num_neighbors
    args.max_radius = train_args.max_radius
    rows: List[dict] = []
    for name in args.models:
        torch.manual_seed(train_args.seed)
        model = build(name, train_args if name == "e3attn" else args)
        losses, _, seconds, _ = molecules.fit(model, train_set, units, train_args, torch.device("cpu"))
        result = molecules.evaluate(model, test_set, units, torch.device("cpu"))
        rows.append({
            "model": name,
            "parameters": sum(p.numel() for p in model.parameters()),
            "epochs": len(losses),
            "train_seconds": seconds,
            "energy_mae_meV_per_atom": result["energy_mae_meV_per_atom"],
            "force_mae_meV_per_A": result["force_mae_meV_per_A"],
            "final_train_loss": losses[-1],
        })
        r = rows[-1]
        print(f"{name:8s} {r['parameters']:8d} params {r['epochs']:4d} epochs {seconds:7.1f} s   "
              f"energy MAE {r['energy_mae_meV_per_atom']:.1f} meV/atom, force MAE {r['force_mae_meV_per_A']:.1f} meV/A",
              flush=True)
    report = {
        "meta": {
            "machine": cpu_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
            "time_budget_s": train_args.time_budget,
            "num_train": len(train_set),
            "num_test": len(test_set),
            "e3attn_options": {k: v for k, v in vars(train_args).items() if isinstance(v, (int, float, str, bool, type(None)))},
            "peer": {"hidden": args.peer_hidden, "layers": args.peer_layers, "lmax": args.peer_lmax},
        },
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(args.out, "w") as file:  # the old file whole or the new one
        json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
