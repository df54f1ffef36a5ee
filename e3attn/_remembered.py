r"""Checks of a tensor's values remembered while the tensor is unchanged, so that constant inputs are checked once.

The numba kernels index without bounds checks, so :mod:`e3attn.kernels.segment_ops` checks the values of the
index tensors it is given (``rowptr`` rising, ``index`` within the rows, the block table within the sizes). A
model reuses the same tensors for all its layers and both directions, and the block tables for every call: each
check runs once per tensor and version. The version counter sees every in-place change made through PyTorch;
it does not see writes through ``.data``, through a NumPy view (``.numpy()``) or to the array behind
``torch.from_numpy``: change a tensor that way and it is not checked again. The notes live in a dictionary keyed by
the tensors' identity, each with a weak reference to its tensor: nothing is added to the tensors or their pickles,
and a note goes with its tensor. A lookup costs a dictionary access (kernels look up their index tensors on every
call).
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["checked", "remember"]

# id(tensor) -> (a weak reference to it, its version, the check, its result), while the tensor lives
_NOTES: Dict[int, Tuple[weakref.ref, int, Any, Any]] = {}


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
    note = _NOTES.get(id(t))
    return note[3] if note is not None and note[0]() is t and note[1] == t._version and note[2] == key else None


def remember(t: torch.Tensor, key: Any, value: Any) -> None:
    """Note that ``t`` passed the check ``key`` (with a result ``value``), valid until ``t`` changes in place.
    Plain tensors with a version counter only (others are checked every time: tensor subclasses, compile-time
    and inference tensors)."""
    if type(t) is torch.Tensor and not t.is_inference():
        identity = id(t)
        _NOTES[identity] = (weakref.ref(t, lambda ref: _forget(identity, ref)), t._version, key, value)


def _forget(identity: int, ref: weakref.ref) -> None:
    """Drop the note of a tensor that is gone (unless the note is already another tensor's of the same identity)."""
    note = _NOTES.get(identity)
    if note is not None and note[0] is ref:
        del _NOTES[identity]
