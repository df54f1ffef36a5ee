"""Helpers shared by the examples: command-line options, devices, seeds, figures."""
import argparse
import os
import pathlib

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every example has: --device, --seed, --smoke, --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a few steps on tiny data (for the test suite)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="where to save the figure (PNG)")
    return p


def figure_path(out, default: str) -> pathlib.Path:
    """``out``, or ``default`` in the working directory; the parent folder is created."""
    path = pathlib.Path(out) if out is not None else pathlib.Path(default)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def pyplot():
    """matplotlib.pyplot with a non-interactive backend (no display needed)."""
    import matplotlib

    if "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
