"""numba's cache of e3attn's kernels follows all their sources (e3attn.kernels.numba_cache)."""
import shutil
from pathlib import Path

import numba
import pytest

import e3attn
from e3attn.graph import csr
from e3attn.kernels import geometry, heads_ops, numba_cache, segments, softmax_ops

PACKAGE = Path(e3attn.__file__).parent


def _kernels(module):
    return [f for f in vars(module).values() if isinstance(f, numba.core.registry.CPUDispatcher) and f._cache is not None
            and getattr(f._cache, "_impl", None) is not None and f.py_func.__module__ == module.__name__]


def test_every_numba_source_is_listed():
    """Every file of e3attn that compiles numba kernels is in SOURCES (an unlisted one would cache stale helpers)."""
    with_kernels = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "njit" in p.read_text()}
    assert with_kernels == set(numba_cache.SOURCES)


@pytest.mark.parametrize("module", [segments, geometry, softmax_ops, heads_ops, csr])
def test_kernels_are_stamped_with_all_sources(module):
    kernels = _kernels(module)
    assert kernels, module.__name__
    for kernel in kernels:
        stamp = kernel._cache._impl.locator.get_source_stamp()
        assert isinstance(stamp, tuple) and stamp[1] == numba_cache.sources_stamp(), kernel.__name__


def test_stamp_changes_with_any_source_only(tmp_path):
    for name in numba_cache.SOURCES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PACKAGE / name, tmp_path / name)
    (tmp_path / "other.py").write_text("x = 1\n")
    before = numba_cache.sources_stamp(tmp_path)
    assert before == numba_cache.sources_stamp()
    (tmp_path / "other.py").write_text("x = 2\n")
    assert numba_cache.sources_stamp(tmp_path) == before
    for name in numba_cache.SOURCES:
        path = tmp_path / name
        text = path.read_text()
        path.write_text(text + "# edited\n")
        assert numba_cache.sources_stamp(tmp_path) != before, name
        path.write_text(text)
    assert numba_cache.sources_stamp(tmp_path) == before


def test_other_functions_keep_numbas_locator(tmp_path):
    """Functions outside e3attn's numba files are left to numba's own locators."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    ours = impl._locator_classes[0]
    assert ours.__name__ == "KernelSourcesLocator"
    assert numba_cache.register()  # idempotent
    assert sum(c.__name__ == "KernelSourcesLocator" for c in impl._locator_classes) == 1
    source = tmp_path / "elsewhere.py"
    source.write_text("def f(x):\n    return x\n")
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    assert ours.from_function(namespace["f"], str(source)) is None
    assert ours.from_function(segments.node_pass.py_func, segments.__file__) is not None
