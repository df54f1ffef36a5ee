r"""Fused kernels for :meth:`SphericalTensorProduct.forward_factored <e3attn.tensor_product.SphericalTensorProduct.forward_factored>`.

One compiled pass over the edges per direction, forces included: the second derivative reuses the
same two kernels through the multilinearity of the product (see :mod:`e3attn.kernels.ops`).

* :mod:`e3attn.kernels.layout`: the product's structure as flat arrays;
* :mod:`e3attn.kernels.cpu`: numba kernels (CPU, float32 and float64), compiled on first use and
  cached on disk;
* :mod:`e3attn.kernels.ops`: the custom operators ``e3attn::fused_product`` and
  ``e3attn::fused_product_backward``.

**Status: opt-in.** On the 2-core AMD EPYC (Zen 1) VM this project is measured on they are correct
to 1e-13 in float64 (values, first and second derivatives) but still slower than the default
chunked path (``python benchmarks/layer.py --forces --kernels fused``; the docs' *Performance*
page has the figures), so :meth:`forward_factored` uses them only after
:func:`set_fused_kernels` ``(True)`` or with the environment variable ``E3ATTN_FUSED_KERNELS=1``.
:func:`fused_enabled` is the one place that decides. They need ``numba``
(``pip install numba``).

Example::

    >>> import e3attn.kernels
    >>> e3attn.kernels.set_fused_kernels(False)  # the default
    >>> e3attn.kernels.fused_enabled(torch.device("cpu"), torch.float32)
    False
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

__all__ = ["fused_enabled", "fused_factored_product", "set_fused_kernels"]

_DTYPES = (torch.float32, torch.float64)
_ENABLED = os.environ.get("E3ATTN_FUSED_KERNELS", "0") not in ("", "0")


def set_fused_kernels(enabled: bool) -> None:
    """Use the fused kernels in ``forward_factored`` where they run (CPU, float32 and float64), or not."""
    global _ENABLED
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    if enabled:
        from . import ops  # noqa: F401  (fails here, with numba's ImportError, when numba is missing)
    _ENABLED = enabled


def fused_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``forward_factored`` runs the fused kernels for tensors of ``dtype`` on ``device``.

    Only when enabled (:func:`set_fused_kernels`), on the CPU, in float32 and float64, and neither
    under autocast nor inside a ``torch.func`` transform (those take the plain formulation).
    """
    if not _ENABLED or dtype not in _DTYPES or device.type != "cpu":
        return False
    return not (torch.is_autocast_enabled(device.type) or torch._C._are_functorch_transforms_active())


def fused_factored_product(spec: str, x: torch.Tensor, sh: torch.Tensor, hidden: Sequence[torch.Tensor],
                           linear: Sequence[torch.Tensor], index: Optional[torch.Tensor] = None,
                           tile: int = 0) -> List[torch.Tensor]:
    """The outputs of ``forward_factored`` of the product named by ``spec`` through ``e3attn::fused_product``."""
    from . import ops
    from .layout import layout_for

    hidden_cat = torch.cat(list(hidden), dim=1) if len(hidden) > 1 else hidden[0]
    linear_flat = torch.cat([w.reshape(-1) for w in linear]) if len(linear) > 1 else linear[0].reshape(-1)
    out = ops.fused_product(spec, tile, x, index, sh, hidden_cat, linear_flat, [h.shape[1] for h in hidden])
    layout = layout_for(spec)
    sizes = [b - a for a, b in zip(layout.out_offsets, (*layout.out_offsets[1:], layout.out_dim))]
    return list(out.split(sizes, dim=1))
