r"""Command-line options of the training command and of the examples: types, one-line errors, shared options.

Every option type here raises :class:`argparse.ArgumentTypeError` with what was expected and what was given, so
that :class:`ArgumentParser` prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Callable, Dict, Mapping, NoReturn, Optional

import torch

from .._checks import device_present
from ..models.density import ANGULAR_CHANNELS
from ..models.transformer import LAYER_NORMS, SELF_CONNECTIONS
from .compiled import AUTO_COMPILE_SECONDS

__all__ = [
    "ArgumentParser", "fail", "device", "irreps", "positive_int", "non_negative_int", "positive_float",
    "non_negative_float", "fraction", "add_model_options", "add_training_options", "amp_only_on_cuda", "check_compile",
    "check_files", "compile_choice",
]

SCHEDULES = ("cosine", "plateau", "constant")
ENERGY_SCALES = ("force_rms", "energy_std")
LOSSES = ("mse", "huber")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2, with a verbatim description.

    Example::

        >>> p = ArgumentParser("Train.")
        >>> _ = p.add_argument("--epochs", type=positive_int, default=3)
        >>> p.parse_args([]).epochs
        3
    """

    def __init__(self, description: str, **kwargs) -> None:
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for name, value in vars(namespace).items():  # defaults told apart while parsing: plain numbers after
            if type(value) is _Default:
                setattr(namespace, name, int(value))
        return namespace, extras


