r"""Train an e3attn potential on energies and forces (and stress) from any files ASE reads.

    e3attn-train --train-file train.xyz --test-file test.xyz --save model.pt --metrics metrics.json
    python -m e3attn.train --config train.yaml            # the same options as YAML keys
    torchrun --nproc_per_node 2 -m e3attn.train --ddp ... # several processes (nccl on GPUs, gloo on CPUs)

The model is an EquivariantTransformer of one energy per structure, forces (and stress) its exact derivatives.
Energies are learnt relative to a reference energy per element, fitted by least squares on the training set, in
units of the RMS force component. Training stops after --epochs or --time-budget seconds, whichever comes first;
the saved model is that of the epoch of least validation loss. At the end one line per split (validation, test):
"<split>: energy MAE <x> meV/atom, force MAE <y> meV/A" (", stress MAE <z> meV/A^3" with stress). The checkpoint
(--save) is what e3attn.calculator.E3AttnCalculator.from_checkpoint reads.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .._files import atomic_writes
from ..models import save_checkpoint
from . import options as opt
from .compiled import compile_setting
from .config import config_arguments
from .data import DataError, LabelKeys, fit_references, mean_neighbors, read_structures, split, to_sample
from .loop import fit, init_distributed, synced_max
from .model import build_model, check_model_options, evaluate, loss_options

__all__ = ["parse_args", "load_data", "run", "main", "CommandError"]

PROG = "e3attn-train"
MODEL_DEFAULTS = dict(max_radius=5.0, hidden="16x0e + 8x1o + 4x2e", layers=2, heads=1, lmax=2, density_lmax=3)
"""The command's model defaults where they differ from the EMT example's (``e3attn.train.options.MODEL_DEFAULTS``),
chosen on GFN2-xTB molecular dynamics of organic molecules (docs/guide/accuracy_organic.rst)."""
TRAINING_DEFAULTS = dict(batch_size=8, force_weight=10.0, lr=2e-2, loss="huber")
"""The command's training defaults where they differ from the EMT example's
(``e3attn.train.options.TRAINING_DEFAULTS``)."""
DTYPES = {"float32": torch.float32, "float64": torch.float64}
UNITS = {"energy_mae_meV_per_atom": ("energy", "meV/atom"), "force_mae_meV_per_A": ("force", "meV/A"),
         "stress_mae_meV_per_A3": ("stress", "meV/A^3")}


def _parser() -> opt.ArgumentParser:
    p = opt.ArgumentParser(__doc__, prog=PROG, allow_abbrev=False)  # options are told apart by their full names
    p.add_argument("--config", metavar="YAML", help="options as a YAML mapping (command-line options win)")
    p.add_argument("--train-file", required=True, help="training structures (any file ASE reads)")
    p.add_argument("--valid-file", help="validation structures (default: --valid-fraction of the training file)")
    p.add_argument("--valid-fraction", type=opt.fraction, default=None,
                   help="fraction of the training file held out for validation (default 0.05; 0: no validation)")
    p.add_argument("--test-file", help="test structures, evaluated once at the end")
    p.add_argument("--energy-key", default="energy", help="key of the energy (eV) in atoms.info or the calculator")
    p.add_argument("--forces-key", default="forces", help="key of the forces (eV/A) in atoms.arrays or the calculator")
    p.add_argument("--stress-key", default="stress",
                   help="key of the stress (eV/A^3), trained on when every training structure has it ('none': never)")
    p.add_argument("--stress-weight", type=opt.non_negative_float, default=1.0, help="weight of the virial term")
    opt.add_model_options(p, avg_num_neighbors="auto", defaults=MODEL_DEFAULTS)
    opt.add_training_options(p, epochs=1000, time_budget=600.0, defaults=TRAINING_DEFAULTS)
    p.add_argument("--device", type=opt.device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the model and the data")
    p.add_argument("--seed", type=opt.non_negative_int, default=0, help="random seed of the weights, split, batches")
    p.add_argument("--save", metavar="CHECKPOINT", help="write the best model here (never left half-written)")
    p.add_argument("--metrics", metavar="JSON", help="write the errors of every split here as JSON")
    return p


class CommandError(RuntimeError):
    """What stops the command after the data were read (training diverged, an output cannot be written), in one
    line; nothing is written or replaced then."""


def _given(argv: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def _without(argv: List[str], option: str) -> List[str]:
    """``argv`` (a config's arguments: ``[flag, value, ...]``) without ``option`` and its value."""
    out, skip = [], False
    for a in argv:
        if not skip and a != option:
            out.append(a)
        skip = a == option
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options of ``argv`` (default ``sys.argv[1:]``), those of ``--config`` first; bad ones exit with status 2.

    Example::

        >>> args = parse_args(["--train-file", "train.xyz", "--epochs", "5"])
        >>> args.epochs, args.valid_fraction, args.stress_key
        (5, 0.05, 'stress')
    """
    p = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path is not None:
        try:
            config = config_arguments(p, path)
        except ValueError as err:
            p.error(str(err))
        for given, other in (("--valid-file", "--valid-fraction"), ("--valid-fraction", "--valid-file")):
            if _given(argv, given):  # the command line's choice of validation replaces the file's
                config = _without(config, other)
        argv = config + argv
    args = p.parse_args(argv)
    args.stress_key_given = _given(argv, "--stress-key")
    if args.valid_file is not None and args.valid_fraction is not None:
        p.error("give --valid-file or --valid-fraction, not both")
    args.valid_fraction = 0.05 if args.valid_fraction is None and args.valid_file is None else args.valid_fraction
    args.stress_key = None if args.stress_key.lower() == "none" else args.stress_key
    opt.check_files(p, inputs={f"--{name.replace('_', '-')}": getattr(args, name)
                               for name in ("config", "train_file", "valid_file", "test_file")},
                    outputs={"--save": args.save, "--metrics": args.metrics}, read_now=False)
    check_model_options(p, args, "the model options (--hidden, --heads, --lmax, --density, ...)")
    opt.check_compile(p, args)
    return opt.amp_only_on_cuda(args)


def _stress_key(structures, key: Optional[str], what: str, given: bool = False) -> Optional[str]:
    """``key`` when every structure has a stress under it, ``None`` when none has (a DataError then if the key was
    ``given`` by the user); a DataError when some have."""
    if key is None:
        return None
    has = [key in a.info or key in (getattr(a.calc, "results", None) or {}) for a in structures]
    if any(has) and not all(has):
        raise DataError(f"{what}: {sum(has)} of {len(structures)} structures have a stress under {key!r}: give it "
                        f"for all or none (--stress-key none ignores it)")
    if given and not any(has):
        raise DataError(f"{what}: no structure has a stress under the key {key!r} (--stress-key); give the key "
                        "the file uses, or --stress-key none")
    return key if all(has) else None


def _samples(structures, what: str, path: str, species, args, keys: LabelKeys) -> List[dict]:
    if not structures:
        raise DataError(f"{what}: no structures in this split")
    return [to_sample(a, species, args.max_radius, keys, where=f"{what}: structure {i} (from 0) of {path!r}")
            for i, a in enumerate(structures)]


def _finite(data):
    """``data`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return None if isinstance(data, float) and not math.isfinite(data) else data


def _write(args: argparse.Namespace, module: torch.nn.Module, units: dict, metrics: dict) -> None:
    """``--save`` and ``--metrics``, each replaced whole or not at all: both new files are written and flushed to
    disk before either replaces its target, so a failure (a full disk, a name too long) leaves both as they were."""
    names = [name for name in ("save", "metrics") if getattr(args, name)]
    try:
        with atomic_writes(*((getattr(args, name), "wb" if name == "save" else "w") for name in names)) as files:
            for name, file in zip(names, files):
                if name == "save":
                    save_checkpoint(module, file, **units, metrics=metrics)
                else:
                    json.dump(_finite(metrics), file, indent=1, allow_nan=False)
    except OSError as err:
        given = " and ".join(f"--{name} {getattr(args, name)!r}" for name in names)
        raise CommandError(f"cannot write {given}: {err.strerror or err}; neither file was replaced") from None


def _line(split: str, errors: dict) -> str:
    return f"{split}: " + ", ".join(f"{UNITS[k][0]} MAE {errors[k]:.2f} {UNITS[k][1]}" for k in UNITS if k in errors)


def load_data(args: argparse.Namespace):
    """``(species, samples, units)`` of the options: the elements of the training file (by atomic number), the
    samples of the splits ``train``, ``valid`` (maybe empty) and ``test`` (when given), and the reference energies
    and scale fitted on ``train``; ``args.avg_num_neighbors`` becomes a number. Raises
    :class:`~e3attn.train.DataError` on data that cannot be trained on."""
    from ase.data import atomic_numbers

    train_structures = read_structures(args.train_file, "--train-file")
    given = getattr(args, "stress_key_given", False)
    keys = LabelKeys(args.energy_key, args.forces_key,
                     _stress_key(train_structures, args.stress_key, "--train-file", given))
    species = sorted(set().union(*(a.get_chemical_symbols() for a in train_structures)), key=atomic_numbers.get)
    samples = {"train": _samples(train_structures, "--train-file", args.train_file, species, args, keys)}
    samples["train"], samples["valid"] = split(samples["train"], args.valid_fraction or 0.0, args.seed)
    if not samples["train"]:
        raise DataError(f"--valid-fraction {args.valid_fraction} leaves no training structures")
    learnt = set(torch.cat([s["species"] for s in samples["train"]]).tolist())
    unlearnt = [z for i, z in enumerate(species) if i not in learnt]
    if unlearnt:
        raise DataError(f"--train-file: the elements {unlearnt} are only in structures held out for validation "
                        f"(--valid-fraction {args.valid_fraction}, --seed {args.seed}): the model would never learn "
                        "them; add structures with them, or give a --valid-file")
    for name, path in (("valid", args.valid_file), ("test", args.test_file)):
        if path is not None:
            structures = read_structures(path, f"--{name}-file")
            split_keys = keys._replace(stress=_stress_key(structures, keys.stress, f"--{name}-file"))
            samples[name] = _samples(structures, f"--{name}-file", path, species, args, split_keys)
    units = fit_references(samples["train"], species, args.energy_scale)
    if args.avg_num_neighbors == "auto":
        args.avg_num_neighbors = mean_neighbors(samples["train"])
    return species, samples, units


def run(args: argparse.Namespace) -> dict:
    """Read the data (:func:`load_data`), train, evaluate, print one line per split, write ``--save`` and
    ``--metrics``; returns the metrics. Raises :class:`~e3attn.train.DataError` on data that cannot be trained on."""
    species, samples, units = load_data(args)
    if compile_setting(args) == "on" and "stress" in samples["train"][0]:
        raise CommandError(f"--compile: the structures of --train-file have stress ({args.stress_key!r}), which a "
                           "compiled step does not train on; leave out --compile, or give --stress-key none")
    rank, world, device = init_distributed(args)
    torch.manual_seed(args.seed)
    module = build_model(args, len(species)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None) if args.ddp else module
    result = fit(model, samples["train"], units, args, device, rank, world, valid_set=samples["valid"] or None)
    # the DDP wrapper holds the process group: it goes now, while every process is alive, so that the group is torn
    # down inside destroy_process_group below (freed at this function's return instead, after the other processes
    # had left, gloo's teardown could wait for them for ever: a process that never exits)
    del model
    # the kept model: the best finite validation loss, or (without validation) the last epoch's
    losses = result.valid_losses if samples["valid"] else result.train_losses[-1:]
    diverged = not any(math.isfinite(x) for x in losses)
    if synced_max(float(diverged), args.ddp, device):  # every process decides alike (training losses are its own)
        if args.ddp:
            dist.destroy_process_group()
        which = "validation" if samples["valid"] else "training"
        raise CommandError(f"training diverged: no finite {which} loss in {len(result.train_losses)} epochs (the "
                           f"last: {losses[-1] if losses else None}), so nothing was written; try a smaller --lr "
                           f"(now {args.lr:g})")
    metrics = {"species": species, "epochs": len(result.train_losses), "best_epoch": result.best_epoch,
               "train_seconds": result.seconds, "num_train": len(samples["train"]), "world_size": world,
               "parameters": sum(p.numel() for p in module.parameters()), "compiled_steps": result.compiled}
    for name in ("valid", "test"):
        if samples.get(name) and rank == 0:
            errors = evaluate(module, samples[name], units, device, args.amp, weights=loss_options(args))
            metrics[name] = {k: v for k, v in errors.items() if not k.startswith(("true_", "pred_"))}
    try:
        if rank == 0:
            _write(args, module, units, metrics)
            print(f"trained {metrics['epochs']} epochs in {result.seconds:.0f} s, kept epoch {result.best_epoch}"
                  + (f"; checkpoint {args.save}" if args.save else ""))
            for name in ("valid", "test"):
                if name in metrics:
                    print(_line(name, metrics[name]))
    finally:
        if args.ddp:
            # every rank waits for rank 0's evaluation and writes (or its failure): no rank tears the group down
            # with work in flight
            dist.barrier()
            dist.destroy_process_group()
    return metrics


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """The command ``e3attn-train`` (``python -m e3attn.train``): :func:`parse_args` then :func:`run`, with the
    default dtype set to ``--dtype`` meanwhile; bad data stop it with one line and exit status 2."""
    args = parse_args(argv)
    try:
        import ase  # noqa: F401
    except ImportError:
        opt.fail("reading the data needs ASE: pip install ase (or pip install 'e3attn[train]')", prog=PROG)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        return run(args)
    except (DataError, CommandError) as err:
        opt.fail(str(err), prog=PROG)
    finally:
        torch.set_default_dtype(default)
