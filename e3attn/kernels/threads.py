r"""The threads that run the CPU kernels' groups of work.

The numba kernels (:mod:`e3attn.kernels.segments`, :mod:`e3attn.kernels.geometry`) split their work into groups
(of tiles of edges, or of nodes) and release the GIL, so several threads run them at once. :func:`parallel` runs
``task(g)`` for every group on as many threads as PyTorch's operations use (``torch.get_num_threads()``):

* on **PyTorch's own OpenMP threads**, where its OpenMP runtime exports ``GOMP_parallel`` (GNU libgomp, the
  runtime of PyTorch's Linux wheels; LLVM's libomp has it too). Those threads run PyTorch's operations, and
  after each one they spin for a while waiting for the next; taking them for the kernels' groups costs no
  thread wake-up. A separate pool of threads would instead compete for the cores with the spinning ones: on the
  2-core machine of this project's benchmarks that made the layer 1.2-1.3x slower on 2 threads;
* elsewhere, or with the environment variable ``E3ATTN_KERNEL_THREADS=python``, on a pool of Python threads
  with the calling thread.

A call with little work (below :data:`SERIAL_BELOW`; on the e3nn guide's layer, graphs of up to about 3,000
edges) runs on the calling thread alone: threads gain it nothing, and beside busy processes a parallel call can
wait a whole scheduler time slice for a thread that was preempted. Otherwise every thread takes the next group
until none is left (a thread held up on a busy core holds nobody else up), and the call returns once every group
is done; an error raised by a group is raised then. The groups write disjoint outputs (or buffers of their own,
summed in order), so results do not depend on the threads.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import itertools
import os
import threading
from typing import Callable, Dict, List, Optional

import torch

from .._env import env_choice

__all__ = ["parallel", "backend", "threads_for", "groups_for", "reduction_groups", "SERIAL_BELOW"]

_Task = Callable[[int], None]


#: Calls with less work than this (in multiply-adds, about a few tenths of a millisecond) run on the calling thread.
SERIAL_BELOW = 4_000_000


def parallel(task: _Task, groups: int, work: int) -> None:
    """``task(g)`` for every group ``0 <= g < groups``, on ``torch.get_num_threads()`` threads at most
    (see the module docstring), or on the calling thread if ``work`` (the call's multiply-adds, roughly) is
    below :data:`SERIAL_BELOW`. Safe to call from several threads at once."""
    threads = min(threads_for(work), groups)
    if threads <= 1:
        for group in range(groups):
            task(group)
        return
    (_openmp_parallel if backend() == "openmp" else _pool_parallel)(task, groups, threads)


def threads_for(work: int) -> int:
    """The threads that :func:`parallel` would give a call of ``work`` multiply-adds with enough groups: 1 below
    :data:`SERIAL_BELOW` (a caller may then do its work as a single group)."""
    return torch.get_num_threads() if work >= SERIAL_BELOW else 1


def groups_for(work: int, groups: int) -> int:
    """``groups``, the split of a call of ``work`` multiply-adds for the threads, or 1 where :func:`parallel` would
    run it on the calling thread (more groups would only add calls). For splits that do not change the result."""
    return groups if threads_for(work) > 1 else 1


def reduction_groups(work: int, most: int) -> int:
    """The groups of a call of ``work`` multiply-adds whose groups sum into buffers of their own (added up in
    order afterwards): one per :data:`SERIAL_BELOW` of work, at most ``most``. A function of the work alone, never
    of the threads, so that the sums are bitwise the same on any number of threads."""
    return max(1, min(most, work // max(1, SERIAL_BELOW)))


def backend() -> str:
    """``"openmp"`` (PyTorch's OpenMP threads) or ``"python"`` (a pool of Python threads): what :func:`parallel`
    runs on."""
    choice = env_choice("E3ATTN_KERNEL_THREADS", ("openmp", "python"), "openmp")
    return "python" if choice == "python" or _gomp_parallel() is None else "openmp"


def _drain(task: _Task, groups: int, claim: Callable[[], int]) -> None:
    group = claim()
    while group < groups:
        task(group)
        group = claim()


# ---------------------------------------------------------------------- PyTorch's OpenMP threads

_BODY_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_JOBS: Dict[int, tuple] = {}  # by key: (task, groups, claim, errors), one per call in flight
_KEYS = itertools.count(1)
_GOMP: List[Optional[ctypes._CFuncPtr]] = []  # GOMP_parallel, or None, once looked up


def _gomp_parallel() -> Optional[ctypes._CFuncPtr]:
    """``GOMP_parallel`` of the OpenMP runtime that PyTorch loaded (its own copy first), or None."""
    if not _GOMP:
        function = None
        libraries = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*")))
        for library in libraries + [None]:  # None: the symbols already loaded into the process
            try:
                function = ctypes.CDLL(library).GOMP_parallel
                break
            except (OSError, AttributeError, TypeError):
                continue
        if function is not None:
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            function.restype = None
        _GOMP.append(function)
    return _GOMP[0]


@_BODY_TYPE
def _body(key: int) -> None:
    """What every thread of the OpenMP team runs (with the GIL only between groups: the kernels release it)."""
    task, groups, claim, errors = _JOBS[key]
    try:
        _drain(task, groups, claim)
    except BaseException as error:  # raised by the caller once the team is done
        errors.append(error)


def _openmp_parallel(task: _Task, groups: int, threads: int) -> None:
    key, errors = next(_KEYS), []
    _JOBS[key] = (task, groups, itertools.count().__next__, errors)  # next() on a count is atomic under the GIL
    try:
        _gomp_parallel()(ctypes.cast(_body, ctypes.c_void_p), key, threads, 0)  # releases the GIL until all are done
    finally:
        del _JOBS[key]
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------- a pool of Python threads

_POOLS: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # by number of pool threads
_POOLS_LOCK = threading.Lock()


def _pool_parallel(task: _Task, groups: int, threads: int) -> None:
    with _POOLS_LOCK:
        pool = _POOLS.get(threads - 1)
        if pool is None:
            pool = _POOLS[threads - 1] = concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="e3attn")
    claim = itertools.count().__next__
    helpers = [pool.submit(_drain, task, groups, claim) for _ in range(threads - 1)]
    try:
        _drain(task, groups, claim)
    finally:  # the helpers write into the caller's buffers: wait for them even if this thread failed
        for future in helpers:
            future.result()
