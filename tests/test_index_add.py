"""e3attn::index_add (e3attn.kernels.index_add): the values of torch.index_add, as an operator of its own."""
import pytest
import torch

import e3attn.kernels.index_add  # noqa: F401 (defines the operator)

index_add = torch.ops.e3attn.index_add.default


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, dim", [((5,), 0), ((5, 3), 0), ((4, 5, 3), 1), ((2, 3, 5), -1), ((5, 15, 16), 0)])
def test_the_values_of_torch_index_add_with_repeated_indices(dtype, shape, dim):
    g = torch.Generator().manual_seed(0)
    self = torch.randn(shape, generator=g, dtype=dtype)
    edges = 11
    index = torch.randint(0, shape[dim], (edges,), generator=g)
    source_shape = list(shape)
    source_shape[dim] = edges
    source = torch.randn(source_shape, generator=g, dtype=dtype)
    out = index_add(self, dim, index, source)
    expected = self.clone()  # the definition, row by row in index order
    for e in range(edges):
        expected.select(dim, int(index[e])).add_(source.select(dim, e))
    assert torch.allclose(out, expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)
    assert out.data_ptr() != self.data_ptr() and not torch.equal(self, out)  # a new tensor; self unchanged


def test_gradients_of_every_order():
    g = torch.Generator().manual_seed(1)
    self = torch.randn(4, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    source = torch.randn(4, 6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 0, 4, 2, 0, 0])
    assert torch.autograd.gradcheck(lambda a, b: index_add(a, 1, index, b), (self, source))
    assert torch.autograd.gradgradcheck(lambda a, b: index_add(a, 1, index, b), (self, source))


def test_other_layouts_and_dtypes_and_torch_index_add_s_errors():
    self, index = torch.zeros(4, 3), torch.tensor([0, 3])
    cases = [(self.t(), 1, index, torch.ones(3, 2)),  # not contiguous
             (self.long(), 0, index, torch.ones(2, 3, dtype=torch.long)),  # integers
             (self, 0, index.int(), torch.ones(2, 3)),  # an int32 index
             (torch.zeros(()), 0, torch.tensor([0]), torch.ones(()))]  # zero dimensions
    for args in cases:
        assert torch.equal(index_add(*args), torch.index_add(*args))
    assert torch.equal(index_add(self, 0, index[:0], torch.ones(0, 3)), self)  # no rows
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        index_add(self, 0, torch.tensor([0, 4]), torch.ones(2, 3))  # ATen's check
    with pytest.raises((IndexError, RuntimeError)):
        index_add(self, 0, torch.tensor([-1, 0]), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="same scalar type"):
        index_add(self, 0, index, torch.ones(2, 3, dtype=torch.float64))


def test_fake_tensors_and_the_operator_s_registration():
    args = (torch.randn(4, 3), 0, torch.tensor([1, 1, 2]), torch.randn(3, 3))
    torch.library.opcheck(index_add, args, test_utils=("test_schema", "test_faketensor"))
    meta = index_add(torch.zeros(4, 3, device="meta"), 0, torch.zeros(3, dtype=torch.long, device="meta"),
                     torch.zeros(3, 3, device="meta"))
    assert meta.shape == (4, 3) and meta.device.type == "meta"
