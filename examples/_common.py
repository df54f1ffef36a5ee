"""Helpers shared by the examples: command-line options and their errors, devices, seeds, figures."""
import json
import os
import pathlib
import re

import torch

from e3attn._files import atomic_write
from e3attn.train import options
from e3attn.train.options import (  # noqa: F401  (the examples' option types, shared with e3attn-train)
    check_files, device, fail, irreps, non_negative_float, non_negative_int, positive_float, positive_int,
)

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`~a.b.C`, :math:`x`
_LATEX = {r"\partial ": "d", r"\partial": "d", r"\pm": "+-", r"\cdot": "*"}


def plain_text(doc: str) -> str:
    """``doc`` (a module docstring) without its reStructuredText markup, for ``--help``."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    text = text.replace("``", "").replace("::\n", ":\n")
    for latex, plain in _LATEX.items():
        text = text.replace(latex, plain)
    return text


class ArgumentParser(options.ArgumentParser):
    """argparse with a plain-text description (from a module docstring) and errors as one line with exit status 2."""

    def __init__(self, doc: str) -> None:
        super().__init__(plain_text(doc))


def parser(doc: str) -> ArgumentParser:
    """An argument parser with the options every training example has: --device, --seed, --smoke, --out."""
    p = ArgumentParser(doc)
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default: 0)")
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data (for the test suite)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="where to save the figure (PNG)")
    return p


def figure_name(out, default: str) -> pathlib.Path:
    """``out``, or ``default`` in the working directory."""
    return pathlib.Path(out) if out is not None else pathlib.Path(default)


def figure_path(out, default: str) -> pathlib.Path:
    """:func:`figure_name`, its parent folder created."""
    path = figure_name(out, default)
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
