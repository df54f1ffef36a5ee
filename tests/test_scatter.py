import pytest
import torch

from e3attn.scatter import _segment_softmax, has_torch_scatter, scatter_max, scatter_sum, segment_softmax

torch_scatter_only = pytest.mark.skipif(not has_torch_scatter(), reason="torch_scatter is not installed")


def loop_softmax(src, index, n):
    out = torch.zeros_like(src)
    for i in range(n):
        mask = index == i
        if mask.any():
            vals = src[mask]
            finite = torch.isfinite(vals)
            if finite.any():
                out[mask] = torch.softmax(vals, dim=0)
    return out


def test_scatter_sum_and_max_against_loops():
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(20, 3, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 6, (20,), generator=gen)
    index[index == 4] = 5  # segment 4 is empty
    total, maximum = scatter_sum(src, index, 7), scatter_max(src, index, 7)
    for i in range(7):
        rows = src[index == i]
        torch.testing.assert_close(total[i], rows.sum(0) if len(rows) else torch.zeros(3, dtype=torch.float64))
        if len(rows):
            assert torch.equal(maximum[i], rows.max(0).values)
        else:
            assert torch.isinf(maximum[i]).all() and (maximum[i] < 0).all()


def test_segment_softmax_matches_loop_and_handles_extremes():
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(30, 2, generator=gen, dtype=torch.float64) * 1e4  # raw exp would overflow
    index = torch.randint(0, 8, (30,), generator=gen)
    src[index == 3] = float("-inf")  # a segment with nothing to attend to
    src[0] = float("-inf")
    alpha, sqrt_alpha = segment_softmax(src, index, 9, return_sqrt=True)
    for h in range(2):
        torch.testing.assert_close(alpha[:, h], loop_softmax(src[:, h], index, 9), atol=1e-15, rtol=0)
    torch.testing.assert_close(sqrt_alpha, alpha.sqrt(), atol=1e-15, rtol=0)
    assert torch.equal(alpha[index == 3], torch.zeros_like(alpha[index == 3]))


def test_segment_softmax_gradients_finite_with_excluded_entries():
    src = torch.tensor([0.3, float("-inf"), 2.0, float("-inf")], dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 0, 1, 2])
    alpha, sqrt_alpha = segment_softmax(src, index, 3, return_sqrt=True)
    (alpha.sum() + (sqrt_alpha * torch.arange(4.0, dtype=torch.float64)).sum()).backward()
    assert torch.isfinite(src.grad).all()


def _softmax_derivatives(softmax, src, weights, uses):
    """A force-training step's derivatives of the softmax: values; the gradient in ``src`` of a loss whose
    cotangents depend on ``weights`` (with create_graph); that gradient's derivatives in ``src`` and ``weights``
    without (the closed forms) and with create_graph, differentiated once more (a third derivative)."""
    src, weights = src.clone().requires_grad_(), weights.clone().requires_grad_()
    alpha, beta = softmax(src)
    finite = lambda t: torch.where(torch.isfinite(src), t, 0.0)  # noqa: E731
    loss = (finite(alpha * weights) if "alpha" in uses else 0) + (finite(beta * weights.sin()) if "beta" in uses
                                                                    else 0)
    (g1,) = torch.autograd.grad(loss.sum(), src, create_graph=True)
    second = (g1 * g1).sum() + (g1 * weights.cos()).sum()
    g2 = torch.autograd.grad(second, (src, weights), retain_graph=True)
    g2_graph = torch.autograd.grad(second, (src, weights), create_graph=True)
    g3 = torch.autograd.grad(sum(g.pow(2).sum() for g in g2_graph), (src, weights))
    return (alpha.detach(), beta.detach(), g1.detach()) + g2 + g3


@pytest.mark.parametrize("uses", [("alpha", "beta"), ("alpha",), ("beta",)])
def test_segment_softmax_derivatives_in_closed_form_equal_the_formula(uses):
    """First, second (in the logits and in the cotangents) and third derivatives of the softmax differentiated in
    closed form (e3attn._softmax_jet) equal autograd's of its formula (float64), with excluded entries, a segment
    with nothing to attend to and an empty one."""
    gen = torch.Generator().manual_seed(3)
    index = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3, 3, 4])  # segment 2 is empty
    src = torch.randn(10, 2, generator=gen, dtype=torch.float64) * 3
    src[1, 0] = src[3, 1] = src[4, 1] = float("-inf")  # excluded; segment 1 has nothing to attend to in head 1
    weights = torch.randn(10, 2, generator=gen, dtype=torch.float64)
    ours = _softmax_derivatives(lambda s: segment_softmax(s, index, 5, return_sqrt=True), src, weights, uses)
    formula = _softmax_derivatives(lambda s: _segment_softmax(s, index, 5, "torch"), src, weights, uses)
    for k, (a, b) in enumerate(zip(ours, formula)):
        assert torch.isfinite(a).all(), k
        torch.testing.assert_close(a, b, atol=1e-12 * b.abs().max().item(), rtol=1e-12, msg=f"output {k}")


def test_segment_softmax_nan_logit_stays_in_its_segment():
    """A NaN logit gives NaN attention on its edge and NaN gradients in its segment, not beyond."""
    index = torch.tensor([0, 0, 1, 1])
    src = torch.tensor([0.5, float("nan"), 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    alpha, beta = segment_softmax(src, index, 2, return_sqrt=True)
    (grad,) = torch.autograd.grad((alpha + beta).sum(), src)
    assert alpha.isnan().tolist() == [False, True, False, False] and torch.isfinite(beta[2:]).all()
    assert torch.isfinite(grad[2:]).all()


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        scatter_sum(torch.zeros(2), torch.zeros(2, dtype=torch.long), 1, backend="cuda_magic")


@torch_scatter_only
def test_torch_scatter_backend_identical():
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(200, 4, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 40, (200,), generator=gen)
    assert torch.equal(scatter_max(src, index, 45), scatter_max(src, index, 45, backend="torch_scatter"))
    torch.testing.assert_close(
        scatter_sum(src, index, 45), scatter_sum(src, index, 45, backend="torch_scatter"), atol=1e-14, rtol=0
    )
    a = segment_softmax(src, index, 45, return_sqrt=True)
    b = segment_softmax(src, index, 45, return_sqrt=True, backend="torch_scatter")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-15, rtol=0)
