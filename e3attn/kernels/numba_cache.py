r"""numba's on-disk cache of e3attn's kernels, invalidated when any of their sources changes.

numba caches a compiled function next to its module (or in its per-user cache folder) and recompiles it when
*its own file* changes. e3attn's kernels inline helpers from other files (the loops of
:mod:`e3attn.kernels.cpu`), so an edit of a helper alone would leave every kernel that inlines it running the
old code from the cache. :func:`register` puts a cache locator in front of numba's own ones that, for functions
of e3attn's kernel files only, takes the locator numba would have taken and adds to its source stamp a hash of
all of e3attn's numba sources (:data:`SOURCES`): any edit of any of them recompiles every kernel, once.

numba's locators are an internal interface: if it changes, :func:`register` leaves numba's cache as it is.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, List, Optional

__all__ = ["SOURCES", "register", "sources_stamp"]

_PACKAGE = Path(__file__).resolve().parents[1]
#: The files of e3attn that hold numba code (relative to the package); their contents make up the stamp of every
#: kernel.
SOURCES = ("kernels/cpu.py", "kernels/segments.py", "kernels/geometry.py", "kernels/softmax_ops.py",
           "kernels/heads_ops.py", "kernels/moments_ops.py", "graph/csr.py")


def sources_stamp(package: Path = _PACKAGE) -> str:
    """A hash of the contents of :data:`SOURCES` under ``package`` (a missing file counts as empty).

    Example::

        >>> len(sources_stamp())
        64
    """
    digest = hashlib.sha256()
    for name in SOURCES:
        path = package / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()


class _StampedLocator:
    """numba's locator ``base`` for a function of e3attn, with :func:`sources_stamp` added to its source stamp."""

    def __init__(self, base: Any, stamp: str) -> None:
        self._base, self._stamp = base, stamp

    def get_source_stamp(self):
        return (self._base.get_source_stamp(), self._stamp)

    def __getattr__(self, name: str):
        return getattr(self._base, name)


def _locator_class(numba_locators: List[type]) -> type:
    stamp: List[str] = []

    class KernelSourcesLocator:
        """First in numba's list: for e3attn's numba files, the next locator that takes the function, stamped."""

        @classmethod
        def from_function(cls, py_func, py_file) -> Optional[_StampedLocator]:
            try:
                ours = Path(py_file).resolve().relative_to(_PACKAGE).as_posix() in SOURCES
            except (OSError, ValueError):
                ours = False
            if not ours:
                return None
            for locator in numba_locators:
                base = locator.from_function(py_func, py_file)
                if base is not None:
                    stamp[:] = stamp or [sources_stamp()]
                    return _StampedLocator(base, stamp[0])
            return None

    return KernelSourcesLocator


def register() -> bool:
    """Put the stamped locator first in numba's list of cache locators (once; before e3attn's kernels are
    decorated). Returns whether it is registered."""
    try:
        from numba.core import caching

        impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
        locators = impl._locator_classes
    except (ImportError, AttributeError):
        return False
    if any(getattr(c, "__name__", "") == "KernelSourcesLocator" for c in locators):
        return True
    locators.insert(0, _locator_class(list(locators)))
    return True


register()
