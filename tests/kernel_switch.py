"""Run a test's code with e3attn's compiled kernels switched off: the plain formulation, for comparisons."""
from typing import Callable, TypeVar

from e3attn import kernels

T = TypeVar("T")


def plain(fn: Callable[[], T]) -> T:
    """``fn()`` with :func:`e3attn.kernels.set_fused_kernels` ``(False)``, the previous setting restored after."""
    previous = kernels.set_fused_kernels(False)
    try:
        return fn()
    finally:
        kernels.set_fused_kernels(previous)
