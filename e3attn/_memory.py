r"""Keeping the memory that a call frees for the next call of the same sizes (glibc's ``malloc`` settings).

A molecular-dynamics step allocates the same tensors at every call: at thousands of atoms, tens of blocks of
several MiB to hundreds of MiB. By default glibc serves blocks above an adaptive threshold (at most 32 MiB) with
``mmap`` and gives them back to the system when they are freed, and it trims the top of its heap; the next call
then faults every page back in (at 16,384 atoms on one thread, about 120,000-210,000 faults and 0.4-0.75 s of
system time per call of 1.0-1.7 s, ``benchmarks/md_speed.py --no-keep-memory``). :func:`keep_freed_memory` makes
the process keep that memory instead, as PyTorch's caching allocator does on GPUs: ``mallopt(M_MMAP_MAX, 0)``
(large blocks from the heap too) and ``mallopt(M_TRIM_THRESHOLD, -1)`` (the heap is never trimmed), the settings
that ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=-1`` in the environment give a process from its start. The
process then keeps its largest memory use until it ends (``malloc_trim(0)`` gives the free memory back); the
setting covers the heap of the main thread (other threads' arenas still map and unmap their own heaps), and
forked children inherit it.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_lock = threading.Lock()
_kept = False


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed memory in the process (process-wide, from now until the process ends; see
    the module docstring). Returns whether it does: False where the C library is not glibc (macOS, Windows, musl),
    where nothing is changed. Calling it again changes nothing more."""
    global _kept
    with _lock:
        libc = None if _kept else _glibc()
        if libc is not None:
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            # -1: "disables trimming completely" (mallopt(3)); both return 1 on success
            _kept = bool(mallopt(_M_MMAP_MAX, 0)) & bool(mallopt(_M_TRIM_THRESHOLD, -1))
        return _kept


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library if it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
    except (OSError, TypeError, AttributeError):  # Windows: no CDLL(None); macOS, musl: not glibc
        return None
    return libc
