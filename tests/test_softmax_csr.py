"""The attention's softmax on the kernels (e3attn.kernels.softmax_ops) against e3attn.scatter.segment_softmax (the
plain formulation): values and first derivatives in float64 and float32, second derivatives, -inf logits, empty
segments, NaN propagation, and the layer's attention on it."""
import functools

import pytest
import torch

from e3attn import EquivariantAttention
from e3attn.scatter import _segment_softmax, segment_softmax
from kernel_switch import plain

pytest.importorskip("numba")
from e3attn.kernels import softmax_ops  # noqa: E402

DEGREES = torch.tensor([0, 3, 1, 0, 4, 2, 5, 1])  # nodes 0 and 3 without incoming edges


def _case(dtype=torch.float64, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rowptr = torch.cat([torch.zeros(1, dtype=torch.long), DEGREES.cumsum(0)])
    dst = torch.repeat_interleave(torch.arange(DEGREES.shape[0]), DEGREES)
    logits = (torch.randn(dst.shape[0], heads, generator=g, dtype=torch.float64) * 30).to(dtype)  # overflow-prone
    logits[2, 0] = float("-inf")  # excluded edges, and node 7's only edge
    logits[-1, :] = float("-inf")
    plain = functools.partial(segment_softmax, index=dst, num_segments=DEGREES.shape[0], return_sqrt=True)
    return logits.requires_grad_(), rowptr, plain


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_softmax_equals_the_plain_formulation(dtype, tol):
    logits, rowptr, plain = _case(dtype)
    got, want = softmax_ops.segment_softmax_csr(logits, rowptr, plain), plain(logits)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert torch.all(got[0][-1] == 0) and torch.all(got[1][-1] == 0) and got[0][2, 0] == 0
    cot = [torch.randn(logits.shape, dtype=dtype) for _ in range(2)]
    (a,) = torch.autograd.grad(got, logits, cot)
    (b,) = torch.autograd.grad(want, logits, cot)
    torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol)


def test_softmax_derivatives():
    logits, rowptr, plain = _case(heads=1)
    logits = (logits.detach() / 30).clamp_min(-5).requires_grad_()  # finite: numerical derivatives
    assert torch.autograd.gradcheck(lambda s: softmax_ops.segment_softmax_csr(s, rowptr, plain), (logits,))
    assert torch.autograd.gradgradcheck(lambda s: softmax_ops.segment_softmax_csr(s, rowptr, plain), (logits,))


def test_softmax_nan_and_checks():
    logits, rowptr, plain = _case()
    with torch.no_grad():
        logits[4, 1] = float("nan")  # edge 4 of node 4 (edges 4..7): its head 1 has no normaliser, as in the plain
    # the formula's autograd (segment_softmax's closed forms give NaN gradients to the whole segment instead)
    formula = functools.partial(_segment_softmax, index=plain.keywords["index"], num_segments=DEGREES.shape[0],
                                backend="torch")
    got, want = softmax_ops.segment_softmax_csr(logits, rowptr, plain), formula(logits)
    cot = [torch.randn(logits.shape, dtype=logits.dtype) for _ in range(2)]
    grads = [torch.autograd.grad(out, logits, cot)[0] for out in (got, want)]
    for a, b in zip(list(got) + grads[:1], list(want) + grads[1:]):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a[~a.isnan()], b[~b.isnan()], atol=1e-12, rtol=1e-12)
    assert got[0][4:8, 1].isnan().sum() == 1 and grads[0][4:8, 1].isnan().sum() == 1  # the others stay finite
    with pytest.raises(ValueError, match="rowptr must rise"):
        softmax_ops.segment_softmax_csr(logits, rowptr.flip(0), plain)
    with pytest.raises(ValueError, match=r"logits must be a float32 or float64 CPU tensor \[E, H\]"):
        softmax_ops.segment_softmax_csr(logits[:, 0], rowptr, plain)
    with pytest.raises(ValueError, match="float32 or float64"):
        softmax_ops.segment_softmax_csr(logits.detach().half(), rowptr, plain)


@pytest.mark.parametrize("aggregation", EquivariantAttention.AGGREGATIONS)
def test_layer_attention_on_the_kernels(aggregation, float64_default, monkeypatch):
    """The layer's output and attention equal the plain path's, and the kernel ran."""
    torch.manual_seed(0)
    layer = EquivariantAttention("4x0e + 2x1o", "4x0e + 2x1o", "4x0e + 2x1o", "2x0e + 2x1o", max_radius=1.2,
                                 num_heads=2, aggregation=aggregation)
    pos = torch.randn(30, 3, requires_grad=True)
    f = layer.irreps_input.randn(30, -1)
    calls = []
    original = softmax_ops.segment_softmax_csr
    monkeypatch.setattr(softmax_ops, "segment_softmax_csr", lambda *a: calls.append(1) or original(*a))
    out, alpha = layer(f, pos, return_attention=True)
    assert calls == [1]
    (force,) = torch.autograd.grad(out.pow(2).sum(), pos)
    ref, ref_alpha = plain(lambda: layer(f, pos, return_attention=True))
    (ref_force,) = torch.autograd.grad(ref.pow(2).sum(), pos)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-13, rtol=0)
    torch.testing.assert_close(force, ref_force, atol=1e-11, rtol=0)
