"""Float64 constants that follow a module's device but never lose precision.

``module.float()`` followed by ``module.double()`` would round an ordinary
buffer to float32 and back. Constants registered here are kept in float64 for
the whole life of the module (moved between devices only) and cast to the
working dtype where they are used, so a layer built under the default float32
and moved to float64 is as accurate as one built in float64.
"""
from __future__ import annotations

import torch

from ._tracing import tracing


class Float64ConstantsModule(torch.nn.Module):
    """Base class for modules holding float64 constants (Clebsch-Gordan blocks, basis centres)."""

    def __init__(self) -> None:
        super().__init__()
        self._float64_constants: list = []
        self._casts: dict = {}

    def register_constant(self, name: str, value: torch.Tensor) -> None:
        """Register ``value`` (converted to float64) as the non-persistent buffer ``name``."""
        self.register_buffer(name, value.to(torch.float64), persistent=False)
        self._float64_constants.append(name)

    def constant(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The constant ``name`` cast to ``dtype``, cached while the buffer stays the same tensor.

        Not cached under ``torch.inference_mode`` (an inference tensor cannot be saved for a
        later backward) nor while ``torch.compile`` or ``make_fx`` traces (:func:`~e3attn._tracing.tracing`: the
        cast would be one of the trace's proxies).
        """
        value = self._buffers[name]
        if dtype == value.dtype or tracing() or torch.is_inference_mode_enabled():
            return value.to(dtype)
        source, cast = self._casts.get((name, dtype), (None, None))
        if source is not value:  # first use, or the buffer was replaced (moved, functional_call, a replica)
            cast = value.to(dtype)
            self._casts[(name, dtype)] = (value, cast)
        return cast

    def _apply(self, fn, recurse=True):  # noqa: D401 - torch.nn.Module override
        kept = {name: self._buffers[name] for name in self._float64_constants}
        self._casts.clear()
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(device=self._buffers[name].device)
        return self
