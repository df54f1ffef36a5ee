import math

import numpy as np
import pytest
import torch
from e3nn.math import soft_one_hot_linspace
from scipy import integrate

from e3attn.radial import RadialEmbedding, RadialMLP, cutoff_weight, soft_unit_step


def test_soft_unit_step_values_and_gradient():
    x = torch.tensor([-2.0, -1e-9, 0.0, 1e-9, 0.5, 3.0], dtype=torch.float64, requires_grad=True)
    y = soft_unit_step(x)
    expected = [0.0, 0.0, 0.0, math.exp(-1e9), math.exp(-2.0), math.exp(-1 / 3)]
    torch.testing.assert_close(y, torch.tensor(expected, dtype=torch.float64), atol=1e-15, rtol=1e-14)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[:3].abs().max() == 0


def test_smooth_finite_equals_e3nn(float64_default):
    r = torch.linspace(0, 2.0, 101, dtype=torch.float64)
    emb = RadialEmbedding(10, 1.3)(r)
    ref = soft_one_hot_linspace(r, 0.0, 1.3, 10, "smooth_finite", True) * math.sqrt(10)
    torch.testing.assert_close(emb, ref, atol=1e-14, rtol=0)


def test_gaussian_and_bessel_formulas():
    r = torch.tensor([0.0, 0.2, 0.65, 1.2, 1.29], dtype=torch.float64)
    n, rmax = 4, 1.3
    d = r.numpy() / rmax
    env = 1 - 28 * d**6 + 48 * d**7 - 21 * d**8
    centers = np.linspace(0, rmax, n)
    gauss = np.exp(-(((r.numpy()[:, None] - centers) / (rmax / (n - 1))) ** 2)) / 1.12 * env[:, None] * math.sqrt(n)
    torch.testing.assert_close(RadialEmbedding(n, rmax, "gaussian")(r), torch.from_numpy(gauss), atol=1e-14, rtol=0)
    k = np.arange(1, n + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        bessel = math.sqrt(2 / rmax) * np.sin(k * math.pi * r.numpy()[:, None] / rmax) / r.numpy()[:, None]
    bessel[0] = math.sqrt(2 / rmax) * k * math.pi / rmax  # the r -> 0 limit
    bessel = bessel * env[:, None] * math.sqrt(n)
    torch.testing.assert_close(RadialEmbedding(n, rmax, "bessel")(r), torch.from_numpy(bessel), atol=1e-12, rtol=0)


@pytest.mark.parametrize("basis", RadialEmbedding.BASES)
def test_embedding_vanishes_smoothly_at_cutoff(basis):
    emb = RadialEmbedding(8, 2.0, basis).double()
    r = torch.tensor([2.0 - 1e-4, 2.0, 2.5, 4.0], dtype=torch.float64, requires_grad=True)
    out = emb(r)
    assert out[1:].abs().max() == 0
    assert out[0].abs().max() < 1e-6
    (g,) = torch.autograd.grad(out.sum(), r)
    assert torch.isfinite(g).all() and g[1:].abs().max() == 0


def test_embedding_gradient_finite_at_zero():
    for basis in RadialEmbedding.BASES:
        r = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(RadialEmbedding(5, 1.0, basis)(r).sum(), r)
        assert torch.isfinite(g).all()


def test_cutoff_weight():
    r = torch.tensor([0.0, 0.5, 1.0, 1.5], dtype=torch.float64)
    torch.testing.assert_close(
        cutoff_weight(r, 1.0), torch.tensor([math.exp(-0.1), math.exp(-0.2), 0.0, 0.0], dtype=torch.float64)
    )


def test_embedding_bad_arguments():
    with pytest.raises(ValueError, match="number_of_basis"):
        RadialEmbedding(0, 1.0)
    with pytest.raises(ValueError, match="max_radius"):
        RadialEmbedding(3, float("nan"))
    with pytest.raises(ValueError, match="basis"):
        RadialEmbedding(3, 1.0, "cosine")


def test_radial_mlp_formula():
    torch.manual_seed(0)
    mlp = RadialMLP(6, 5, [7, 3]).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    second_moment, _ = integrate.quad(
        lambda z: (z / (1 + math.exp(-z))) ** 2 * math.exp(-z * z / 2) / math.sqrt(2 * math.pi), -40, 40, epsabs=1e-13
    )
    c = 1 / math.sqrt(second_moment)
    w1 = mlp.weight1.detach()
    for t, w2 in enumerate(mlp.weight2):
        h = torch.nn.functional.silu(x @ w1[:, 5 * t : 5 * (t + 1)] / math.sqrt(6)) * c
        torch.testing.assert_close(mlp(x)[t], h @ w2.detach() / math.sqrt(5), atol=1e-12, rtol=0)


def test_radial_mlp_pieces_compose_to_it():
    """The unnormalised hidden features with the normalisation folded into the last layers (what the layer
    contracts at the nodes) equal ``forward`` (itself checked against the formula above)."""
    torch.manual_seed(0)
    mlp = RadialMLP(6, 5, [7, 3]).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    pieces = zip(mlp.activate(x @ mlp.input_layer(), normalise=False), mlp.output_layers(fold_activation_norm=True))
    for got, want in zip([h @ w for h, w in pieces], mlp(x)):
        torch.testing.assert_close(got, want, atol=1e-13, rtol=0)


# ---------------------------------------------------------------- derivatives in closed form (e3attn._jet)


def _three_derivatives(fn, x0, weights):
    """``fn(x)``, the gradient of ``<w, fn(x)>`` with create_graph, its gradient again without (a force-training
    step's second derivative: the closed forms), and the same second derivative with create_graph differentiated
    once more (a third derivative: the plain formula's fallback)."""
    x = x0.clone().requires_grad_()
    y = fn(x)
    (g1,) = torch.autograd.grad((y * weights).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad((g1 * g1).sum(), x, retain_graph=True)
    (g2_graph,) = torch.autograd.grad((g1 * g1).sum(), x, create_graph=True)
    (g3,) = torch.autograd.grad(g2_graph.sum(), x)
    return y.detach(), g1.detach(), g2, g3


def _radial_functions():
    from e3attn import radial

    lengths = torch.cat([torch.tensor([0.0, 1.0, 2.0 - 1e-6, 2.0, 2.5]), torch.linspace(0.05, 2.3, 97)])
    steps = torch.cat([torch.tensor([-1.0, 0.0, 1e-4, 1 / 800, 1 / 800 + 1e-9]), torch.linspace(-0.5, 10.0, 97)])
    for basis in RadialEmbedding.BASES:
        emb = RadialEmbedding(8, 2.0, basis).double()
        # (the Bessel basis from 0.05 on: below, the plain formula's derivatives lose their digits, next test)
        yield basis, emb, emb._plain, (lengths[1:] if basis == "bessel" else lengths).double()
    yield "soft_unit_step", soft_unit_step, radial._soft_unit_step, steps.double()
    yield "log_soft_unit_step", radial.log_soft_unit_step, radial._log_soft_unit_step, steps.double()
    silu = torch.nn.functional.silu  # the radial networks' activation (RadialMLP.activate)
    wide = torch.cat([torch.tensor([0.0, -800.0, 800.0]), torch.linspace(-40.0, 40.0, 97)]).double()
    yield "silu", lambda x: radial.jet(x, silu, radial._silu_derivatives), silu, wide


@pytest.mark.parametrize("first_only", [False, True])
def test_closed_form_derivatives_equal_the_plain_formulas(first_only):
    """Values and first, second and third derivatives of the radial functions with their derivatives in closed
    form equal those of their plain formulas (float64, special points included: r = 0 and beyond the cutoff,
    the steps' floor and x <= 0), whether the second derivative was prepared or is computed when asked for."""
    from e3attn._jet import first_derivatives_only

    for name, fn, plain, x in _radial_functions():
        weights = torch.randn(plain(x).shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
        with first_derivatives_only() if first_only else torch.enable_grad():
            ours = _three_derivatives(fn, x, weights)
        reference = _three_derivatives(plain, x, weights)
        for k, (a, b) in enumerate(zip(ours, reference)):
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), (name, k)
            assert torch.equal(a[~finite], b[~finite]), (name, k)  # -inf of the log step, where it is
            scale = b[finite].abs().max().clamp_min(1.0)
            assert (a[finite] - b[finite]).abs().max() <= 1e-12 * scale, (name, k)


def test_closed_form_bessel_derivatives_are_smooth_at_zero_length():
    """At r -> 0 the plain formula's derivatives lose their digits (torch.sinc's own gradient: about 1e-6 off at
    r = 1e-9, NaN second derivative at 0); the closed forms take sin(t)/t's series there and join smoothly."""
    emb = RadialEmbedding(8, 2.0, "bessel").double()
    r = torch.tensor([0.0, 1e-9, 1e-4, 2e-2], dtype=torch.float64, requires_grad=True)
    (g1,) = torch.autograd.grad(emb(r).sum(), r, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), r)
    assert g1[0] == 0 and torch.isfinite(g2).all()
    torch.testing.assert_close(g2[1:3], g2[0].expand(2), rtol=1e-6, atol=0)  # f'' is flat near 0
    # the value at 2e-2 (past the series' switch at t = 1e-2) continues the series' trend
    r2 = torch.tensor([2e-2], dtype=torch.float64, requires_grad=True)
    (h1,) = torch.autograd.grad(emb._plain(r2).sum(), r2)
    torch.testing.assert_close(g1[3:], h1, rtol=1e-9, atol=0)


def test_closed_forms_step_aside_where_they_cannot_run():
    """Inside torch.func transforms (and torch.compile) the plain formulas run: same values and derivatives."""
    emb = RadialEmbedding(8, 2.0, "bessel").double()
    r = torch.linspace(0.1, 1.9, 7, dtype=torch.float64)
    jac = torch.func.jacrev(lambda t: emb(t).sum(-1))(r)
    rr = r.clone().requires_grad_()
    (g,) = torch.autograd.grad(emb(rr).sum(), rr)
    torch.testing.assert_close(jac.diagonal(), g, rtol=1e-12, atol=1e-12)


def _closed_and_plain_functions():
    """Every function differentiated in closed form, with its plain formula and an input (float64)."""
    from e3attn import radial
    from e3attn.scatter import _segment_softmax, segment_softmax
    from e3attn.spherical_harmonics import SphericalHarmonics

    gen = torch.Generator().manual_seed(5)
    sh, emb = SphericalHarmonics(3).double(), RadialEmbedding(6, 2.0, "bessel").double()
    index = torch.tensor([0, 0, 1, 1, 1, 3])
    silu = torch.nn.functional.silu
    yield "harmonics", sh, sh._plain, torch.randn(5, 3, generator=gen, dtype=torch.float64)
    yield "bessel", emb, emb._plain, torch.tensor([0.3, 0.9, 1.7], dtype=torch.float64)
    yield "silu", lambda x: radial.jet(x, silu, radial._silu_derivatives), silu, torch.linspace(-3, 3, 7).double()
    yield ("softmax", lambda x: torch.cat(segment_softmax(x, index, 4, return_sqrt=True)),
           lambda x: torch.cat(_segment_softmax(x, index, 4, "torch")), torch.randn(6, 2, generator=gen).double())


@pytest.mark.parametrize("case", ["harmonics", "bessel", "silu", "softmax"])
def test_derivatives_when_the_cotangent_depends_on_the_input(case):
    """In a model the cotangent reaching a function depends on its input (dE/dY depends on the edges). The
    closed forms' second derivatives, their fallback's (with create_graph), third derivatives and batched
    Hessian-vector products then equal autograd's of the plain formula (float64)."""
    name, fn, plain, x0 = next(c for c in _closed_and_plain_functions() if c[0] == case)

    def derivatives(f):
        x = x0.clone().requires_grad_()
        y = f(x)
        energy = (y.pow(2) * torch.linspace(0.5, 2.0, y.shape[-1], dtype=y.dtype)).sum() + y.sum() * x.sum()
        (g1,) = torch.autograd.grad(energy, x, create_graph=True)
        loss = g1.pow(2).sum()
        (g2,) = torch.autograd.grad(loss, x, retain_graph=True)
        (g2_graph,) = torch.autograd.grad(loss, x, create_graph=True)
        (g3,) = torch.autograd.grad(g2_graph.pow(2).sum(), x, retain_graph=True)
        directions = torch.eye(x.numel(), dtype=x.dtype)[:3].view(3, *x.shape)
        (hvp,) = torch.autograd.grad(g1, x, directions, is_grads_batched=True)
        return g1.detach(), g2, g2_graph.detach(), g3, hvp

    for k, (a, b) in enumerate(zip(derivatives(fn), derivatives(plain))):
        torch.testing.assert_close(a, b, atol=1e-12 * b.abs().max().item(), rtol=1e-12, msg=f"{name}: {k}")
