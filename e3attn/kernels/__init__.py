r"""Compiled kernels: the attention contracted at the nodes, on numba (CPU) or Triton (CUDA).

:class:`~e3attn.attention.EquivariantAttention` contracts its radial weights at the nodes
(:class:`~e3attn.node_contraction.NodeContraction`) and never forms keys, values or weights per edge. One
formulation, two backends, chosen by :func:`backend` for the device of the tensors:

* :mod:`e3attn.kernels.segment_ops`: the custom operators, each one's gradients computed by the other, so every
  order of derivative (forces and their training) runs on them; they dispatch to
* :mod:`e3attn.kernels.segments` (numba, CPU tensors): a kernel over the nodes (``node_pass``) and one for the
  path features, compiled on first use (once per dtype) and cached on disk; or
* :mod:`e3attn.kernels.segments_triton` and :mod:`e3attn.kernels.paths_triton` (Triton, CUDA tensors; CPU tensors
  in Triton's interpreter after :func:`set_cpu_backend` ``("triton")`` or ``E3ATTN_KERNEL_BACKEND=triton``);
* :mod:`e3attn.kernels.layout`: the product's structure as flat arrays, which both backends read;
* :mod:`e3attn.kernels.geometry_ops` and :mod:`e3attn.kernels.softmax_ops`: on the CPU (numba) the edges'
  harmonics, radial first layer and lengths, and the attention's softmax over each node's edges, one pass per
  direction each (``torch.autograd.Function`` s for plain eager tensors, :func:`eager_on_cpu`);
* :mod:`e3attn.kernels.moments_ops`: on the CPU (numba) the angular moments of
  :class:`~e3attn.models.NeighbourDensity` summed at the nodes, with all their derivatives (their plain
  formulation: :mod:`e3attn.kernels.moments`);
* :mod:`e3attn.kernels.cpu`: the numba loops those CPU kernels share;
* :mod:`e3attn.kernels.threads`: the threads that run the numba kernels (PyTorch's own OpenMP threads where
  possible);
* :mod:`e3attn.kernels.index_add`: ATen's ``index_add`` as an operator that compilers call (the traced training
  step's sums at indices).

The kernels run CPU tensors, and CUDA tensors where :func:`set_cuda_kernels` says: by default while a call is
recorded as a CUDA graph (:func:`recording_graph`; the MD calculator's replayed steps, where the kernels' host
cost per launch does not count and the GPU benchmark shows them faster than the plain formulation at every size),
everywhere after ``set_cuda_kernels(True)``, in float32 and float64, outside autocast,
``torch.func`` transforms and forward-mode AD; :func:`fused_enabled` is the one place that decides, and
:func:`segments_enabled` says where the layer contracts at the nodes. Everything else, and
:meth:`~e3attn.attention.EquivariantAttention.dense` and
:meth:`~e3attn.tensor_product.SphericalTensorProduct.forward_factored` everywhere, runs the plain formulation
(PyTorch operations), which :func:`set_fused_kernels` ``(False)`` (or the environment variable
``E3ATTN_FUSED_KERNELS=0``) selects everywhere, e.g. to compare the two.

Example::

    >>> import e3attn.kernels
    >>> e3attn.kernels.fused_enabled(torch.device("cpu"), torch.float32)
    True
    >>> e3attn.kernels.fused_enabled(torch.device("cpu"), torch.float16)  # no kernel: the plain formulation
    False
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from typing import Iterator, Optional

import torch

from .._env import env_flag, env_flag_or_auto
from . import backends
from .backends import backend, set_cpu_backend

__all__ = ["backend", "eager_on_cpu", "fused_enabled", "recording_graph", "segments_enabled", "set_cpu_backend",
           "set_cuda_kernels", "set_fused_kernels"]

_DTYPES = (torch.float32, torch.float64)
_ENABLED = env_flag("E3ATTN_FUSED_KERNELS", True)
_CUDA_ENABLED = env_flag_or_auto("E3ATTN_CUDA_KERNELS")  # None: while a CUDA graph is recorded (the default)
_RECORDING = contextvars.ContextVar("e3attn_recording_graph", default=False)


def _switch(name: str, enabled: Optional[bool], allow_none: bool = False) -> Optional[bool]:
    if not (isinstance(enabled, bool) or (allow_none and enabled is None)):
        raise ValueError(f"enabled must be a bool{' or None' if allow_none else ''}, got {enabled!r}")
    previous = globals()[name]
    globals()[name] = enabled
    return previous


def set_fused_kernels(enabled: bool) -> bool:
    """Switch the compiled kernels on (the default) or off. On, they run where :func:`fused_enabled` says: the
    layer's numba kernels for CPU tensors (its node contraction, :func:`segments_enabled`, its geometry and its
    softmax), and its Triton kernels for CUDA tensors where :func:`set_cuda_kernels` says. Off (also
    ``E3ATTN_FUSED_KERNELS=0``), the plain formulation runs on every device. (The name is that of earlier
    versions, whose kernels fused the tensor product per edge.) Returns the previous setting."""
    return _switch("_ENABLED", enabled)


def set_cuda_kernels(enabled: Optional[bool]) -> Optional[bool]:
    """Where CUDA tensors run on the Triton kernels (the layer's node contraction,
    :mod:`e3attn.kernels.segments_triton`) rather than on the plain formulation:

    * ``None`` (the default; ``E3ATTN_CUDA_KERNELS`` unset or ``auto``): in calls recorded as CUDA graphs
      (:func:`recording_graph`: the calculator's ``cuda_graphs``), where they are faster at every size measured;
      eager calls take the plain formulation, whose lower host cost per operation wins on small graphs (see
      :doc:`/guide/performance`);
    * ``True`` (``E3ATTN_CUDA_KERNELS=1``): everywhere; on large graphs and wide products they are several times
      faster than the plain formulation and take a third of its memory;
    * ``False`` (``E3ATTN_CUDA_KERNELS=0``): nowhere.

    Returns the previous setting."""
    return _switch("_CUDA_ENABLED", enabled, allow_none=True)


@contextlib.contextmanager
def recording_graph() -> Iterator[None]:
    """Within the block, calls on CUDA are being recorded as a CUDA graph, or warm up for one (in this thread or
    task): the Triton kernels run them unless :func:`set_cuda_kernels` ``(False)``. Used by
    ``e3attn._cuda_graph.ReplayedCall``.

    Example::

        >>> cuda, previous = torch.device("cuda"), set_cuda_kernels(None)  # the default
        >>> fused_enabled(cuda, torch.float32)  # an eager call on CUDA takes the plain formulation
        False
        >>> with recording_graph():
        ...     recorded = fused_enabled(cuda, torch.float32)  # True where Triton is installed
        >>> _ = set_cuda_kernels(previous)
    """
    token = _RECORDING.set(True)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def fused_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled kernels run tensors of ``dtype`` on ``device`` (the layer's node contraction,
    :func:`segments_enabled`).

    On the CPU, and on CUDA where :func:`set_cuda_kernels` says (with Triton installed), in float32
    and float64, neither under autocast nor inside a ``torch.func`` transform nor in forward-mode AD
    (``torch.autograd.forward_ad``: the kernels have no forward derivative), unless switched off with
    :func:`set_fused_kernels`.
    """
    if not _ENABLED or dtype not in _DTYPES or device.type not in ("cpu", "cuda"):
        return False
    if (device.type == "cuda" or backends.cpu_backend() == "triton") and not _has_triton():
        return False
    # read where a forward decides its formulation (a ContextVar: a backward on autograd's device threads would not
    # see recording_graph's setting; the backward formulas dispatch on backend() alone)
    if device.type == "cuda" and not (_RECORDING.get() if _CUDA_ENABLED is None else _CUDA_ENABLED):
        return False
    return not (torch.is_autocast_enabled(device.type) or torch._C._are_functorch_transforms_active()
                or torch.autograd.forward_ad._current_level >= 0)


def segments_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`~e3attn.attention.EquivariantAttention` contracts its radial weights at the nodes
    (:class:`~e3attn.node_contraction.NodeContraction`, on the kernels of :mod:`e3attn.kernels.segment_ops`):
    wherever the kernels run (:func:`fused_enabled`), on numba or Triton (:func:`backend`). Elsewhere the layer
    computes keys and values per edge with
    :meth:`~e3attn.tensor_product.SphericalTensorProduct.forward_factored` (PyTorch operations).
    """
    return fused_enabled(device, dtype)


def eager_on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether the layer's autograd-function kernels (:mod:`~e3attn.kernels.geometry_ops`,
    :mod:`~e3attn.kernels.softmax_ops`) may take ``tensors``: plain CPU tensors of float32 or float64, in eager
    mode: no ``torch.compile`` tracing, no dispatch mode, no ``torch.func`` transform, none of them batched (as
    the gradients of ``torch.autograd.grad(..., is_grads_batched=True)`` are). The caller also checks
    :func:`segments_enabled`; with the Triton backend (:func:`set_cpu_backend`) the layer takes the
    plain formulation for them, as on a GPU."""
    return (backends.cpu_backend() == "numba" and _plain_eager(tensors)
            and all(t.device.type == "cpu" and t.dtype in _DTYPES for t in tensors))


def _plain_eager(tensors) -> bool:
    """Plain eager mode for ``tensors`` (:func:`eager_on_cpu`): where the kernels' NumPy views of the tensors are
    their data."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return False
    functorch = torch._C._functorch
    return not any(type(t) is not torch.Tensor or functorch.is_batchedtensor(t) or functorch.is_legacy_batchedtensor(t)
                   for t in tensors)


@functools.lru_cache(maxsize=None)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None