def fail(message: str, prog: Optional[str] = None) -> NoReturn:
    """Stop with one line on stderr (``<prog>: error: <message>``, default: the script's name) and exit status 2.

    Example::

        >>> try:
        ...     fail("--train-file: no such file 'x.xyz'")
        ... except SystemExit as stop:
        ...     print(stop.code)
        2
    """
    print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def device(value: str) -> str:
    """argparse type: a torch device present on this machine (returned as given).

    Example::

        >>> device("cpu")
        'cpu'
    """
    try:
        parsed = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device (e.g. cuda, cuda:1); try --device cpu") from None
    if not device_present(parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is not available on this machine; try --device cpu")
    return value


def _number(convert: Callable, test: Callable, expected: str) -> Callable[[str], float]:
    def parse(value: str):
        try:
            number = convert(value)
        except ValueError:
            number = None
        if number is None or not test(number):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return number

    parse.__name__ = expected.replace(" ", "_")
    parse.__doc__ = f"argparse type: {expected} (returned as a number), else a one-line error saying so."
    return parse


positive_int = _number(int, lambda n: n > 0, "a positive integer")
non_negative_int = _number(int, lambda n: n >= 0, "a non-negative integer")
positive_float = _number(float, lambda x: 0 < x < float("inf"), "a positive number")
non_negative_float = _number(float, lambda x: 0 <= x < float("inf"), "a non-negative number")
fraction = _number(float, lambda x: 0 <= x < 1, "a number in [0, 1)")


class _Default(int):
    """A default of an integer option, told apart from the same number given on the command line."""


class _DensityAction(argparse.Action):
    """``--density``: with 0 (no density channels) also no angular moments, with another number the default
    degree again, where ``--density-lmax`` keeps its default (given, it stays, and a model of it is refused)."""

    def __init__(self, *args, lmax_default: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lmax_default = lmax_default

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        if isinstance(getattr(namespace, "density_lmax", None), _Default):
            namespace.density_lmax = _Default(self.lmax_default if value else 0)


def irreps(value: str) -> str:
    """argparse type: e3nn irreps such as ``16x0e + 8x1o`` (returned as given).

    Example::

        >>> irreps("16x0e + 8x1o")
        '16x0e + 8x1o'
    """
    from e3nn import o3

    try:
        o3.Irreps(value)
    except (ValueError, AssertionError, TypeError):
        raise argparse.ArgumentTypeError(f"expected e3nn irreps such as '16x0e + 8x1o', got {value!r}") from None
    return value


def _neighbors(value: str):
    return value if value == "auto" else _number(float, lambda x: 0 < x < float("inf"), "a positive number or 'auto'")(value)


MODEL_DEFAULTS: Dict[str, Any] = dict(max_radius=4.0, hidden="16x0e + 8x1o", layers=1, heads=4, lmax=1, basis_size=10,
                                      radial_neurons=16, basis="bessel", density=32, density_lmax=0,
                                      density_angular=None, layer_norm="post", self_connection="identity")
"""Defaults of :func:`add_model_options`: the EMT example's model (``examples/molecules.py``)."""
TRAINING_DEFAULTS: Dict[str, Any] = dict(batch_size=8, lr=1e-2, schedule="cosine", force_weight=3.0, energy_weight=1.0,
                                         energy_scale="force_rms", ema=0.0, loss="mse", huber_delta=0.01)
"""Defaults of :func:`add_training_options` (but the epochs and the budget): the EMT example's."""


def _defaults(given: Optional[Mapping[str, Any]], table: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(given or {}) - set(table))
    if unknown:
        raise ValueError(f"defaults: unknown option(s) {', '.join(unknown)}; known: {', '.join(table)}")
    return {**table, **(given or {})}


def add_model_options(p: argparse.ArgumentParser, avg_num_neighbors="auto",
                      defaults: Optional[Mapping[str, Any]] = None) -> None:
    """The options of the :class:`~e3attn.models.EquivariantTransformer` energy model.

    ``avg_num_neighbors``: the default of ``--avg-num-neighbors``, a number or ``"auto"`` (the training set's mean).
    ``defaults``: defaults (by destination, e.g. ``{"max_radius": 5.0}``) that replace those of
    ``MODEL_DEFAULTS``.

    Example::

        >>> p = ArgumentParser("Train.")
        >>> add_model_options(p, defaults={"layers": 2})
        >>> args = p.parse_args(["--max-radius", "5"])
        >>> args.max_radius, args.layers, args.lmax
        (5.0, 2, 1)
    """
    d = _defaults(defaults, MODEL_DEFAULTS)
    p.add_argument("--max-radius", type=positive_float, default=d["max_radius"],
                   help=f"cutoff in Angstrom (default {d['max_radius']:g})")
    p.add_argument("--hidden", type=irreps, default=d["hidden"], help=f"hidden irreps (default {d['hidden']!r})")
    p.add_argument("--layers", type=positive_int, default=d["layers"], help=f"attention blocks (default {d['layers']})")
    p.add_argument("--heads", type=positive_int, default=d["heads"],
                   help=f"attention heads (must divide every multiplicity of --hidden; default {d['heads']})")
    p.add_argument("--lmax", type=non_negative_int, default=d["lmax"],
                   help=f"largest degree of the edge harmonics (default {d['lmax']})")
    p.add_argument("--basis-size", type=positive_int, default=d["basis_size"],
                   help=f"radial basis functions of the edge lengths (default {d['basis_size']})")
    p.add_argument("--radial-neurons", type=positive_int, default=d["radial_neurons"],
                   help=f"hidden size of the radial MLPs (default {d['radial_neurons']})")
    p.add_argument("--basis", choices=("smooth_finite", "gaussian", "bessel"), default=d["basis"],
                   help=f"radial basis of the edge lengths (default {d['basis']})")
    p.add_argument("--density", type=non_negative_int, default=d["density"], metavar="K", action=_DensityAction,
                   lmax_default=d["density_lmax"],
                   help=f"neighbour-density channels per block (0: attention only, and no angular moments unless "
                        f"--density-lmax is given; default {d['density']})")
    p.add_argument("--density-lmax", type=non_negative_int, default=_Default(d["density_lmax"]), metavar="L",
                   help="largest degree of the density channels' angular moments, whose power spectrum (bond-angle "
                        f"terms) joins the densities (0: none; default {d['density_lmax']})")
    p.add_argument("--density-angular", type=positive_int, default=d["density_angular"], metavar="K",
                   help="density channels with angular moments, only with --density-lmax > 0 (default "
                        + (f"{d['density_angular']})" if d["density_angular"] else f"min({ANGULAR_CHANNELS}, --density))"))
    p.add_argument("--avg-num-neighbors", type=_neighbors, default=avg_num_neighbors,
                   help="normalisation of the density sums ('auto': the mean number of neighbours within the "
                        "cutoff in the training set)")
    p.add_argument("--layer-norm", choices=LAYER_NORMS, default=d["layer_norm"],
                   help=f"equivariant layer norm after every block, on every block's input, or none "
                        f"(default {d['layer_norm']})")
    p.add_argument("--self-connection", choices=SELF_CONNECTIONS, default=d["self_connection"],
                   help="every block's residual: the identity, or a learned map per element (node_attr; "
                        f"default {d['self_connection']})")


def add_training_options(p: argparse.ArgumentParser, epochs: int, time_budget: float,
                         defaults: Optional[Mapping[str, Any]] = None) -> None:
    """The options of :func:`e3attn.train.fit`: epochs, budget, batches, optimiser, loss, AMP, DDP, progress bar.

    ``defaults``: defaults (by destination, e.g. ``{"lr": 5e-3}``) that replace those of ``TRAINING_DEFAULTS``.

    Example::

        >>> p = ArgumentParser("Train.")
        >>> add_training_options(p, epochs=100, time_budget=210.0)
        >>> args = p.parse_args(["--lr", "0.005"])
        >>> args.lr, args.epochs, args.schedule
        (0.005, 100, 'cosine')
    """
    d = _defaults(defaults, TRAINING_DEFAULTS)
    p.add_argument("--epochs", type=positive_int, default=epochs, help=f"at most this many epochs (default {epochs})")
    p.add_argument("--batch-size", type=positive_int, default=d["batch_size"],
                   help=f"structures per batch (per process with --ddp; default {d['batch_size']})")
    p.add_argument("--time-budget", type=non_negative_float, default=time_budget, metavar="SECONDS",
                   help="stop training after this many seconds, 0 for no limit (the learning rate schedule "
                        f"follows the time; default {time_budget:g})")
    p.add_argument("--lr", type=positive_float, default=d["lr"], help=f"Adam learning rate (default {d['lr']:g})")
    p.add_argument("--schedule", choices=SCHEDULES, default=d["schedule"],
                   help="learning rate: cosine decay to 0 over the epochs (or the time budget), "
                        f"halving on a plateau of the training loss, or constant (default {d['schedule']})")
    p.add_argument("--force-weight", type=non_negative_float, default=d["force_weight"],
                   help=f"weight of the force term (default {d['force_weight']:g})")
    p.add_argument("--energy-weight", type=non_negative_float, default=d["energy_weight"],
                   help=f"weight of the energy-per-atom term (default {d['energy_weight']:g})")
    p.add_argument("--loss", choices=LOSSES, default=d["loss"],
                   help="penalty of every error (in units of the energy scale): its square, or the Huber penalty, "
                        "the absolute error smoothed within --huber-delta (e3attn.train.loss_fn; default "
                        f"{d['loss']})")
    p.add_argument("--huber-delta", type=positive_float, default=d["huber_delta"],
                   help="with --loss huber: the error, in units of the energy scale, below which the penalty is "
                        f"quadratic (default {d['huber_delta']:g})")
    p.add_argument("--energy-scale", choices=ENERGY_SCALES, default=d["energy_scale"],
                   help="unit of the model's output energy: the RMS force component (times 1 Angstrom) or the "
                        "standard deviation of the energy per atom after the per-element references "
                        f"(default {d['energy_scale']})")
    p.add_argument("--ema", type=fraction, default=d["ema"], metavar="DECAY",
                   help="validate, keep and save an exponential moving average of the weights, updated after every "
                        f"step with this decay (0: the weights themselves; default {d['ema']:g})")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast (CUDA only)")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel; launch with torchrun")
    p.add_argument("--compile", nargs="?", type=compile_choice, const="on", default="auto", metavar="{auto,on,off}",
                   help="trace each step (loss and weight gradients, forces included) into one graph and compile it "
                        "(e3attn.train.compiled.CompiledStep): faster steps after a first one of minutes; the last, "
                        "smaller batch of an epoch is left out; energies and forces only, not with --ddp or --amp. "
                        "auto (the default): eager steps for the first epoch, compiled ones after it on a CPU where "
                        f"the training left would take at least {AUTO_COMPILE_SECONDS:g} s (e3attn.train.compiled."
                        "auto_compile); "
                        "--compile alone: on")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def check_files(p: argparse.ArgumentParser, inputs: Mapping[str, Any] = {}, outputs: Mapping[str, Any] = {},
                figures: Mapping[str, Any] = {}, results: Mapping[str, Any] = {}, read_now: bool = True) -> None:
    """Check, before any work, the files that options name (``{"--option": path or None}``): ``inputs`` must be
    files (with ``read_now=False`` only where they exist: their reader names a missing one); ``outputs`` must not
    be folders and their folder must exist; ``results`` and ``figures`` (their folders are created) must not be
    folders, nor be in a folder that is a file, and figures must have a suffix matplotlib writes (or none: PNG); no
    output may be an input or another output, which it would overwrite. A problem is one line (``p.error``), exit
    status 2.

    Example::

        >>> p = ArgumentParser("Train.")
        >>> check_files(p, outputs={"--save": "model.pt"}, figures={"--out": "parity.png"})
    """
    seen: Dict[str, str] = {}
    for option, path in inputs.items():
        if path is None:
            continue
        if not os.path.isfile(path) and (read_now or os.path.exists(path)):
            p.error(f"argument {option}: {str(path)!r} is a folder" if os.path.isdir(path) else
                    f"argument {option}: no such file {str(path)!r}")
        seen[os.path.realpath(path)] = option
    written = {**{k: (v, "output") for k, v in outputs.items()}, **{k: (v, "figure") for k, v in figures.items()},
               **{k: (v, "result") for k, v in results.items()}}
    for option, (path, kind) in written.items():
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            p.error(f"argument {option}: {str(path)!r} is a folder")
        above = folder
        while not os.path.exists(above):  # the first folder above that exists must be a folder
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            p.error(f"argument {option}: {above!r} is a file, not a folder")
        if kind == "output" and not os.path.isdir(folder):
            p.error(f"argument {option}: the folder {folder!r} does not exist")
        if kind == "figure" and os.path.splitext(str(path))[1]:
            from matplotlib.backend_bases import FigureCanvasBase

            suffix, formats = os.path.splitext(str(path))[1][1:].lower(), FigureCanvasBase.get_supported_filetypes()
            if suffix not in formats:
                p.error(f"argument {option}: matplotlib cannot write .{suffix} figures (it writes "
                        f"{', '.join(sorted(formats))})")
        other = seen.setdefault(os.path.realpath(path), option)
        if other != option:
            p.error(f"argument {option}: {str(path)!r} is the file of {other}: it would be overwritten; write to "
                    "another file")


def amp_only_on_cuda(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``amp`` switched off, and a warning, unless ``args.device`` is a CUDA device.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     amp_only_on_cuda(argparse.Namespace(amp=True, device="cpu")).amp
        False
    """
    if args.amp and not args.device.startswith("cuda"):
        warnings.warn("--amp needs a CUDA device: running in float32 on the CPU", stacklevel=3)
        args.amp = False
    return args


def compile_choice(value: str) -> str:
    """``--compile``: ``auto``, ``on`` or ``off`` (``true`` and ``false``, as a YAML config gives them, are on and
    off), in any case.

    Example::

        >>> compile_choice("True"), compile_choice("auto")
        ('on', 'auto')
    """
    choice = {"true": "on", "false": "off"}.get(value.lower(), value.lower())
    if choice not in ("auto", "on", "off"):
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {value!r}")
    return choice


def check_compile(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--compile on`` (where ``args`` has it) only without ``--ddp`` and ``--amp``: one line (``p.error``) else
    (``auto`` leaves the steps eager there)."""
    if getattr(args, "compile", False) in (True, "on"):
        for option in ("ddp", "amp"):
            if getattr(args, option, False):
                p.error(f"argument --compile: not with --{option} (a compiled step has no DDP hooks nor autocast)")
