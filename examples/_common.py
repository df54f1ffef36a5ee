"""Helpers shared by the examples: command-line options and their errors, devices, seeds, figures."""
import argparse
import json
import os
import pathlib
import re
import sys

import torch

from e3attn._files import atomic_write

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`~a.b.C`, :math:`x`
_LATEX = {r"\partial ": "d", r"\partial": "d", r"\pm": "+-", r"\cdot": "*"}


def plain_text(doc: str) -> str:
    """``doc`` (a module docstring) without its reStructuredText markup, for ``--help``."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    text = text.replace("``", "").replace("::\n", ":\n")
    for latex, plain in _LATEX.items():
        text = text.replace(latex, plain)
    return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a plain-text description and errors as one line with exit status 2."""

    def __init__(self, doc: str) -> None:
        super().__init__(description=plain_text(doc), formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(message: str):
    """Stop the script with one line on stderr and exit status 2 (a bad argument found after parsing)."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


_AVAILABLE = {  # without touching the device: no CUDA context is created while parsing (torchrun ranks)
    "cpu": lambda index: index in (None, 0),
    "cuda": lambda index: torch.cuda.is_available() and (index or 0) < torch.cuda.device_count(),
    "mps": lambda index: torch.backends.mps.is_available() and index in (None, 0),
}


def device(value: str) -> str:
    """argparse type: a torch device present on this machine (returned as given)."""
    try:
        parsed = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device (e.g. cuda, cuda:1); try --device cpu") from None
    if parsed.type not in _AVAILABLE or not _AVAILABLE[parsed.type](parsed.index):
        raise argparse.ArgumentTypeError(f"{value!r} is not available on this machine; try --device cpu")
    return value


def _number(convert, test, expected: str):
    def parse(value: str):
        try:
            number = convert(value)
        except ValueError:
            number = None
        if number is None or not test(number):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return number

    return parse


positive_int = _number(int, lambda n: n > 0, "a positive integer")
non_negative_int = _number(int, lambda n: n >= 0, "a non-negative integer")
positive_float = _number(float, lambda x: 0 < x < float("inf"), "a positive number")
non_negative_float = _number(float, lambda x: 0 <= x < float("inf"), "a non-negative number")


def irreps(value: str) -> str:
    """argparse type: e3nn irreps such as ``16x0e + 8x1o`` (returned as given)."""
    from e3nn import o3

    try:
        o3.Irreps(value)
    except (ValueError, AssertionError, TypeError):
        raise argparse.ArgumentTypeError(f"expected e3nn irreps such as '16x0e + 8x1o', got {value!r}") from None
    return value


def parser(doc: str) -> ArgumentParser:
    """An argument parser with the options every training example has: --device, --seed, --smoke, --out."""
    p = ArgumentParser(doc)
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default: 0)")
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data (for the test suite)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="where to save the figure (PNG)")
    return p


def figure_path(out, default: str) -> pathlib.Path:
    """``out``, or ``default`` in the working directory; the parent folder is created."""
    path = pathlib.Path(out) if out is not None else pathlib.Path(default)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, path, dpi: int = 120) -> None:
    """``fig`` saved to ``path`` (format from its suffix, PNG without one) atomically: a figure already there is
    replaced only once the new one is complete (e3attn's own writer of checkpoints)."""
    with atomic_write(path) as file:
        fig.savefig(file, format=pathlib.Path(path).suffix[1:] or "png", dpi=dpi)


def write_json(data, path) -> None:
    """``data`` written to ``path`` as indented JSON, atomically (see :func:`save_figure`)."""
    with atomic_write(path, "w") as file:
        json.dump(data, file, indent=1)


def pyplot():
    """matplotlib.pyplot with a non-interactive backend (no display needed)."""
    import matplotlib

    if "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
