"""Inductor's C++ builds of a CPU graph, the wrapper and the kernels compiled side by side.

With a C++ wrapper compiled apart from the kernels (:data:`e3attn._tracing.CPU_INDUCTOR_OPTIONS`), inductor builds a
graph of CPU tensors as two translation units, the wrapper's glue and the kernels, each an object file from one
compiler process, then links them; it runs the two compilers one after the other, in
``torch._inductor.codecache._worker_compile_cpp``. For the training command's step each takes 20 to 30 s (measured
on its model of degree 1), so within :func:`objects_built_in_parallel` they run at the same time, on two cores,
and the first call of a compiled graph is shorter by about the shorter of the two. The objects and the library
are the same files; only their order of building changes. Where the installed inductor builds in another way
(another signature of that function, other builders), or is told to compile in one thread (``compile_threads``
1), it builds as it would without this module.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence

__all__ = ["objects_built_in_parallel"]


def _serial_builder() -> Optional[Callable]:
    """Inductor's function that builds a graph's objects and library one after the other, or None where the
    installed inductor has none of the signature this module knows."""
    try:
        from torch._inductor import codecache

        serial = codecache._worker_compile_cpp
        parameters = list(inspect.signature(serial).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return serial if parameters == ["lock_path", "cpp_builders"] and serial is not _build else None


def _objects_and_link(builders: Sequence[Any]) -> Optional[tuple]:
    """``(objects, link)`` where ``builders`` are object files and, last, the library linked from them alone."""
    if len(builders) < 3:
        return None
    *objects, link = builders
    try:
        targets = [b.get_target_file_path() for b in objects]
        commands = [b.get_command_line() for b in objects]
        link_command = link.get_command_line()
    except AttributeError:
        return None
    independent = not any(target in command for i, target in enumerate(targets)  # no object built from another
                          for j, command in enumerate(commands) if i != j)
    return (objects, link) if independent and all(t in link_command for t in targets) else None


def _build(lock_path: str, cpp_builders: Sequence[Any]) -> None:
    """Build what is missing of ``cpp_builders``, as inductor's ``_worker_compile_cpp`` does, but the object files of
    a split build in parallel, unless inductor is told to compile in one thread (``compile_threads`` 1). A function
    of the module, so that a process pool of inductor's could run it too. A compiler's error is raised as
    inductor raises it, once the other compiler has ended."""
    from torch._inductor import codecache, config

    try:
        from torch.utils._filelock import FileLock  # inductor's own, with its wait counters
    except ImportError:
        from filelock import FileLock

    def missing(builders: Sequence[Any]) -> list:
        return [b for b in builders if not os.path.exists(b.get_target_file_path())]

    one_thread = config.compile_threads is not None and config.compile_threads <= 1  # None: inductor decides later
    split = None if one_thread else _objects_and_link(cpp_builders)
    with FileLock(lock_path, timeout=codecache.LOCK_TIMEOUT):
        if split is None:
            for builder in missing(cpp_builders):
                builder.build()
            return
        objects, link = split
        todo = missing(objects)
        if todo:
            with ThreadPoolExecutor(len(todo)) as pool:  # the compilers are processes: the threads wait on them
                for done in [pool.submit(b.build) for b in todo]:
                    done.result()
        for builder in missing([link]):
            builder.build()


@contextlib.contextmanager
def objects_built_in_parallel() -> Iterator[None]:
    """Within this context inductor compiles the object files of a graph built in several units (a C++ wrapper and
    its kernels) in parallel compiler processes, then links them, under the same lock as it does itself. Not
    thread-safe (it replaces a function of inductor's module while it lasts), like the compiling it serves.

    Example::

        >>> with objects_built_in_parallel():
        ...     pass  # torch.compile's first call of a CPU graph here
    """
    serial = _serial_builder()
    if serial is None:  # an inductor that builds in another way, or already inside this context
        yield
        return
    from torch._inductor import codecache

    codecache._worker_compile_cpp = _build
    try:
        yield
    finally:
        codecache._worker_compile_cpp = serial
