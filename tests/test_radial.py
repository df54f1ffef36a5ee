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
