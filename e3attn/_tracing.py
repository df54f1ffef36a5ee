"""A whole step traced into one graph: the value-free branches, as while ``torch.compile`` traces.

``make_fx`` (``torch.fx.experimental.proxy_tensor``) records every operation of a function, derivatives of any
order included (it runs autograd's engine on its proxies), into one graph that ``torch.compile`` can then compile
whole: a force-training step, loss and weight gradients, as one graph, where ``torch.compile`` of the model itself
stops at the second derivative. Code that reads tensor values (checks, a test whether the edges are sorted, the
number of graphs in a batch) cannot be traced; inside :func:`traced_step` e3attn takes the branches it takes while
``torch.compile`` traces instead (:func:`tracing`), and reads the number of graphs from the context
(:func:`traced_graphs`). :class:`TracedGraphs` keeps the graphs of one function, each with the guards on the
inputs' sizes that its trace assumed, and reuses a graph for every input that meets them;
:func:`weights_as_inputs` makes a module's weights inputs of such a graph rather than constants in it.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from ._cpp_builds import objects_built_in_parallel

_GRAPHS = contextvars.ContextVar("e3attn_traced_graphs", default=None)

#: Inductor's options for the graphs of CPU tensors. A C++ wrapper (``cpp_wrapper``) calls the generated kernels
#: and the operators left to ATen from one compiled function, where the default Python wrapper pays Python's cost
#: for each of some hundred calls (``python benchmarks/compiled_step.py --threads 2 --python-wrapper``: the
#: training command's step, its model of degree 1, 1.17 times as fast as with the Python wrapper). The wrapper
#: and the kernels are compiled as two translation units (``cpp_wrapper_build_separate``), the wrapper's glue at
#: ``-O1`` and the kernels at ``-O3``, where one unit at ``-O3`` spends most of its time optimising the glue
#: (``--one-unit``: the same step time, the first call with an empty cache 19 s longer); the glue at ``-O0``
#: builds in 9 s instead of 23 s but makes the step 6% slower (``--wrapper-o0``). The two units compile side by
#: side (:func:`~e3attn._cpp_builds.objects_built_in_parallel`). Options that the installed inductor lacks are
#: left out.
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def index_adds_as_calls(graph: torch.fx.GraphModule) -> int:
    """Make every out-of-place ``aten.index_add`` of ``graph`` (without ``alpha``; ``index_add_`` stays) a call of
    the operator ``e3attn::index_add`` (:mod:`e3attn.kernels.index_add`), which compilers keep as a call; the
    number of nodes changed.

    The operations of a traced force-training step include some sixty ``index_add`` (the sums over edges and
    their derivatives). Inductor lowers each one to an accumulating ``index_put``, and under deterministic
    algorithms, which :class:`TracedGraphs` compiles CPU graphs with, leaves that to ATen's deterministic
    ``index_put``, which sorts the indices first: 148 µs a call on average on aspirin's batches of 8 molecules
    (168 atoms, 2,480 edges; 15% of a 63 ms step under the profiler), where ATen's ``index_add``, which
    ``e3attn::index_add`` calls, takes about 50 µs. The values are those of ``aten.index_add``.

    Example::

        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> graph = make_fx(lambda x, i, y: x.index_add(0, i, y))(torch.zeros(2), torch.tensor([1, 1]), torch.ones(2))
        >>> index_adds_as_calls(graph), graph(torch.zeros(2), torch.tensor([1, 1]), torch.ones(2))
        (1, tensor([0., 2.]))
    """
    from .kernels import index_add  # noqa: F401 (defines the operator)

    changed = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.index_add.default and not node.kwargs:
            node.target = torch.ops.e3attn.index_add.default
            changed += 1
    if changed:
        graph.recompile()
    return changed


def cpu_inductor_options() -> dict:
    """:data:`CPU_INDUCTOR_OPTIONS` that the installed inductor has."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: value for key, value in CPU_INDUCTOR_OPTIONS.items() if key in known}


@contextlib.contextmanager
def traced_step(num_graphs: int) -> Iterator[None]:
    """Within this context e3attn can be traced (:func:`tracing` is true) on batches of ``num_graphs`` graphs."""
    if isinstance(num_graphs, bool) or not isinstance(num_graphs, int) or num_graphs < 1:
        raise ValueError(f"num_graphs must be a positive int, got {num_graphs!r}")
    token = _GRAPHS.set(num_graphs)
    try:
        yield
    finally:
        _GRAPHS.reset(token)


def tracing() -> bool:
    """Whether e3attn takes its value-free branches: while ``torch.compile`` traces, or inside
    :func:`traced_step`."""
    return torch.compiler.is_compiling() or _GRAPHS.get() is not None  # compiling first: dynamo cannot trace .get()


_SORTED = contextvars.ContextVar("e3attn_edges_sorted_by_caller", default=False)


