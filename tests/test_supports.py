"""Supports: the attention told in which irreps its input can be non-zero and which irreps of its output are read
(``input_support``, ``output_support``) skips the paths and values outside them on its kernels, and
:class:`~e3attn.models.EquivariantTransformer` sets them for its first and last blocks. Compared with the full
computation in float64: the restricted layouts' path features, the layer on both backends (values, forces and
the gradients of a force loss) and whole models (energies, forces, parameter gradients)."""
import pytest
import torch

import e3attn.models.transformer as transformer
from e3attn import EquivariantAttention, kernels
from e3attn.kernels import segment_ops
from e3attn.kernels.layout import component_major_paths, layout_for, restricted_spec
from e3attn.models import EquivariantTransformer
from e3attn.tensor_product import SphericalTensorProduct
from kernel_switch import plain

IRREPS = "4x0e + 2x1o + 2x1e"
OUTPUT = "4x0e + 2x1o + 2x0e + 2x1e"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("inputs, groups", [([0], [0]), ([0, 2], [0, 1]), ([1], [1, 2]), ([0, 1, 2], [2])])
def test_restricted_path_features_are_the_kept_columns_of_the_product(float64_default, inputs, groups):
    """Every path of a restricted layout equals its path of the whole product, with the dropped inputs zero; the
    layout names every kept path's row of the weights."""
    tp = SphericalTensorProduct("3x0e + 2x1o + 1x2e", "1x0e + 1x1o + 1x2e", ["2x0e + 2x1o", "4x0e + 2x1o + 2x2e"])
    gen = torch.Generator().manual_seed(0)
    x, sh = torch.randn(5, tp.irreps_in.dim, generator=gen), torch.randn(9, 9, generator=gen)
    index = torch.randint(0, 5, (9,), generator=gen)
    spec = restricted_spec(tp._spec, inputs, groups)
    full, kept = layout_for(tp._spec), layout_for(spec)
    dropped = torch.ones(tp.irreps_in.dim, dtype=torch.bool)
    starts = [0]
    for mul, ir in tp.irreps_in:
        starts.append(starts[-1] + mul * ir.dim)
    for a in inputs:
        dropped[starts[a] : starts[a + 1]] = False
    y_full = segment_ops.path_features(tp._spec, x.masked_fill(dropped, 0.0), index, sh)
    y_kept = segment_ops.path_features(spec, x, index, sh)

    full_column, kept_column = component_major_paths(tp._spec)[0], component_major_paths(spec)[0]
    row, checked = 0, set()
    for block in kept.blocks.tolist():
        output, offset, k, dim_l, _, weight_offset, _ = block
        rows = kept.rows[row : row + k]
        row += k
        # the same block of the whole product: the same output and weights
        same = [b for b in full.blocks.tolist() if (b[0], b[5]) == (output, weight_offset)]
        assert len(same) == 1 and same[0][3] == dim_l
        for kk, full_row in enumerate(rows.tolist()):
            for m in range(dim_l):
                got = y_kept[:, kept_column[offset + kk * dim_l + m]]
                want = y_full[:, full_column[same[0][1] + full_row * dim_l + m]]
                torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
                checked.add(offset + kk * dim_l + m)
    assert checked == set(range(kept.num_paths)) and 0 < kept.num_paths < full.num_paths
    assert not y_kept[:, kept.num_paths:].any()  # the padding


def _layer(input_support=None, output_support=None, seed=0):
    torch.manual_seed(seed)
    return EquivariantAttention(IRREPS, IRREPS, IRREPS, OUTPUT, 1.3, lmax=2, num_heads=2,
                                input_support=input_support, output_support=output_support)


def _force_step(layer, f, pos):
    """The output, the gradient of a loss in the positions (forces) and the gradients of a force loss in
    every parameter (second derivatives)."""
    pos = pos.clone().requires_grad_(True)
    out = layer(f, pos)
    grad, = torch.autograd.grad(out.pow(2).sum(), pos, create_graph=True)
    params = list(layer.parameters())
    second = torch.autograd.grad(grad.pow(2).sum(), params, allow_unused=True)
    return out.detach(), grad.detach(), [torch.zeros_like(p) if s is None else s for p, s in zip(params, second)]


