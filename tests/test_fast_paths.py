"""Fast paths equal the straightforward formulation (e3nn modules, loops), values and gradients, in float64."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from e3nn import o3

from e3attn.attention import EquivariantAttention
from e3attn.heads import head_index, scale_heads
from e3attn.spherical_harmonics import SphericalHarmonics
from e3attn import kernels, tensor_product
from e3attn.tensor_product import SphericalTensorProduct
from kernel_switch import plain
from reference import brute_force_edges, e3nn_guide_attention

ROOT = Path(__file__).resolve().parents[1]

TP_CASES = [
    ("10x0e + 5x1o", 3, ["12x0e + 3x1o", "14x0e + 6x1o"]),  # the guide's keys and values
    ("2x0e + 1x0o + 3x1e + 2x2o + 1x0e", 2, ["3x1o + 2x0e + 1x2e + 2x0e", "1x3o + 2x0o"]),  # repeated degrees
    ("4x1o", 0, ["2x1o + 3x0e"]),  # 3x0e is reached by no path
    ("3x0e + 2x1o + 1x2e", 2, ["4x0e + 2x1o + 2x2e"]),
]


def _e3nn_products(tp, x, sh, weights):
    """The tensor products with e3nn's FullyConnectedTensorProduct (weights mapped to e3nn's order)."""
    outs = []
    for t, (irreps_out, w) in enumerate(zip(tp.irreps_outs, weights)):
        ref = o3.FullyConnectedTensorProduct(tp.irreps_in, tp.irreps_sh, irreps_out, shared_weights=False)
        e3nn_w = torch.zeros(w.shape[0], ref.weight_numel, dtype=w.dtype).index_copy(1, tp.e3nn_weight_index(t), w)
        outs.append(ref(x, sh, e3nn_w))
    return outs


def _inputs(tp, num, nodes=None, hidden=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(nodes or num, tp.irreps_in.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    sh = torch.randn(num, tp.irreps_sh.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    hs = [torch.randn(num, hidden, generator=gen, dtype=torch.float64, requires_grad=True) for _ in tp.irreps_outs]
    ls = [torch.randn(hidden, n, generator=gen, dtype=torch.float64, requires_grad=True) for n in tp.weight_numel]
    return x, sh, hs, ls


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("irreps_in, lmax, outs", TP_CASES)
def test_factored_product_equals_e3nn(irreps_in, lmax, outs, gathered, float64_default):
    tp = SphericalTensorProduct(irreps_in, o3.Irreps.spherical_harmonics(lmax), outs)
    num = 13
    x, sh, hs, ls = _inputs(tp, num, nodes=6 if gathered else None)
    index = torch.randint(0, 6, (num,), generator=torch.Generator().manual_seed(1)) if gathered else None
    got = tp.forward_factored(x, sh, hs, ls, index=index)
    ref = _e3nn_products(tp, x[index] if gathered else x, sh, [h @ w for h, w in zip(hs, ls)])
    cotangents = [torch.randn_like(r) for r in ref]
    inputs = [x, sh, *hs, *ls]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    for a, b in zip(torch.autograd.grad(got, inputs, cotangents), torch.autograd.grad(ref, inputs, cotangents)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_factored_product_empty_and_single_sample(float64_default):
    tp = SphericalTensorProduct("3x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["2x0e + 1x1o", "1x0e"])
    for num in (0, 1):
        x, sh, hs, ls = _inputs(tp, num, nodes=4)
        index = torch.zeros(num, dtype=torch.long)
        got = tp.forward_factored(x, sh, hs, ls, index=index)
        assert [o.shape for o in got] == [(num, 5), (num, 1)]
        ref = _e3nn_products(tp, x[index], sh, [h @ w for h, w in zip(hs, ls)])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        grads = torch.autograd.grad([o.sum() for o in got], [x, sh, *hs, *ls])
        assert all(torch.isfinite(g).all() for g in grads)
        if num == 0:
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_factored_product_is_twice_differentiable(float64_default):
    tp = SphericalTensorProduct("1x0e + 1x1o", o3.Irreps.spherical_harmonics(1), ["1x0e + 1x1o"])
    x, sh, hs, ls = _inputs(tp, 4, hidden=2)

    def fn(x, sh, h, w):
        return tp.forward_factored(x, sh, [h], [w])[0]

    assert torch.autograd.gradcheck(fn, (x, sh, hs[0], ls[0]))
    assert torch.autograd.gradgradcheck(fn, (x, sh, hs[0], ls[0]))


def test_factored_product_bad_arguments():
    tp = SphericalTensorProduct("1x0e", o3.Irreps.spherical_harmonics(1), ["1x0e", "1x1o"])
    x, sh, hs, ls = torch.randn(3, 1), torch.randn(3, 4), [torch.randn(3, 2)] * 2, [torch.randn(2, 1), torch.randn(2, 1)]
    with pytest.raises(ValueError, match="one tensor per output"):
        tp.forward_factored(x, sh, hs[:1], ls)


def test_factored_product_chunk_size_is_deprecated_and_ignored():
    tp = SphericalTensorProduct("2x0e", o3.Irreps.spherical_harmonics(1), ["1x0e"])
    x, sh, h = torch.randn(3, 2), torch.randn(3, 4), torch.randn(3, 2)
    lin = torch.randn(2, tp.weight_numel[0])
    with pytest.warns(DeprecationWarning, match="chunk_size"):
        out = tp.forward_factored(x, sh, [h], [lin], chunk_size=64)
    assert torch.equal(out[0], tp.forward_factored(x, sh, [h], [lin])[0])


@pytest.mark.parametrize("lmax", [0, 1, 2, 3, 4, 5, 6])
def test_spherical_harmonics_equal_e3nn(lmax, float32_default):
    sh = SphericalHarmonics(lmax).double()  # built under float32: the constants must stay exact
    ref = o3.SphericalHarmonics(o3.Irreps.spherical_harmonics(lmax), normalize=True, normalization="component")
    gen = torch.Generator().manual_seed(lmax)
    length = 5 * torch.rand(2, 40, 1, generator=gen, dtype=torch.float64)
    vec = torch.randn(2, 40, 3, generator=gen, dtype=torch.float64) * length
    vec[0, 0] = 0.0  # the zero vector, as e3nn: normalised to 0
    vec.requires_grad_()
    got, expected = sh(vec), ref(vec)
    assert got.shape == (2, 40, (lmax + 1) ** 2)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    if lmax == 0:  # constant: no gradient
        return
    cotangent = torch.randn(got.shape, generator=gen, dtype=got.dtype)  # not the global RNG: the same every run
    g_got, g_ref = torch.autograd.grad(got, vec, cotangent)[0], torch.autograd.grad(expected, vec, cotangent)[0]
    torch.testing.assert_close(g_got, g_ref, atol=1e-10, rtol=1e-12)


def _derivatives(fn, vec, cotangent, direction):
    """``fn(vec)``, the gradient of ``<c, fn>`` with create_graph (forces; the cotangent ``c = cotangent * t``
    depends on a leaf ``t``, as a force step's does on the parameters), that gradient's derivatives along
    ``direction`` in ``vec`` and ``t`` without create_graph (a force-training step's second derivative) and,
    with it, differentiated once more."""
    vec, scale = vec.detach().requires_grad_(), torch.ones_like(cotangent).requires_grad_()
    y = fn(vec)
    (g1,) = torch.autograd.grad(y, vec, cotangent * scale, create_graph=True)
    g2 = torch.autograd.grad(g1, (vec, scale), direction, retain_graph=True)
    g2_graph = torch.autograd.grad(g1, (vec, scale), direction, create_graph=True)
    g3 = torch.autograd.grad(sum(g.pow(2).sum() for g in g2_graph), (vec, scale))
    return (y, g1) + g2 + g3


@pytest.mark.parametrize("lmax", [1, 2, 3, 6])
def test_spherical_harmonics_derivatives_in_closed_form_equal_e3nn(lmax):
    """The harmonics differentiate in closed form (their gradients and Hessians contracted on the monomials):
    first, second (in the vectors and in the cotangent) and third derivatives equal e3nn's autograd ones (float64);
    below the normalisation's floor (r < 1e-12) and at r = 0 they equal the plain formula's."""
    sh = SphericalHarmonics(lmax).double()
    ref = o3.SphericalHarmonics(o3.Irreps.spherical_harmonics(lmax), normalize=True, normalization="component")
    gen = torch.Generator().manual_seed(lmax)
    vec = torch.randn(30, 3, generator=gen, dtype=torch.float64) * 3 * torch.rand(30, 1, generator=gen,
                                                                                   dtype=torch.float64)
    vec[0], vec[1], vec[2] = torch.tensor([0.0, 0.0, 2.0]), torch.tensor([1e6, -1e6, 0.0]), 1e-6 * vec[2]
    cotangent = torch.randn(30, (lmax + 1) ** 2, generator=gen, dtype=torch.float64)
    direction = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    ours = _derivatives(sh, vec, cotangent, direction)
    for k, (a, b) in enumerate(zip(ours, _derivatives(ref, vec, cotangent, direction))):
        torch.testing.assert_close(a, b, atol=1e-10 * b.abs().max().item(), rtol=1e-10, msg=f"derivative {k}")
    tiny = torch.tensor([[0.0, 0.0, 0.0], [3e-13, -2e-13, 1e-13], [0.0, 2e-13, 0.0]], dtype=torch.float64)
    ours = _derivatives(sh, tiny, cotangent[:3], direction[:3])
    plain = _derivatives(sh._plain, tiny, cotangent[:3], direction[:3])
    for k, (a, b) in enumerate(zip(ours[:4], plain[:4])):
        a, b = (a, b) if k != 2 else (a[1:], b[1:])  # at r = 0 the plain second derivative is NaN (the norm's)
        torch.testing.assert_close(a, b, atol=1e-12 * b.abs().max().item(), rtol=1e-12, msg=f"derivative {k}")
    for vectors in (vec[:0], vec[5]):  # no edges; one vector of shape [3]
        shape = vectors.shape[:-1] + cotangent.shape[-1:]
        c, d = cotangent[0].expand(shape), direction[0].expand(vectors.shape)
        ours, theirs = _derivatives(sh, vectors, c, d), _derivatives(ref, vectors, c, d)
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-10 * (b.abs().max().item() if b.numel() else 1), rtol=1e-10)


def test_spherical_harmonics_constants_are_reproducible():
    """Rebuilding gives bit-identical constants (checkpoints reload to identical outputs)."""
    for lmax in (2, 3, 5):
        assert torch.equal(SphericalHarmonics(lmax).coefficients, SphericalHarmonics(lmax).coefficients)


def test_spherical_harmonics_bad_lmax():
    with pytest.raises(ValueError, match="lmax must be a non-negative int"):
        SphericalHarmonics(-1)


def test_scale_heads_equals_expanded_weights():
    irreps = o3.Irreps("4x0e + 2x1o + 6x2e")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, irreps.dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    expected = torch.empty_like(x)
    heads = head_index(irreps, 2)
    for c in range(irreps.dim):  # loop over channels: each is scaled by the weight of its head
        expected[:, c] = x[:, c] * weight[:, heads[c]]
    torch.testing.assert_close(scale_heads(x, weight, [mul * ir.dim for mul, ir in irreps]), expected, atol=0, rtol=0)
    torch.testing.assert_close(scale_heads(x, weight[:, :1], [irreps.dim]), x * weight[:, :1], atol=0, rtol=0)


def test_cached_constant_casts_follow_the_module():
    tp = SphericalTensorProduct("2x1o", o3.Irreps.spherical_harmonics(1), ["1x0e"])
    exact = tp.cg.clone()
    assert tp.constant("cg", torch.float32).dtype == torch.float32
    tp.float().double()
    assert tp.cg.dtype == torch.float64 and torch.equal(tp.cg, exact)
    assert torch.equal(tp.constant("cg", torch.float64), exact)
    torch.testing.assert_close(tp.constant("cg", torch.float32), exact.float(), atol=0, rtol=0)


def test_layer_forces_training_equals_e3nn_reference(float64_default):
    """Twice differentiable: the gradient of a force loss equals that of the e3nn-built reference."""
    torch.manual_seed(0)
    layer = EquivariantAttention("2x0e + 2x1o", "2x0e + 2x1o", "2x0e + 2x1o", "2x0e + 2x1o", 1.3, num_heads=2, lmax=2)
    gen = torch.Generator().manual_seed(1)
    pos = torch.randn(8, 3, generator=gen).requires_grad_()
    f = torch.randn(8, 8, generator=gen).requires_grad_()
    edge_index = brute_force_edges(pos.detach(), 1.3)

    def force_loss_gradients(energy_fn):
        energy = energy_fn().pow(2).sum()
        (forces,) = torch.autograd.grad(energy, pos, create_graph=True)
        # the reference copies the query and dot weights into e3nn modules: compare the others
        return torch.autograd.grad(forces.pow(2).sum(), [f, pos, *layer.radial.parameters()])

    got = force_loss_gradients(lambda: layer(f, pos, edge_index))
    ref = force_loss_gradients(lambda: e3nn_guide_attention(layer, f, pos, edge_index)[0])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-10)


def test_layer_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark_layer", ROOT / "benchmarks" / "layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--quick", "--threads", "1", "--memory", "none", "--out", str(tmp_path / "layer.json")])
    rows = report["results"]
    assert {(r["config"], r["method"]) for r in rows} == {(c, m) for c in bench.CONFIGS for m in bench.METHODS}
    for row in rows:
        assert row["skipped"] is None
        assert row["weights"]["baseline"] == row["weights"]["e3attn"]  # same number of weights
        assert row["max_rel_diff"] < 1e-2  # the same function (up to e3nn's silu constant, 0.16 %)
        assert row["fwdbwd_ms"] > 0 and row["edges_per_s"] > 0
        if row["method"] == "e3attn":
            assert row["speedup"] > 0
    assert math.isfinite(report["meta"]["threads"])


def test_layer_benchmark_forces_plain_and_busy_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark_layer", ROOT / "benchmarks" / "layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = ["--configs", "guide", "--sizes", "16", "--repeats", "1", "--memory", "none", "--out", str(tmp_path / "l.json")]
    rows = bench.main([*common, "--threads", "1", "--forces", "--plain"])["results"]
    assert [r["method"] for r in rows] == ["baseline", "e3attn", "plain"]
    assert all(r["force_ms"] > 0 for r in rows) and all(r["speedup_force"] > 0 for r in rows[1:])
    (busy,) = bench.main([*common, "--threads", "2", "--busy", "1", "--max-seconds", "30"])["busy"]
    assert busy["busy_processes"] == 1 and busy["busy_2_ms"] > 0 and busy["busy_2_vs_quiet_1"] > 0
    assert torch.get_num_threads() == 2  # put back as set


def _small_layer():
    torch.manual_seed(0)
    irreps = ("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o + 2x2e")
    return EquivariantAttention(*irreps, max_radius=2.0, num_heads=2, lmax=2)


def _small_inputs(layer, dtype=torch.float32, n=10):
    gen = torch.Generator().manual_seed(3)
    pos = torch.randn(n, 3, generator=gen, dtype=dtype)
    f = torch.randn(n, layer.irreps_input.dim, generator=gen, dtype=dtype)
    return f, pos


def test_layer_under_bfloat16_autocast_trains():
    """Autocast runs the product as plain operations: forward and backward work and follow float32."""
    layer = _small_layer()
    f, pos = _small_inputs(layer)
    reference = layer(f, pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(f, pos.requires_grad_())
    out.float().pow(2).sum().backward()
    assert torch.isfinite(pos.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())
    assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_forces_when_no_key_irrep_is_reachable(float64_default):
    """Keys with no path from x (x) Y are zero and carry no gradient: forces still work, for any graph."""
    torch.manual_seed(0)
    layer = EquivariantAttention("1x0e + 1x1o", "2x0e", "2x2o", "2x2o", max_radius=2.0, num_heads=2, lmax=1)
    f, pos = _small_inputs(layer, torch.float64)
    for edge_index in (brute_force_edges(pos, 2.0), torch.zeros(2, 0, dtype=torch.long), torch.tensor([[0], [1]])):
        p = pos.clone().requires_grad_()
        energy = layer(f, p, edge_index).pow(2).sum()
        (forces,) = torch.autograd.grad(energy, p, create_graph=True)
        forces.pow(2).sum().backward()
        assert torch.isfinite(forces).all()


def test_inference_mode_then_training():
    """A first call under inference_mode does not leave inference tensors behind for training. (The edge
    geometry of the trained layer is the plain formulation's, the kernels' under inference_mode: equal to
    float32 rounding, e3attn.edge_geometry.)"""
    layer = _small_layer()
    f, pos = _small_inputs(layer)
    with torch.inference_mode():
        expected = layer(f, pos)
    out = layer(f, pos.requires_grad_())
    out.pow(2).sum().backward()
    torch.testing.assert_close(out.detach(), expected, atol=2e-6, rtol=1e-5)
    assert torch.isfinite(pos.grad).all()


def test_torch_func_transforms(float64_default):
    """torch.func.grad and jacfwd see plain operations and agree with autograd."""
    layer = _small_layer()
    f, pos = _small_inputs(layer, torch.float64, n=6)
    edge_index = brute_force_edges(pos, 2.0)
    grad = torch.func.grad(lambda p: layer(f, p, edge_index).pow(2).sum())(pos)
    p = pos.clone().requires_grad_()
    (expected,) = torch.autograd.grad(layer(f, p, edge_index).pow(2).sum(), p)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    jac = torch.func.jacfwd(lambda p: layer(f, p, edge_index)[:, 0])(pos)
    assert jac.shape == (6, 6, 3) and torch.isfinite(jac).all()



def test_batched_and_forward_mode_derivatives_equal_the_plain_formulation(float64_default):
    """``is_grads_batched=True`` (a Hessian of the energy, a Jacobian of the outputs) and ``vmap`` over
    ``autograd.grad`` batch the gradients that reach the kernels' backward: they take the dispatcher's or the plain
    route; forward-mode AD runs the plain formulation. All agree with the plain layer, derivatives of the batched
    derivatives included."""
    layer = _small_layer()
    f, pos = _small_inputs(layer, torch.float64, n=6)
    f, pos = f.requires_grad_(), pos.requires_grad_()

    def derivatives():
        out = layer(f, pos)
        (grad,) = torch.autograd.grad(out.pow(2).sum(), pos, create_graph=True)
        hessian = torch.autograd.grad(grad, pos, torch.eye(18).reshape(18, 6, 3), is_grads_batched=True,
                                      create_graph=True)[0]
        (of_hessian,) = torch.autograd.grad(hessian.pow(2).sum(), f, retain_graph=True)
        basis = torch.eye(out.numel()).reshape(-1, *out.shape)
        jacobians = torch.autograd.grad(out, (pos, f), basis, is_grads_batched=True, retain_graph=True)
        vmapped = torch.func.vmap(lambda v: torch.autograd.grad(out, pos, v, retain_graph=True)[0])(basis)
        forward = torch.autograd.functional.jacobian(lambda p: layer(f, p), pos, strategy="forward-mode",
                                                     vectorize=True)
        return hessian, of_hessian, *jacobians, vmapped, forward

    assert kernels.segments_enabled(pos.device, pos.dtype)
    for a, b in zip(derivatives(), plain(derivatives)):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-10 * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("case, match", [
    ("sh_width", r"sh must have shape \[E, 9\]"),
    ("x_width", r"x must have shape \[\*, 10\]"),
    ("x_rows", "x must have one row per row of sh"),
    ("index", r"index must have shape \[7\]"),
    ("hidden", r"hidden\[0\] must have shape \[7, h\]"),
    ("linear", r"linear\[0\] must have shape \[5, 26\]"),  # paths (4 + 2) x 3 channels + (4 + 2 + 2) x 1
    ("dtype", "must share one dtype"),
])
def test_factored_product_bad_shapes(case, match):
    tp = SphericalTensorProduct("4x0e + 2x1o", o3.Irreps.spherical_harmonics(2), ["3x0e + 1x1o"])
    args = {"x": torch.randn(7, 10), "sh": torch.randn(7, 9), "h": torch.randn(7, 5),
            "w": torch.randn(5, tp.weight_numel[0]), "index": None}
    bad = {"sh_width": ("sh", torch.randn(7, 8)), "x_width": ("x", torch.randn(7, 11)),
           "x_rows": ("x", torch.randn(12, 10)), "index": ("index", torch.zeros(6, dtype=torch.long)),
           "hidden": ("h", torch.randn(6, 5)), "linear": ("w", torch.randn(5, 9)),
           "dtype": ("sh", torch.randn(7, 9, dtype=torch.float64))}[case]
    args[bad[0]] = bad[1]
    with pytest.raises(ValueError, match=match):
        tp.forward_factored(args["x"], args["sh"], [args["h"]], [args["w"]], index=args["index"])


def test_cached_constant_follows_a_replaced_buffer():
    tp = SphericalTensorProduct("2x1o", o3.Irreps.spherical_harmonics(1), ["1x0e"])
    first = tp.constant("cg", torch.float32)
    tp._buffers["cg"] = tp.cg * 2  # e.g. torch.func.functional_call or a DataParallel replica
    torch.testing.assert_close(tp.constant("cg", torch.float32), 2 * first, atol=0, rtol=0)


def test_factored_operators_find_their_structure_from_the_irreps():
    tp = SphericalTensorProduct(*TP_CASES[1][:1], o3.Irreps.spherical_harmonics(TP_CASES[1][1]), TP_CASES[1][2])
    assert tensor_product._structure(tp._spec) is tp  # the live product of these irreps
    spec, blocks, steps = tp._spec, tp._blocks, tp._steps
    del tp
    rebuilt = tensor_product._structure(spec)  # none alive: built from the string
    assert (rebuilt._spec, rebuilt._blocks, rebuilt._steps) == (spec, blocks, steps)
