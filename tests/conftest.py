import pytest
import torch

from e3attn.testing import _default_dtype


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