@pytest.mark.parametrize("input_support, output_support", [("0e", "0e"), ("0e", None), (None, "0e"),
                                                           ("0e + 1e", "1o"), ("1o", None)])
def test_layer_with_supports_equals_the_whole_layer(float64_default, input_support, output_support):
    """On the kernels (with the input non-zero outside its support: ignored) and on the plain formulation, equal
    to the layer without supports on the input zeroed outside the support, its output zeroed outside its own."""
    whole, layer = _layer(), _layer(input_support, output_support)
    layer.load_state_dict(whole.state_dict())
    gen = torch.Generator().manual_seed(1)
    pos, f = torch.randn(30, 3, generator=gen), torch.randn(30, whole.irreps_input.dim, generator=gen)
    f_in = f if layer._input_off is None else f.masked_fill(layer._input_off, 0.0)
    want = _force_step(_Masked(whole, layer._output_off), f_in, pos)
    for got in (_force_step(layer, f, pos), plain(lambda: _force_step(layer, f, pos))):
        assert _relative(got[0], want[0]) < 1e-12
        assert _relative(got[1], want[1]) < 1e-12
        for g, w in zip(got[2], want[2]):
            assert _relative(g, w) < 1e-10
    assert kernels.segments_enabled(pos.device, pos.dtype)


class _Masked(torch.nn.Module):
    """A layer's output zeroed where ``off``."""

    def __init__(self, layer, off):
        super().__init__()
        self.layer, self.off = layer, off

    def forward(self, f, pos):
        out = self.layer(f, pos)
        return out if self.off is None else out.masked_fill(self.off, 0.0)


def test_layer_supports_are_checked_and_shown():
    layer = _layer("0e", "0e + 1o")
    assert "input_support=1x0e" in repr(layer) and "output_support=1x0e+1x1o" in repr(layer)
    assert _layer("0e + 1o + 1e", None).input_support is None  # covers every input irrep: no restriction
    with pytest.raises(ValueError, match="input_support"):
        _layer("scalars")
    with pytest.raises(ValueError, match="output_support"):
        _layer(None, "1x")
    with pytest.warns(UserWarning, match="output_support 1x2o shares no irrep"):  # a typo: the output all zero
        _layer(None, "2o")


def test_layer_with_supports_on_the_triton_kernels(float64_default):
    """The restricted layouts on the Triton backend (Triton's interpreter on the CPU): equal to the numba kernels."""
    pytest.importorskip("triton")
    layer = _layer("0e", "0e")
    gen = torch.Generator().manual_seed(2)
    pos, f = torch.randn(12, 3, generator=gen), torch.randn(12, layer.irreps_input.dim, generator=gen)
    want = _force_step(layer, f, pos)
    previous = kernels.set_cpu_backend("triton")
    try:
        got = _force_step(layer, f, pos)
    finally:
        kernels.set_cpu_backend(previous)
    assert _relative(got[0], want[0]) < 1e-12 and _relative(got[1], want[1]) < 1e-12
    for g, w in zip(got[2], want[2]):
        assert _relative(g, w) < 1e-10


def _model(supports: bool, irreps_in="1x0e", irreps_out="0e", **options):
    """A small energy model, with the transformer's supports or without any (the whole computation)."""
    chosen = transformer._supports if supports else (lambda *irreps: (None, None))
    original, transformer._supports = transformer._supports, chosen
    try:
        torch.manual_seed(3)
        return EquivariantTransformer(irreps_in, "8x0e + 4x1o + 4x1e", irreps_out, 2.0, irreps_node_attr="3x0e",
                                      reduce="sum", lmax=2, num_heads=2, density_channels=4, **options)
    finally:
        transformer._supports = original


@pytest.mark.parametrize("options", [dict(num_layers=1), dict(num_layers=2), dict(num_layers=2, layer_norm="pre"),
                                     dict(num_layers=3, self_connection="node_attr", layer_norm="none")])
