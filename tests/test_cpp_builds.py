"""e3attn._cpp_builds: inductor's object files of a split C++ build compiled in parallel, then linked."""
import os
import threading

import pytest

pytest.importorskip("torch._inductor.codecache")
from torch._inductor import codecache  # noqa: E402

from e3attn._cpp_builds import _build, _objects_and_link, objects_built_in_parallel  # noqa: E402


class FakeBuilder:
    """A builder of one file from ``sources``, as inductor's CppBuilder is used: a command line naming its sources
    and target; ``build`` writes the target after ``before_build`` and logs itself."""

    def __init__(self, folder, name, sources=(), log=None, before_build=None):
        self.target, self.sources, self.log, self.before_build = str(folder / name), list(sources), log, before_build

    def get_target_file_path(self):
        return self.target

    def get_command_line(self):
        return " ".join(["g++", *self.sources, "-o", self.target])

    def build(self):
        for source in self.sources:
            assert os.path.exists(source), f"{self.target} built before its source {source}"
        if self.before_build is not None:
            self.before_build()
        with open(self.target, "w") as f:
            f.write("built")
        self.log.append(os.path.basename(self.target))


def split_build(tmp_path, log, before_build=None):
    """Inductor's split build: the wrapper's and the kernels' objects, then the library linked from both."""
    for source in ("main.cpp", "optimized.cpp"):
        (tmp_path / source).write_text("")
    wrapper = FakeBuilder(tmp_path, "main.o", [str(tmp_path / "main.cpp")], log, before_build)
    kernels = FakeBuilder(tmp_path, "optimized.o", [str(tmp_path / "optimized.cpp")], log, before_build)
    return [wrapper, kernels, FakeBuilder(tmp_path, "main.so", [wrapper.target, kernels.target], log)]


def test_the_objects_compile_at_the_same_time_and_the_link_after_both(tmp_path):
    # each object's build waits until the other's has started: built one after the other, the barrier breaks
    both_started = threading.Barrier(2, timeout=5)
    log = []
    _build(str(tmp_path / "lock"), split_build(tmp_path, log, both_started.wait))
    assert sorted(log[:2]) == ["main.o", "optimized.o"] and log[2:] == ["main.so"]


def test_what_exists_is_not_built_again(tmp_path):
    log = []
    builders = split_build(tmp_path, log)
    with open(builders[1].target, "w") as f:
        f.write("cached")
    _build(str(tmp_path / "lock"), builders)
    assert log == ["main.o", "main.so"]
    _build(str(tmp_path / "lock"), builders)
    assert log == ["main.o", "main.so"]


def test_builders_that_are_not_a_split_build_run_in_order(tmp_path):
    log = []
    single = [FakeBuilder(tmp_path, "kernel.so", [], log)]
    _build(str(tmp_path / "lock"), single)
    # the second object is built from the first: not independent, so one after the other, though the link
    # reads both
    a = FakeBuilder(tmp_path, "a.o", [], log)
    b = FakeBuilder(tmp_path, "b.o", [a.target], log)
    chain = [a, b, FakeBuilder(tmp_path, "c.so", [a.target, b.target], log)]
    assert _objects_and_link(chain) is None and _objects_and_link(split_build(tmp_path, log)) is not None
    _build(str(tmp_path / "lock"), chain)
    assert log == ["kernel.so", "a.o", "b.o", "c.so"]


def test_a_compiler_s_error_comes_out_after_the_other_compiler_ended(tmp_path):
    class CompileError(Exception):
        pass

    log = []
    builders = split_build(tmp_path, log)

    def fail():
        raise CompileError("g++ failed")

    builders[0].before_build = fail
    with pytest.raises(CompileError, match="g\\+\\+ failed"):
        _build(str(tmp_path / "lock"), builders)
    assert log == ["optimized.o"]  # the kernels built, no link
    _build(str(tmp_path / "lock"), split_build(tmp_path, log))  # the lock was released
    assert log == ["optimized.o", "main.o", "main.so"]


def test_one_compile_thread_builds_one_after_the_other(tmp_path):
    from torch._inductor import config

    log, before = [], config.compile_threads
    with config.patch(compile_threads=1):  # not monkeypatch: its undo deletes the option, which hides it
        _build(str(tmp_path / "lock"), split_build(tmp_path, log))
    assert log == ["main.o", "optimized.o", "main.so"]
    assert config.compile_threads == before


def test_inductors_own_builders_of_a_split_build_are_recognised(tmp_path):
    """CppBuilders made as inductor's ``load_async`` makes them for a wrapper compiled apart from its kernels (a
    change of their command lines in another torch would leave the builds serial: this test would say so)."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    def options(**kwargs):
        return CppTorchDeviceOptions(device_type="cpu", **kwargs)

    wrapper = CppBuilder(name="ckey.main", sources=str(tmp_path / "ckey.main.cpp"), output_dir=str(tmp_path),
                         BuildOption=options(compile_only=True, min_optimize=True))
    kernels = CppBuilder(name="ckey2.optimized", sources=str(tmp_path / "ckey2.optimized.cpp"),
                         output_dir=str(tmp_path), BuildOption=options(compile_only=True))
    link = CppBuilder(name="ckey.main", sources=[wrapper.get_target_file_path(), kernels.get_target_file_path()],
                      output_dir=str(tmp_path), BuildOption=options())
    assert _objects_and_link([wrapper, kernels, link]) == ([wrapper, kernels], link)


def test_the_first_call_of_a_cpu_graph_compiled_by_inductor_builds_side_by_side(monkeypatch):
    import torch

    from e3attn._tracing import TracedGraphs

    seen = []

    def fake_compile(graph, backend, dynamic, options):  # records who builds while the compiled graph first runs
        def first_run(*args):
            seen.append((backend, codecache._worker_compile_cpp is _build))
            return graph(*args)

        return first_run

    monkeypatch.setattr(torch, "compile", fake_compile)
    TracedGraphs(lambda x: 2 * x, num_graphs=lambda x: 1, backend="inductor")(torch.ones(3))
    TracedGraphs(lambda x: 2 * x, num_graphs=lambda x: 1, backend="eager")(torch.ones(3))
    assert seen == [("inductor", True), ("eager", False)]
    assert codecache._worker_compile_cpp is not _build


def test_the_context_replaces_inductors_builder_and_gives_it_back():
    original = codecache._worker_compile_cpp
    with objects_built_in_parallel():
        assert codecache._worker_compile_cpp is _build
        with objects_built_in_parallel():  # nested: nothing more
            assert codecache._worker_compile_cpp is _build
        assert codecache._worker_compile_cpp is _build
    assert codecache._worker_compile_cpp is original
    with pytest.raises(RuntimeError, match="inside"):
        with objects_built_in_parallel():
            raise RuntimeError("inside")
    assert codecache._worker_compile_cpp is original


def test_an_inductor_of_another_signature_is_left_alone(monkeypatch):
    def other(lock_path, cpp_builders, extra):
        raise AssertionError("not called")

    monkeypatch.setattr(codecache, "_worker_compile_cpp", other)
    with objects_built_in_parallel():
        assert codecache._worker_compile_cpp is other