@contextlib.contextmanager
def edges_sorted_by_caller() -> Iterator[None]:
    """Within this context the edges of every call are sorted by destination, as the caller promises (the ASE
    calculator, whose edges :func:`~e3attn.radius_graph_pbc` sorts; the compiled training step, for a batch it
    tested): the layers neither test the order nor sort the edges (:func:`sorted_by_destination`), also while
    ``make_fx`` traces them (:class:`TracedGraphs` keeps the graphs traced with the promise apart)."""
    token = _SORTED.set(True)
    try:
        yield
    finally:
        _SORTED.reset(token)


def sorted_by_destination(dst: torch.Tensor) -> bool:
    """Whether the edges of destinations ``dst`` are known to be sorted by destination without a sort: inside
    :func:`edges_sorted_by_caller`, else by a test of the values on the CPU. False on other devices, where the
    test's read costs more than a sort (a synchronisation), and while tracing, where no value can be read (a
    traced graph then sorts every call's edges), as while ``torch.compile`` traces (it cannot read the promise)."""
    if torch.compiler.is_compiling():
        return False
    if _SORTED.get():
        return True
    return not tracing() and dst.device.type == "cpu" and bool((dst[1:] >= dst[:-1]).all())


def traced_graphs() -> Optional[int]:
    """The number of graphs of the batch that :func:`traced_step` traces, or None outside it."""
    return None if torch.compiler.is_compiling() else _GRAPHS.get()