def test_model_with_supports_equals_the_whole_model(float64_default, options):
    """Energies, forces and the gradients of a force-training loss in every parameter, to rounding."""
    fast, whole = _model(True, **options), _model(False, **options)
    whole.load_state_dict(fast.state_dict())
    layers = fast.layers
    assert layers[0].attention.input_support == {(0, 1)} and layers[-1].attention.output_support == {(0, 1)}
    assert all(layer.attention.input_support is None for layer in layers[1:])
    assert all(layer.attention.output_support is None for layer in layers[:-1])
    gen = torch.Generator().manual_seed(4)
    pos = 1.5 * torch.randn(20, 3, generator=gen)
    attr = torch.nn.functional.one_hot(torch.randint(0, 3, (20,), generator=gen), 3).double()
    batch = torch.tensor([0] * 9 + [1] * 11)
    results = []
    for model in (fast, whole):
        p = pos.clone().requires_grad_(True)
        energy = model(p, node_attr=attr, batch=batch)
        forces, = torch.autograd.grad(-energy.sum(), p, create_graph=True)
        loss = forces.pow(2).sum() + energy.pow(2).sum()
        params = list(model.parameters())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        results.append((energy.detach(), forces.detach(),
                        [torch.zeros_like(q) if g is None else g for q, g in zip(params, grads)]))
    (e, f, g), (e0, f0, g0) = results
    assert _relative(e, e0) < 1e-12 and _relative(f, f0) < 1e-12
    for a, b in zip(g, g0):
        assert float((a - b).abs().max()) <= 1e-10 * max(float(b.abs().max()), 1e-3)


def test_model_supports_follow_its_inputs_and_outputs():
    """Vector inputs reach the first block; a vector output reads every irrep of the last block."""
    vectors = _model(True, irreps_in="1x0e + 1x1o", irreps_out="1x0e + 1x1o", num_layers=1)
    assert vectors.layers[0].attention.input_support == {(0, 1), (1, -1)}
    assert vectors.layers[0].attention.output_support is None


def test_a_support_that_keeps_no_path(float64_default):
    """An input support without any irrep of the input: the layer's output and its gradients are zero on both
    formulations (no path is left: the kernels run on empty layouts), and a model whose hidden irreps the embedding
    cannot reach runs, with the whole model's zero energy."""
    with pytest.warns(UserWarning, match=r"input_support 1x2e shares no irrep with .*the layer's output is zero"):
        layer = _layer("2e", None)
    pos = torch.randn(10, 3, generator=torch.Generator().manual_seed(6))
    f = torch.randn(10, layer.irreps_input.dim)
    for run in (lambda: _force_step(layer, f, pos), lambda: plain(lambda: _force_step(layer, f, pos))):
        out, grad, _ = run()
        assert not out.any() and not grad.any()
    with pytest.warns(UserWarning, match="input_support 1x0e shares no irrep with 2x0o"):
        model = EquivariantTransformer("1x0e", "2x0o + 2x1o", "0e", 2.0, reduce="sum", num_layers=2)
    assert model.layers[0].attention.input_support == {(0, 1)}  # none of the hidden irreps
    assert not model(pos).any()  # (nothing reaches the output from the positions either)


@pytest.mark.parametrize("nodes", [0, 1, 3])
def test_layer_with_supports_without_edges(float64_default, nodes):
    """No node, one node, nodes without edges: the output is zero and the forces are zero, on the kernels and on
    the plain formulation."""
    layer = _layer("0e", "0e")
    pos = 10.0 * torch.arange(3 * nodes, dtype=torch.float64).reshape(nodes, 3)  # further apart than the cutoff
    f = torch.randn(nodes, layer.irreps_input.dim)
    for run in (lambda: _force_step(layer, f, pos), lambda: plain(lambda: _force_step(layer, f, pos))):
        out, grad, _ = run()
        assert out.shape == (nodes, layer.irreps_output.dim) and not out.any() and not grad.any()
