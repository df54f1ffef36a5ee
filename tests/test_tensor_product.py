import pytest
import torch
from e3nn import o3

from e3attn.heads import MultiHeadDot, head_index, split_heads
from e3attn.linear import IrrepsLinear
from e3attn.tensor_product import SphericalTensorProduct


@pytest.mark.parametrize(
    "irreps_in, lmax, outs",
    [
        ("10x0e + 5x1o", 3, ["12x0e + 3x1o", "14x0e + 6x1o"]),
        ("2x0e + 1x0o + 3x1e + 2x2o + 1x0e", 2, ["3x1o + 2x0e + 1x2e + 2x0e", "1x3o + 2x0o"]),
        ("4x1o", 0, ["2x1o + 3x0e"]),  # 3x0e has no path from 1o x 0e
    ],
)
def test_equals_e3nn_fully_connected_tensor_product(irreps_in, lmax, outs, float64_default):
    irreps_sh = o3.Irreps.spherical_harmonics(lmax)
    tp = SphericalTensorProduct(irreps_in, irreps_sh, outs)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, o3.Irreps(irreps_in).dim, generator=gen)
    sh = torch.randn(7, irreps_sh.dim, generator=gen)
    weights = [torch.randn(7, n, generator=gen) for n in tp.weight_numel]
    results = tp(x, sh, weights)
    for t, out in enumerate(outs):
        ref = o3.FullyConnectedTensorProduct(irreps_in, irreps_sh, out, shared_weights=False)
        assert ref.weight_numel == tp.weight_numel[t]
        e3nn_w = torch.zeros(7, ref.weight_numel)
        e3nn_w[:, tp.e3nn_weight_index(t)] = weights[t]
        torch.testing.assert_close(results[t], ref(x, sh, e3nn_w), atol=1e-13, rtol=0)


def test_e3nn_weight_index_is_a_permutation():
    tp = SphericalTensorProduct("3x0e + 2x1o + 1x2e", o3.Irreps.spherical_harmonics(2), ["2x0e + 2x1o + 1x2e"])
    index = tp.e3nn_weight_index(0)
    assert torch.equal(index.sort().values, torch.arange(tp.weight_numel[0]))


@pytest.mark.parametrize("dense", [False, True])
def test_linear_equals_e3nn(dense):
    lin = IrrepsLinear("3x0e + 2x1o + 1x0e + 1x2e", "2x0e + 3x1o + 1x1e").double()
    lin._matrix.dense = dense  # both forms (one matrix product, or one product per block) against e3nn
    ref = o3.Linear("3x0e + 2x1o + 1x0e + 1x2e", "2x0e + 3x1o + 1x1e").double()
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
    x = torch.randn(5, lin.irreps_in.dim, dtype=torch.float64)
    out = lin(x)
    torch.testing.assert_close(out, ref(x), atol=1e-14, rtol=0)
    assert out[:, -3:].abs().max() == 0  # 1x1e is reached by no input


def test_dense_form_where_it_is_cheap():
    """One matrix product for small irreps (the e3nn guide's query: 575 entries for 170 weight multiply-adds), one
    product per block where the dense matrix would be mostly zeros; no weights at all is never dense."""
    assert IrrepsLinear("10x0e + 5x1o", "11x0e + 4x1o")._matrix.dense
    assert MultiHeadDot("11x0e + 4x1o", "12x0e + 3x1o")._matrix.dense
    large = "64x0e + 32x1o + 16x2e"
    assert not IrrepsLinear(large, large)._matrix.dense
    assert not MultiHeadDot(large, large, num_heads=4)._matrix.dense
    none = IrrepsLinear("2x1o", "3x0e")
    assert not none._matrix.dense and none(torch.randn(4, 6)).abs().max() == 0


def test_split_heads_and_head_index():
    assert split_heads("8x0e + 4x1o", 2) == o3.Irreps("4x0e + 2x1o")
    with pytest.raises(ValueError, match=r"irreps_key = .* cannot be split into 3 heads: .*4x1o"):
        split_heads("6x0e + 4x1o", 3, "irreps_key")
    assert head_index("4x0e + 2x1o", 2).tolist() == [0, 0, 1, 1] + [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("dense", [False, True])
def test_multihead_dot_equals_e3nn_per_head(dense):
    torch.manual_seed(0)
    dot = MultiHeadDot("4x0e + 2x1o + 2x2e", "2x0e + 4x1o + 2x1e", num_heads=2).double()
    dot._matrix.dense = dense
    q = torch.randn(3, dot.irreps_query.dim, dtype=torch.float64)
    k = torch.randn(3, dot.irreps_key.dim, dtype=torch.float64)
    logits = (dot.project_query(q) * dot.key_heads(k)).sum(-1)
    for h, (qs, ks) in enumerate([((0, 2, 4, 7), (0, 1, 2, 8)), ((2, 4, 7, 10), (1, 2, 8, 14))]):
        # head h: 2x0e + 1x1o + 1x2e of the query, 1x0e + 2x1o + 1x1e of the key
        qh = torch.cat([q[:, 0:4].reshape(3, 4)[:, 2 * h : 2 * h + 2], q[:, 4:10].reshape(3, 2, 3)[:, h],
                        q[:, 10:20].reshape(3, 2, 5)[:, h]], dim=1)
        kh = torch.cat([k[:, 0:2].reshape(3, 2)[:, h : h + 1], k[:, 2:14].reshape(3, 4, 3)[:, 2 * h : 2 * h + 2].reshape(3, 6),
                        k[:, 14:20].reshape(3, 2, 3)[:, h]], dim=1)
        ref = o3.FullyConnectedTensorProduct("2x0e + 1x1o + 1x2e", "1x0e + 2x1o + 1x1e", "0e").double()
        with torch.no_grad():
            ref.weight.copy_(dot.weight[h])
        torch.testing.assert_close(logits[:, h], ref(qh, kh)[:, 0], atol=1e-13, rtol=0)
