"""The environment variables that e3attn reads, each parsed here: a typo is an error naming the variable.

A switch (:func:`env_flag`) takes ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off``
(:func:`env_flag_or_auto`: also ``auto``); a choice (:func:`env_choice`) takes one of its values. All ignore case
and surrounding whitespace, and read an unset or empty variable as its default. Anything else raises a ValueError
that names the variable and what it accepts.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

__all__ = ["env_choice", "env_flag", "env_flag_or_auto", "set_default"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _read(name: str) -> str:
    """The variable's value, stripped and lower-cased ("" when unset)."""
    return os.environ.get(name, "").strip().lower()


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name``: True for 1, true, yes, on; False for 0, false, no, off; ``default`` when unset or empty.

    Example::

        >>> os.environ["E3ATTN_EXAMPLE"] = " Off "
        >>> env_flag("E3ATTN_EXAMPLE", True)
        False
        >>> del os.environ["E3ATTN_EXAMPLE"]
    """
    value = _read(name)
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"{name} must be 1, true, yes or on (enabled), 0, false, no or off (disabled), in any case, or unset; "
        f"got {os.environ[name]!r}"
    )


def env_flag_or_auto(name: str) -> Optional[bool]:
    """The switch ``name`` with a third setting: True and False as :func:`env_flag` reads them, None for ``auto``
    or when unset or empty (the caller decides).

    Example::

        >>> os.environ["E3ATTN_EXAMPLE"] = "Auto"
        >>> env_flag_or_auto("E3ATTN_EXAMPLE") is None
        True
        >>> del os.environ["E3ATTN_EXAMPLE"]
    """
    value = _read(name)
    if not value or value == "auto":
        return None
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"{name} must be 1, true, yes or on (enabled), 0, false, no or off (disabled), auto, in any case, or unset; "
        f"got {os.environ[name]!r}"
    )


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """The choice ``name``: one of ``choices`` (given in lower case), ``default`` when unset or empty.

    Example::

        >>> os.environ["E3ATTN_EXAMPLE"] = "Python"
        >>> env_choice("E3ATTN_EXAMPLE", ("openmp", "python"), "openmp")
        'python'
        >>> del os.environ["E3ATTN_EXAMPLE"]
    """
    value = _read(name)
    if not value:
        return default
    if value in choices:
        return value
    listed = [repr(choice) for choice in choices]
    alternatives = " or ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 1 else listed)
    raise ValueError(f"{name} must be {alternatives} (in any case, or unset), got {os.environ[name]!r}")


def set_default(name: str, value: str) -> None:
    """Set the variable ``name`` to ``value`` unless it is set: for a variable that another library reads when it is
    imported (``TRITON_INTERPRET`` for Triton)."""
    os.environ.setdefault(name, value)
