import os

import torch

# Without CUDA, Triton's interpreter runs the Triton kernels on CPU tensors (tests/test_triton.py). It must be
# chosen before triton is first imported: triton.language's own helpers are decorated at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from e3attn import kernels  # noqa: E402
from e3attn.testing._common import _default_dtype  # noqa: E402


@pytest.fixture
def float32_default():
    """Run a test under the default dtype float32 (and restore the previous default)."""
    with _default_dtype(torch.float32):
        yield


@pytest.fixture
def float64_default():
    """Run a test under the default dtype float64, as e3nn's own constants need for float64 references."""
    with _default_dtype(torch.float64):
        yield


@pytest.fixture(params=["numba", "triton"])
def backend(request):
    """Run a test on each backend of the CPU kernels (:func:`e3attn.kernels.set_cpu_backend`): numba, and the
    Triton kernels of the GPU in Triton's interpreter (``TRITON_INTERPRET=1`` above)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("Triton's interpreter is off where CUDA is (tests/test_triton.py runs the kernels there)")
    previous = kernels.set_cpu_backend(request.param)
    try:
        yield request.param
    finally:
        kernels.set_cpu_backend(previous)
