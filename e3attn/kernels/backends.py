r"""Which kernels run the tensors of a device: the one dispatch point of :mod:`e3attn.kernels` (re-exported there).

Numba on the CPU, Triton on CUDA; CPU tensors on Triton too (in Triton's interpreter, to test the GPU's kernels
without a GPU) after :func:`set_cpu_backend` ``("triton")`` or with the environment variable
``E3ATTN_KERNEL_BACKEND=triton``, read when e3attn is imported.

Example::

    >>> backend(torch.device("cpu")), backend(torch.device("cuda"))
    ('numba', 'triton')
"""
from __future__ import annotations

import sys

import torch

from .._env import env_choice, set_default

__all__ = ["BACKENDS", "backend", "cpu_backend", "set_cpu_backend"]

BACKENDS = ("numba", "triton")  # the backends of CPU tensors


def _backend_from_environment() -> str:
    """``E3ATTN_KERNEL_BACKEND``: the backend of CPU tensors, ``numba`` (the default) or ``triton`` (Triton's
    interpreter, switched on here where there is no GPU and Triton is not imported yet)."""
    value = env_choice("E3ATTN_KERNEL_BACKEND", BACKENDS, "numba")
    if value == "triton" and "triton" not in sys.modules and not torch.cuda.is_available():
        set_default("TRITON_INTERPRET", "1")  # read by Triton when it is imported
    return value


_CPU_BACKEND = _backend_from_environment()


def set_cpu_backend(name: str) -> str:
    """Run the kernels of CPU tensors on ``"numba"`` (the default) or on ``"triton"``: the Triton kernels of the
    GPU in Triton's interpreter, slowly, to test them without a GPU (``TRITON_INTERPRET=1`` must have been set
    before Triton was imported; ``E3ATTN_KERNEL_BACKEND=triton`` sets both). Returns the previous setting."""
    global _CPU_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"name must be one of {', '.join(BACKENDS)}, got {name!r}")
    previous, _CPU_BACKEND = _CPU_BACKEND, name
    return previous


def backend(device: torch.device) -> str:
    """The kernels that run tensors on ``device``: ``"triton"`` on CUDA, and on the CPU ``"numba"`` or, after
    :func:`set_cpu_backend` ``("triton")`` (or ``E3ATTN_KERNEL_BACKEND=triton``), ``"triton"``. The one
    place that decides; :func:`e3attn.kernels.fused_enabled` and :func:`e3attn.kernels.segments_enabled` say
    whether kernels run at all."""
    if device.type == "cpu":
        return _CPU_BACKEND
    if device.type != "cuda":
        raise NotImplementedError(f"no e3attn kernel for device {device.type!r}")
    return "triton"


def cpu_backend() -> str:
    """The backend of CPU tensors (:func:`set_cpu_backend`)."""
    return _CPU_BACKEND
