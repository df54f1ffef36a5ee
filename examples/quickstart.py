"""Quickstart: the e3nn guide's attention scenario with e3attn.

Three random graphs of 20 points each, features ``10x0e + 5x1o``, the layer of
the e3nn guide (queries ``11x0e + 4x1o``, keys ``12x0e + 3x1o``, outputs
``14x0e + 6x1o``, cutoff 1.3). Prints the output statistics (the guide's check
that the sqrt(alpha) weighting keeps them of order one) and the measured O(3)
equivariance error in float32 and float64.

    python examples/quickstart.py [--device cuda] [--seed 0]
"""
import torch

import e3attn
from e3attn.testing import equivariance_error

import _common  # examples/_common.py: the script's folder is on sys.path


def main(argv=None) -> dict:
    parser = _common.ArgumentParser(__doc__)
    parser.add_argument("--device", type=_common.device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--seed", type=_common.non_negative_int, default=0, help="random seed (default: 0)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    num_graphs, num_nodes = 3, 20
    layer = e3attn.EquivariantAttention(
        "10x0e + 5x1o", "11x0e + 4x1o", "12x0e + 3x1o", "14x0e + 6x1o", max_radius=1.3
    ).to(args.device)
    pos = torch.randn(num_graphs * num_nodes, 3, device=args.device)
    f = layer.irreps_input.randn(num_graphs * num_nodes, -1).to(args.device)
    batch = torch.arange(num_graphs * num_nodes, device=args.device) % num_graphs

    out, alpha = layer(f, pos, batch=batch, return_attention=True)
    edge_index = e3attn.radius_graph(pos, layer.max_radius, batch)
    print(f"layer: {layer.irreps_input} -> {layer.irreps_output}, {sum(p.numel() for p in layer.parameters())} parameters")
    print(f"graph: {num_graphs} graphs x {num_nodes} nodes, {edge_index.shape[1]} edges (cutoff {layer.max_radius})")
    print(f"output: shape {tuple(out.shape)}, mean {out.mean().item():+.4f}, std {out.std().item():.4f}")

    results = {"mean": out.mean().item(), "std": out.std().item(), "num_edges": edge_index.shape[1]}
    for dtype in (torch.float32, torch.float64):
        model = layer.to(dtype)
        errors = equivariance_error(
            lambda pos, f: model(f, pos, batch=batch),
            [pos.to(dtype), f.to(dtype)],
            ["cartesian_points", layer.irreps_input],
            [layer.irreps_output],
            ntrials=3,
        )
        worst = max(e for errs in errors.values() for e in errs)
        results[f"equivariance_error_{str(dtype)[6:]}"] = worst
        print(f"O(3) + translation equivariance error ({str(dtype)[6:]}): {worst:.2e}")
    return results


if __name__ == "__main__":
    main()
