import os

import torch

# Without CUDA, Triton's interpreter runs the Triton kernels on CPU tensors (tests/test_triton.py). It must be
# chosen before triton is first imported: triton.language's own helpers are decorated at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from e3attn.testing import _default_dtype  # noqa: E402


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
