r"""The e3nn guide's attention (seed document 003), multi-head, written from e3nn modules: the baseline of
``benchmarks/layer.py`` and of its peers (``benchmarks/peers.py``)."""
from __future__ import annotations

import torch
from e3nn import nn, o3
from e3nn.math import soft_one_hot_linspace, soft_unit_step

from e3attn.attention import EquivariantAttention

RADIUS = 1.0  # the cutoff of every benchmark case


class GuideAttention(torch.nn.Module):
    r"""The e3nn guide's attention, multi-head, from e3nn modules (the benchmark's baseline).

    .. math::

        \alpha_{e,h} = \frac{c_e \exp(\mathrm{dot}_h(q_i, k_e))}{\sum_{e' \to i} c_{e'} \exp(\mathrm{dot}_h(q_i, k_{e'}))},
        \qquad f'_i = \sum_{e \to i} \sqrt{\alpha_{e, h(\cdot)}}\, v_e

    with ``k = tp_k(f[src], Y, fc_k(emb))``, ``v = tp_v(f[src], Y, fc_v(emb))``, ``q = h_q(f)``.
    """

    def __init__(self, irreps_input, irreps_query, irreps_key, irreps_output, lmax: int, num_heads: int,
                 number_of_basis: int = 10, radial_neurons: int = 16) -> None:
        super().__init__()
        self.number_of_basis, self.num_heads = number_of_basis, num_heads
        self.irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        irreps_query, irreps_key, irreps_output = (o3.Irreps(i) for i in (irreps_query, irreps_key, irreps_output))
        self.h_q = o3.Linear(irreps_input, irreps_query)
        self.tp_k = o3.FullyConnectedTensorProduct(irreps_input, self.irreps_sh, irreps_key, shared_weights=False)
        self.fc_k = nn.FullyConnectedNet([number_of_basis, radial_neurons, self.tp_k.weight_numel], torch.nn.functional.silu)
        self.tp_v = o3.FullyConnectedTensorProduct(irreps_input, self.irreps_sh, irreps_output, shared_weights=False)
        self.fc_v = nn.FullyConnectedNet([number_of_basis, radial_neurons, self.tp_v.weight_numel], torch.nn.functional.silu)
        per_head = [o3.Irreps([(mul // num_heads, ir) for mul, ir in irreps]) for irreps in (irreps_query, irreps_key)]
        self.dots = torch.nn.ModuleList([o3.FullyConnectedTensorProduct(*per_head, "0e") for _ in range(num_heads)])
        for name, irreps in (("query", irreps_query), ("key", irreps_key), ("output", irreps_output)):
            self.register_buffer(f"{name}_channels", _head_channels(irreps, num_heads), persistent=False)

    def forward(self, f: torch.Tensor, pos: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        edge_vec = pos[src] - pos[dst]
        r = edge_vec.norm(dim=1)
        emb = soft_one_hot_linspace(r, 0.0, RADIUS, self.number_of_basis, "smooth_finite", True)
        emb = emb.mul(self.number_of_basis**0.5)
        sh = o3.spherical_harmonics(self.irreps_sh, edge_vec, True, normalization="component")
        cutoff = soft_unit_step(10 * (1 - r / RADIUS))
        q = self.h_q(f)
        k = self.tp_k(f[src], sh, self.fc_k(emb))
        v = self.tp_v(f[src], sh, self.fc_v(emb))
        logits = [dot(q[:, qc][dst], k[:, kc]) for dot, qc, kc in zip(self.dots, self.query_channels, self.key_channels)]
        exp = cutoff[:, None] * torch.cat(logits, dim=1).exp()  # [E, H]
        z = exp.new_zeros(f.shape[0], self.num_heads).index_add(0, dst, exp)
        z[z == 0] = 1
        alpha = exp / z[dst]
        weight = torch.zeros_like(v)
        for h, channels in enumerate(self.output_channels):
            weight[:, channels] = alpha[:, h : h + 1].relu().sqrt()
        return v.new_zeros(f.shape[0], v.shape[1]).index_add(0, dst, weight * v)

    def copy_from(self, layer: EquivariantAttention) -> None:
        """Take ``layer``'s weights (same function up to e3nn's normalisation constant of silu)."""
        hidden = layer.radial.hidden
        with torch.no_grad():
            self.h_q.weight.copy_(layer.query.weight)
            for t, (tp, fc) in enumerate(((self.tp_k, self.fc_k), (self.tp_v, self.fc_v))):
                fc.layer0.weight.copy_(layer.radial.weight1[:, t * hidden : (t + 1) * hidden])
                index = layer.tp.e3nn_weight_index(t)
                fc.layer1.weight[:, index] = layer.radial.weight2[t]
            for h, dot in enumerate(self.dots):
                dot.weight.copy_(layer.dot.weight[h])


def _head_channels(irreps: o3.Irreps, num_heads: int) -> torch.Tensor:
    """``[H, dim / H]``: the channels of every head (each irrep's multiplicity split in ``H`` blocks)."""
    heads, start = [[] for _ in range(num_heads)], 0
    for mul, ir in irreps:
        block = torch.arange(start, start + mul * ir.dim).reshape(num_heads, -1)
        for h in range(num_heads):
            heads[h].append(block[h])
        start += mul * ir.dim
    return torch.stack([torch.cat(h) for h in heads])
