"""The heads' products (e3attn.heads.head_dot, head_outer, head_sum) and their kernels (e3attn.kernels.heads_ops)."""
import pytest
import torch

from e3attn import heads

pytest.importorskip("numba")
from e3attn.kernels import heads_ops  # noqa: E402


def _operands(num=37, num_heads=4, k=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, b, h = (torch.randn(num, n, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for n in (num_heads * k, num_heads, k))
    return t, b, h


def test_plain_products_are_the_contractions_of_one_trilinear_form(float64_default):
    t, b, h = _operands()
    t3 = t.reshape(t.shape[0], 4, 5)
    torch.testing.assert_close(heads.head_dot(t, h), torch.einsum("eak,ek->ea", t3, h), atol=1e-14, rtol=0)
    torch.testing.assert_close(heads.head_outer(b, h).reshape(-1, 4, 5), torch.einsum("ea,ek->eak", b, h),
                               atol=1e-14, rtol=0)
    torch.testing.assert_close(heads.head_sum(b, t), torch.einsum("ea,eak->ek", b, t3), atol=1e-14, rtol=0)
    form = (heads.head_dot(t, h) * b).sum()  # each contraction is a derivative of the form
    gt, gb, gh = torch.autograd.grad(form, (t, b, h))
    torch.testing.assert_close(gt, heads.head_outer(b, h), atol=1e-14, rtol=0)
    torch.testing.assert_close(gb, heads.head_dot(t, h), atol=1e-14, rtol=0)
    torch.testing.assert_close(gh, heads.head_sum(b, t), atol=1e-14, rtol=0)


@pytest.mark.parametrize("name", ["head_dot", "head_outer"])
def test_kernels_equal_the_plain_products_to_the_second_derivative(name, float64_default):
    t, b, h = _operands()
    args = (t, h) if name == "head_dot" else (b, h)
    kernel, plain = getattr(heads_ops, name), getattr(heads, name)
    out = kernel(*args)
    torch.testing.assert_close(out, plain(*args), atol=1e-14, rtol=0)
    cotangent = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, args, cotangent), torch.autograd.grad(plain(*args), args, cotangent)):
        torch.testing.assert_close(got, want, atol=1e-14, rtol=0)
    assert torch.autograd.gradcheck(kernel, args)
    assert torch.autograd.gradgradcheck(kernel, args)


def test_kernels_in_float32():
    t, b, h = _operands(dtype=torch.float32)
    t64, b64, h64 = (x.detach().double() for x in (t, b, h))
    torch.testing.assert_close(heads_ops.head_dot(t, h).double(), heads.head_dot(t64, h64), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(heads_ops.head_outer(b, h).double(), heads.head_outer(b64, h64), atol=1e-5, rtol=1e-5)
    (gh,) = torch.autograd.grad(heads_ops.head_outer(b, h).sum(), h)
    torch.testing.assert_close(gh.double(), b64.sum(1, keepdim=True).expand(-1, 5), atol=1e-5, rtol=1e-5)


def test_kernels_are_bitwise_repeatable_for_any_number_of_threads():
    t, b, h = (x.detach() for x in _operands(num=70000, k=16, dtype=torch.float32))  # enough work for two threads
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            tt, hh = t.clone().requires_grad_(), h.clone().requires_grad_()
            out = heads_ops.head_dot(tt, hh)
            results.append((out, *torch.autograd.grad(out.pow(2).sum(), (tt, hh))))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(x, y) for other in results[1:] for x, y in zip(results[0], other))


def test_kernels_refuse_mismatched_operands():
    t, b, h = (x.detach() for x in _operands())
    with pytest.raises(ValueError, match=r"t must be a torch.float64 tensor \[37, 20\]"):
        heads_ops.head_dot(t[:5], h)
    with pytest.raises(ValueError, match="t must be"):
        heads_ops.head_dot(t[:, :19], h)  # not a whole number of heads
    with pytest.raises(ValueError, match="b must be"):
        heads_ops.head_outer(b.float(), h)
    with pytest.raises(ValueError, match="h must be a float32 or float64 tensor"):
        heads_ops.head_outer(b, h.half())
