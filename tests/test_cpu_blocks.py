"""The register-blocked loops of :mod:`e3attn.kernels.cpu` against NumPy, for every size left over by the blocking."""
import numpy as np
import pytest

pytest.importorskip("numba")
from e3attn.kernels import cpu  # noqa: E402


@pytest.mark.parametrize("n_a", [1, 2, 3, 5])
@pytest.mark.parametrize("n_b", [1, 3, 4, 6, 9])
def test_dots_matches_numpy(n_a, n_b):
    """``_dots`` adds ``a b^T`` into ``out`` at rows ``stride`` apart, and touches nothing else."""
    rng = np.random.default_rng(n_a * 10 + n_b)
    n, off, base, stride = 7, 2, 3, n_b + 2
    a, b = rng.standard_normal((off + n_a + 1, n + 3)), rng.standard_normal((n_b, n + 3))
    out = rng.standard_normal(base + n_a * stride + 4)
    expected = out.copy()
    for i in range(n_a):
        expected[base + i * stride : base + i * stride + n_b] += a[off + i, :n] @ b[:, :n].T
    cpu._dots(out, base, stride, a, off, n_a, b, n_b, n, 0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("n_out", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("n_rows", [1, 3, 4, 6, 9])
def test_mac_matches_numpy(n_out, n_rows):
    """``_mac`` adds ``C X`` (``C`` read from ``coef`` with both strides) into the rows of ``out``, no others."""
    rng = np.random.default_rng(n_out * 10 + n_rows)
    n, out_off, rows_off, base = 11, 1, 2, 5
    out_stride, row_stride = 1, n_out  # coef[base + o + r n_out]: the transposed layout, as in node_pass
    out = rng.standard_normal((out_off + n_out + 1, n + 2))
    rows = rng.standard_normal((rows_off + n_rows + 1, n + 2))
    coef = rng.standard_normal(base + n_out * n_rows + 3)
    c = coef[base : base + n_out * n_rows].reshape(n_rows, n_out).T
    expected = out.copy()
    expected[out_off : out_off + n_out, :n] += c @ rows[rows_off : rows_off + n_rows, :n]
    cpu._mac(out, out_off, n_out, rows, rows_off, n_rows, coef, base, out_stride, row_stride, n)
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-13)
