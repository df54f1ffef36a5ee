"""Independent references for the tests: brute force, loops and e3nn's own modules (never e3attn's code paths)."""
import math

import torch
from e3nn import o3
from e3nn.math import soft_one_hot_linspace, soft_unit_step


def brute_force_edges(pos: torch.Tensor, r_max: float, batch=None) -> torch.Tensor:
    """All (src, dst) pairs with src != dst and |pos[src] - pos[dst]| < r_max in the same graph, sorted by dst then src."""
    n = pos.shape[0]
    edges = []
    for dst in range(n):
        for src in range(n):
            same = batch is None or int(batch[src]) == int(batch[dst])
            if src != dst and same and float((pos[src] - pos[dst]).norm()) < r_max:
                edges.append((src, dst))
    return torch.tensor(edges, dtype=torch.long).reshape(-1, 2).T.contiguous()


def e3nn_guide_attention(layer, f, pos, edge_index):
    """The e3nn guide's attention (seed 003) built from e3nn modules with ``layer``'s weights, heads in a loop.

    Softmax and aggregation are written as explicit per-node loops. Float64 only.
    Returns ``(out, alpha [E, H])``.
    """
    src, dst = edge_index
    n, heads = pos.shape[0], layer.num_heads
    irreps_sh = o3.Irreps.spherical_harmonics(layer.irreps_sh.lmax)
    edge_vec = pos[src] - pos[dst]
    r = edge_vec.norm(dim=1)
    nb = layer.embedding.number_of_basis
    emb = soft_one_hot_linspace(r, 0.0, layer.max_radius, nb, "smooth_finite", True) * math.sqrt(nb)
    sh = o3.spherical_harmonics(irreps_sh, edge_vec, True, normalization="component")

    tp_k = o3.FullyConnectedTensorProduct(layer.irreps_input, irreps_sh, layer.irreps_key, shared_weights=False)
    tp_v = o3.FullyConnectedTensorProduct(layer.irreps_input, irreps_sh, layer.irreps_output, shared_weights=False)
    w_k, w_v = layer.radial(emb)  # the radial MLPs themselves are checked separately

    def e3nn_weights(w, t):
        index = layer.tp.e3nn_weight_index(t)
        out = torch.zeros(w.shape[0], index.numel(), dtype=w.dtype)
        out[:, index] = w
        return out

    k = tp_k(f[src], sh, e3nn_weights(w_k, 0))
    v = tp_v(f[src], sh, e3nn_weights(w_v, 1))
    h_q = o3.Linear(layer.irreps_input, layer.irreps_query)
    with torch.no_grad():
        h_q.weight.copy_(layer.query.weight)
    q = h_q(f)

    def head_slice(irreps, x, h):
        """Channels of head h of every irrep of x."""
        parts, start = [], 0
        for mul, ir in irreps:
            block = x[:, start : start + mul * ir.dim].reshape(-1, mul, ir.dim)
            m = mul // heads
            parts.append(block[:, h * m : (h + 1) * m].reshape(-1, m * ir.dim))
            start += mul * ir.dim
        return torch.cat(parts, dim=1)

    def head_irreps(irreps):
        return o3.Irreps([(mul // heads, ir) for mul, ir in irreps])

    cut = soft_unit_step(10 * (1 - r / layer.max_radius))
    out = torch.zeros(n, layer.irreps_output.dim, dtype=f.dtype)
    alphas = []
    for h in range(heads):
        dot = o3.FullyConnectedTensorProduct(head_irreps(layer.irreps_query), head_irreps(layer.irreps_key), "0e")
        with torch.no_grad():
            dot.weight.copy_(layer.dot.weight[h])
        logit = dot(head_slice(layer.irreps_query, q, h)[dst], head_slice(layer.irreps_key, k, h))[:, 0]
        alpha = torch.zeros_like(logit)
        for i in range(n):
            mask = dst == i
            if mask.any():
                e = cut[mask] * torch.exp(logit[mask] - logit[mask].max())
                alpha[mask] = e / e.sum() if e.sum() > 0 else 0 * e
        alphas.append(alpha)
        coeff = alpha.sqrt() if layer.aggregation == "sqrt_alpha" else alpha
        v_h = head_slice(layer.irreps_output, v, h)
        for e in range(src.shape[0]):
            out[int(dst[e])] += coeff[e] * _scatter_head(layer.irreps_output, v_h[e], h, heads)
    return out, torch.stack(alphas, dim=1)


def _scatter_head(irreps, v_head, h, heads):
    """Place one head's channels ``v_head`` back at their positions in the full irreps layout."""
    full = torch.zeros(irreps.dim, dtype=v_head.dtype)
    start, pos = 0, 0
    for mul, ir in irreps:
        m = mul // heads
        full[start + h * m * ir.dim : start + (h + 1) * m * ir.dim] = v_head[pos : pos + m * ir.dim]
        start += mul * ir.dim
        pos += m * ir.dim
    return full
