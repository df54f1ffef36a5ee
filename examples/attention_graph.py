"""What does an equivariant attention model attend to? Record, inspect and plot it.

Runs two :class:`~e3attn.attention.EquivariantAttention` layers on ethanol, records the
attention of both with :func:`~e3attn.viz.record_attention` (the model is not modified)
and writes three figures into ``--out``:

* ``heatmap.png``: the attention matrix of the last layer, one panel per head
  (row = query atom, column = key atom);
* ``attention_3d.png``: the last layer's attention graph drawn on the real 3-D geometry,
  edges coloured and thickened by weight;
* ``rollout.png``: the attention rollout through the first layer and through both.

It also prints the atoms ranked by PageRank on the reversed attention graph (how much
each atom serves as a source of information). The model is untrained, so the
attention mostly reflects geometry (the smooth cutoff) and the random initialisation;
the same calls apply unchanged to a trained model.

Run::

    python examples/attention_graph.py --out attention_graph_out
"""
from __future__ import annotations

import argparse
import pathlib
from typing import Dict, List, Optional

import torch

from e3attn.attention import EquivariantAttention
from e3attn.viz import (
    attention_centrality,
    attention_matrix,
    plot_attention_graph,
    plot_attention_heatmap,
    plot_rollout,
    record_attention,
)

import _common  # examples/_common.py: the script's folder is on sys.path

# Ethanol (CH3-CH2-OH), coordinates in angstrom.
SYMBOLS = ["C", "C", "O", "H", "H", "H", "H", "H", "H"]
POSITIONS = [
    [0.0072, -0.5687, 0.0000],
    [-1.2854, 0.2499, 0.0000],
    [1.1304, 0.3147, 0.0000],
    [1.9184, -0.2380, 0.0000],
    [0.0392, -1.1972, 0.8900],
    [0.0392, -1.1972, -0.8900],
    [-1.3175, 0.8784, 0.8929],
    [-1.3175, 0.8784, -0.8929],
    [-2.1422, -0.4239, 0.0000],
]
ELEMENTS = ["H", "C", "O"]


class TwoLayerAttention(torch.nn.Module):
    """Two stacked attention layers with a residual connection on the second."""

    def __init__(self, hidden: str, lmax: int, max_radius: float, num_heads: int) -> None:
        super().__init__()
        scalars = f"{len(ELEMENTS)}x0e"
        self.first = EquivariantAttention(scalars, hidden, hidden, hidden, max_radius, lmax=lmax, num_heads=num_heads)
        self.second = EquivariantAttention(hidden, hidden, hidden, hidden, max_radius, lmax=lmax, num_heads=num_heads)

    def forward(self, f: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.first(f, pos)
        return h + self.second(h, pos)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = _common.ArgumentParser(__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("attention_graph_out"),
                        help="folder for the three figures (default: attention_graph_out)")
    parser.add_argument("--device", type=_common.device, default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--heads", type=_common.positive_int, default=2,
                        help="attention heads (default: 2; must divide 4, or 2 with --smoke)")
    parser.add_argument("--max-radius", type=_common.positive_float, default=2.5,
                        help="attention cutoff in angstrom (default: 2.5)")
    parser.add_argument("--seed", type=_common.non_negative_int, default=0, help="random seed (default: 0)")
    parser.add_argument("--smoke", action="store_true", help="small layers and low-resolution figures (for tests)")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {str(args.out)!r} is a file: --out names the folder of the three figures")
    smallest = 2 if args.smoke else 4  # the smallest multiplicity of the hidden irreps
    if smallest % args.heads:
        parser.error(f"--heads {args.heads} must divide {smallest}, the smallest multiplicity of the hidden irreps")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, pathlib.Path]:
    """Run the example; returns the paths of the written figures."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    hidden, lmax, dpi = ("4x0e + 2x1o", 1, 60) if args.smoke else ("16x0e + 8x1o + 4x2e", 2, 150)
    model = TwoLayerAttention(hidden, lmax, args.max_radius, args.heads).to(device)
    pos = torch.tensor(POSITIONS, device=device)
    species = torch.tensor([ELEMENTS.index(symbol) for symbol in SYMBOLS], device=device)
    f = torch.nn.functional.one_hot(species, len(ELEMENTS)).to(pos.dtype)
    labels = [f"{symbol}{i}" for i, symbol in enumerate(SYMBOLS)]

    with torch.no_grad(), record_attention(model) as records:
        model(f, pos)
    last = records[-1]
    num_nodes = len(SYMBOLS)

    args.out.mkdir(parents=True, exist_ok=True)
    figures = {
        "heatmap": plot_attention_heatmap(attention_matrix(last.edge_index, last.alpha, num_nodes), labels),
        "attention_3d": plot_attention_graph(last.edge_index, last.alpha, pos, node_labels=labels),
        "rollout": plot_rollout(records, num_nodes, labels=labels),
    }
    paths = {}
    for name, figure in figures.items():
        paths[name] = args.out / f"{name}.png"
        _common.save_figure(figure, paths[name], dpi=dpi)

    rank = attention_centrality(last.edge_index, last.alpha, num_nodes, reverse=True)["pagerank"]
    order = torch.argsort(rank, descending=True).tolist()
    print(f"recorded {len(records)} layers: {', '.join(record.name for record in records)}")
    print("atoms by PageRank as attention sources: " + ", ".join(f"{labels[i]} {rank[i]:.3f}" for i in order))
    for path in paths.values():
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