class TracedGraphs:
    r"""``fn`` traced into graphs with symbolic sizes (``make_fx``), each reused for every input its guards admit.

    A trace with symbolic sizes holds for inputs of other sizes, except where the traced code branched on a size:
    there the shape environment recorded a guard (e.g. that the number of edges is not zero, or equals a weight's
    size). A call evaluates the guards of the graphs traced so far on the sizes of its inputs and runs the first
    graph whose guards hold, or traces a new one: so batches whose numbers of atoms and edges vary share one
    graph, as do the calls of a molecular dynamics run between and across neighbour searches. Sizes are not
    unified by coincidence while tracing (no duck sizing): a guard ties two sizes only where the code needs them
    equal. A graph is also kept per structure of the arguments, per dtype, device and rank of every tensor, and per
    ``num_graphs(*args)``, the number of graphs that the trace reads from :func:`traced_step`.

    With a ``backend``, each new graph is compiled by ``torch.compile(graph, backend=backend, dynamic=True)`` at its
    first call; inductor compiles the graphs of CPU tensors with :func:`cpu_inductor_options` (a C++ wrapper,
    compiled apart from the kernels, the two at the same time: :mod:`e3attn._cpp_builds`), their ``index_add`` made
    calls of ATen's first (:func:`index_adds_as_calls`; the training command's compiled step and the calculator's
    compiled call). On CPU tensors the compiled graphs run with deterministic algorithms on (warnings only, new
    memory not filled): then inductor leaves the accumulating ``index_put`` of what is left of ``index_add`` to
    ATen, since its vectorised C++ code for it fails an assertion on some graphs when it runs on more than one
    thread (torch 2.13); and every call must have the state of the first, which dynamo guards. A graph that does
    not compile at its first call runs as traced, with a warning that names the error (a later recompile by dynamo,
    on a guard of its own, is not caught). The graphs run in
    ``torch.inference_mode()``, compiled in it too: they compute their derivatives themselves, and their operators
    skip autograd's dispatch; what they return is cloned into normal tensors. Not thread-safe: the deterministic
    setting and the tracer's configuration are process-wide, so one object's calls, and those of several, belong in
    one thread.

    Args:
        fn: the function of tensors (nested in lists, tuples and dicts) to trace; what it returns, the graphs return.
        num_graphs: the number of graphs (structures) in the arguments.
        backend: ``None`` to run the traced graphs as they are, or a ``torch.compile`` backend (its name:
            ``"inductor"``; ``"eager"`` for dynamo without a compiler).

    Example::

        >>> double = TracedGraphs(lambda x: 2 * x.sum(0), num_graphs=lambda x: 1)
        >>> double(torch.ones(3, 2)), double(torch.ones(5, 2)), len(double.graphs)
        (tensor([6., 6.]), tensor([10., 10.]), 1)
    """

    def __init__(self, fn: Callable, num_graphs: Callable[..., int], backend: Union[str, Callable, None] = None
                 ) -> None:
        if backend is not None:
            from torch._dynamo import lookup_backend
            from torch._dynamo.exc import InvalidBackend

            try:
                lookup_backend(backend)
            except InvalidBackend:
                raise ValueError(f"backend must be a torch.compile backend (torch._dynamo.list_backends()), got "
                                 f"{backend!r}") from None
        self.fn, self.num_graphs, self.backend = fn, num_graphs, backend
        self.graphs: List[Tuple[Any, Callable, Callable]] = []  # (key, guards of the flat inputs, graph)

    def __call__(self, *args: Any) -> Any:
        flat, spec = pytree.tree_flatten(args)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"TracedGraphs: every argument must be a tensor (in lists, tuples or dicts); "
                                f"leaf {i} (from 0) is a {type(t).__name__}")
        key = (spec, int(self.num_graphs(*args)), tuple((t.dtype, t.device, t.dim()) for t in flat), _SORTED.get())
        for graph_key, admits, graph in self.graphs:
            if graph_key == key and admits(flat):
                return _in_inference_mode(graph)(*args)
        admits, graph = self._trace(args, key[1])
        out, graph = self._first_call(graph, args, cpu=all(t.device.type == "cpu" for t in flat))
        self.graphs.append((key, admits, graph))
        return out

    def _trace(self, args: Tuple, num_graphs: int) -> Tuple[Callable, Callable]:
        from torch.fx.experimental import _config as fx_config
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        with traced_step(num_graphs), fx_config.patch(use_duck_shape=False):
            graph = make_fx(lambda *a: self.fn(*a), tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
        placeholders = [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"]
        expression = graph.shape_env.produce_guards_expression(placeholders, ignore_static=False)
        code = compile(expression or "True", "<guards>", "eval")

        def admits(flat: List[torch.Tensor]) -> bool:
            return bool(eval(code, SYMPY_INTERP, {"L": {f"t{i}": t for i, t in enumerate(flat)}}))

        return admits, graph

    def _first_call(self, graph: Callable, args: Tuple, cpu: bool) -> Tuple[Any, Callable]:
        """The first call of a new ``graph``, compiled if there is a backend, and the graph to keep."""
        if self.backend is None:
            return _in_inference_mode(graph)(*args), graph
        options = None
        if cpu and self.backend == "inductor":
            options = cpu_inductor_options()
            index_adds_as_calls(graph)  # the traced graph computes the same with them, compiled or not
        compiled = torch.compile(graph, backend=self.backend, dynamic=True, options=options)
        if cpu:  # compiled and called with the same global state: dynamo guards it, and would compile again
            compiled = _with_deterministic_algorithms(compiled)
        try:
            with objects_built_in_parallel() if options is not None else contextlib.nullcontext():
                return _in_inference_mode(compiled)(*args), compiled
        except Exception as error:  # a compiler's failure: the traced graph computes the same
            while getattr(error, "inner_exception", None) or error.__cause__:  # what the backend raised
                error = getattr(error, "inner_exception", None) or error.__cause__
            first = (str(error).strip().splitlines() or [""])[0]
            warnings.warn(f"torch.compile (backend {self.backend!r}) failed on a traced graph, which runs "
                          f"uncompiled: {type(error).__name__}: {first}")
            return _in_inference_mode(graph)(*args), graph


def _in_inference_mode(fn: Callable) -> Callable:
    """``fn`` run in ``torch.inference_mode()`` (a traced graph computes its derivatives itself: its operators,
    e3attn's node kernels among them, need not pass through autograd's dispatch), what it returns cloned outside it
    into normal tensors (which the caller can update in place, as an optimiser does gradients)."""

    def call(*args: Any) -> Any:
        with torch.inference_mode():
            out = fn(*args)
        return pytree.tree_map_only(torch.Tensor, torch.clone, out)

    return call


def _with_deterministic_algorithms(fn: Callable) -> Callable:
    """``fn`` called with ``torch.use_deterministic_algorithms(True, warn_only=True)`` (without filling new
    memory), the global state as it was after each call."""

    def call(*args: Any) -> Any:
        state = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                 torch.utils.deterministic.fill_uninitialized_memory)
        try:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False
            return fn(*args)
        finally:
            torch.use_deterministic_algorithms(state[0], warn_only=state[1])
            torch.utils.deterministic.fill_uninitialized_memory = state[2]

    return call


class _Bound(torch.nn.Module):
    """``fn(module, *args)`` as a module holding ``module`` (for ``torch.func.functional_call``)."""

    def __init__(self, module: torch.nn.Module, fn: Callable) -> None:
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, *args: Any) -> Any:
        return self.fn(self.module, *args)


def weights_as_inputs(module: torch.nn.Module, fn: Callable, trainable_only: bool = False
                      ) -> Tuple[List[torch.nn.Parameter], Callable]:
    """The weights of ``module`` and ``fn(module, *args)`` as a function ``g(weights, *args)`` of them
    (``torch.func.functional_call``): traced, ``g``'s graph takes the weights as inputs, so that it stays right
    when they change (training, or a model trained further) and can differentiate in them.

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> weights, g = weights_as_inputs(lin, lambda m, x: m(x).sum())
        >>> bool(g([torch.zeros_like(w) for w in weights], torch.ones(3, 2)) == 0)
        True
    """
    bound = _Bound(module, fn)
    named = [(name, w) for name, w in bound.named_parameters() if w.requires_grad or not trainable_only]
    names = [name for name, _ in named]

    def g(weights: List[torch.Tensor], *args: Any) -> Any:
        return torch.func.functional_call(bound, dict(zip(names, weights)), args)

    return [w for _, w in named], g
