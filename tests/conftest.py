import pytest
import torch


@pytest.fixture
def float32_default():
    """Run a test under the default dtype float32 (and restore the previous default)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.fixture
def float64_default():
    """Run a test under the default dtype float64, as e3nn's own constants need for float64 references."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
