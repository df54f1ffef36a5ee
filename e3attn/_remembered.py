r"""Checks of a tensor's values remembered while the tensor is unchanged, so that constant inputs are checked once.

The numba kernels index without bounds checks, so :mod:`e3attn.kernels.segment_ops` checks the values of the
index tensors it is given (``rowptr`` rising, ``index`` within the rows, the block table within the sizes). A
model reuses the same tensors for all its layers and both directions, and the block tables for every call: each
check runs once per tensor and version. The version counter sees every in-place change made through PyTorch;
it does not see writes through ``.data``, through a NumPy view (``.numpy()``) or to the array behind
``torch.from_numpy``: change a tensor that way and it is not checked again. The notes live in a weak dictionary
keyed by the tensors' identity: nothing is added to the tensors or their pickles, and a note goes with its tensor.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["checked", "remember"]

_NOTES = WeakIdKeyDictionary()  # tensor -> (its version, the check, its result), while the tensor lives


def checked(t: torch.Tensor, key: Any) -> Optional[Any]:
    """The result :func:`remember` noted for ``t`` and the check ``key``, while ``t`` is unchanged (same version);
    else None.

    Example::

        >>> t = torch.arange(3)
        >>> remember(t, "rising", True)
        >>> checked(t, "rising"), checked(t, "other")
        (True, None)
        >>> t[0] = 5
        >>> checked(t, "rising") is None
        True
    """
    note = _NOTES.get(t)
    return note[2] if note is not None and note[0] == t._version and note[1] == key else None


def remember(t: torch.Tensor, key: Any, value: Any) -> None:
    """Note that ``t`` passed the check ``key`` (with a result ``value``), valid until ``t`` changes in place.
    Plain tensors with a version counter only (others are checked every time: tensor subclasses, compile-time
    and inference tensors)."""
    if type(t) is torch.Tensor and not t.is_inference():
        _NOTES[t] = (t._version, key, value)
