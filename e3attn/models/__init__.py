r"""Complete models built from :class:`~e3attn.EquivariantAttention`: the equivariant transformer,
energies and forces, checkpoints."""
from .checkpoint import load_checkpoint, save_checkpoint
from .density import NeighbourDensity
from .energy import edge_vectors, energy_and_forces, energy_forces_stress
from .gate import Gate, second_moment_constant
from .norm import EquivariantLayerNorm
from .transformer import EquivariantTransformer

__all__ = [
    "EquivariantTransformer",
    "EquivariantLayerNorm",
    "NeighbourDensity",
    "Gate",
    "second_moment_constant",
    "edge_vectors",
    "energy_and_forces",
    "energy_forces_stress",
    "save_checkpoint",
    "load_checkpoint",
]
