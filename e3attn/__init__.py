r"""e3attn: SE(3)/O(3)-equivariant graph attention on e3nn and PyTorch."""
from . import kernels  # first: E3ATTN_KERNEL_BACKEND=triton sets TRITON_INTERPRET before e3nn imports Triton
from .attention import EquivariantAttention
from .graph import complete_graph, radius_graph, radius_graph_pbc
from .heads import MultiHeadDot, head_index, scale_heads, split_heads
from .linear import IrrepsLinear
from .multihead import GraphMultiHeadAttention, MultiHeadAttention
from .plain import dense_attention, graph_attention
from .radial import RadialEmbedding, RadialMLP, cutoff_weight, soft_unit_step
from .scatter import scatter_max, scatter_sum, segment_softmax
from .spherical_harmonics import SphericalHarmonics
from .tensor_product import SphericalTensorProduct
from . import models, testing, viz

__version__ = "0.1.0"

__all__ = [
    "EquivariantAttention",
    "radius_graph",
    "radius_graph_pbc",
    "complete_graph",
    "dense_attention",
    "graph_attention",
    "MultiHeadAttention",
    "GraphMultiHeadAttention",
    "RadialEmbedding",
    "RadialMLP",
    "cutoff_weight",
    "soft_unit_step",
    "SphericalTensorProduct",
    "SphericalHarmonics",
    "IrrepsLinear",
    "MultiHeadDot",
    "split_heads",
    "head_index",
    "scale_heads",
    "scatter_sum",
    "scatter_max",
    "segment_softmax",
    "models",
    "testing",
    "viz",
]
