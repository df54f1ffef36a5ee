r"""One call recorded as a CUDA graph and replayed while its inputs keep their shapes (the calculator's MD steps).

Between two searches of a Verlet list (:mod:`e3attn._verlet`) an MD step calls the model on the same edges with new
positions: the same kernels on tensors of the same shapes. :class:`ReplayedCall` records such a call once (a CUDA
graph) and then replays it, one launch for what took hundreds, with the new values copied into the recorded
inputs. A change of its key (the edges, say) runs the call eagerly and records it again, both within
:func:`e3attn.kernels.recording_graph`: on the layer's Triton kernels unless they are switched off. Used by
:class:`~e3attn.calculator.E3AttnCalculator` with ``cuda_graphs``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from . import kernels

__all__ = ["ReplayedCall"]


class ReplayedCall:
    """``fn(*inputs)`` on CUDA, replayed from a CUDA graph while ``key`` stays the same.

    ``key`` is a tuple whose tensors are compared by identity (the same tensor objects, kept alive here) and whose
    other items by equality; ``inputs`` are the tensors whose values change between calls (copied into the
    recorded ones). At a new key the call runs eagerly (that result is returned) and is then also recorded, on a
    side stream, into a memory pool of its own (the last recording and its pool are freed first); both run within
    :func:`e3attn.kernels.recording_graph`. With ``adaptive``, once a recording has been freed without a replay
    (a key that changes at every call, such as a cell under a barostat), a key is recorded only at its second
    call in a row, until a recording is replayed again, so that such calls cost no recording. A call that is
    neither replayed nor recorded runs ``eager()`` where given (the same result by other means, e.g. on fewer
    edges), else ``fn(*inputs)``, outside that context. A recording that fails (an operation that cannot be captured,
    such as one that reads a value on the host) is reported once as a warning and the calls stay eager from then
    on; :attr:`failed` says why.

    The tensor returned by a replay is the recorded output, overwritten by the next replay: copy what you keep.
    """

    def __init__(self, adaptive: bool = False) -> None:
        self.adaptive = adaptive
        self.captures = 0  #: recordings so far
        self.replays = 0  #: calls answered by a replay
        self.failed: Optional[str] = None  #: why recording failed, if it did
        self._key: Tuple[Any, ...] = ()  # of the recording, or of the last eager calls (``_seen`` in a row)
        self._seen = 0
        self._unused = False  # whether the last recording was freed without a replay
        self._replays_before = 0  # self.replays when the recording was made
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: List[torch.Tensor] = []
        self._output: Optional[torch.Tensor] = None
        self._stream: Optional[torch.cuda.Stream] = None

    def __call__(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], key: Tuple[Any, ...],
                 eager: Optional[Callable[[], torch.Tensor]] = None) -> torch.Tensor:
        if self._graph is not None and self._same(key, inputs):
            for recorded, value in zip(self._inputs, inputs):
                recorded.copy_(value)
            self._graph.replay()
            self.replays += 1
            return self._output
        if self._graph is not None:
            self._unused = self.replays == self._replays_before
        self._seen = self._seen + 1 if self._graph is None and self._same_key(key) else 1
        self._graph = self._output = None  # the old recording and its memory pool are freed
        self._inputs, self._key = [], tuple(key)
        if self.failed is not None or (self.adaptive and self._unused and self._seen < 2):
            return eager() if eager is not None else fn(*inputs)
        if self._stream is None or self._stream.device != inputs[0].device:
            self._stream = torch.cuda.Stream(inputs[0].device)
        stream, current = self._stream, torch.cuda.current_stream(inputs[0].device)
        stream.wait_stream(current)
        # eagerly on the stream that records (its lazy set-up, the Triton kernels' tuning, happens here), then recorded
        with torch.cuda.stream(stream), kernels.recording_graph():
            result = fn(*inputs)
            self._record(fn, inputs)
        current.wait_stream(stream)
        result.record_stream(current)  # made on the side stream, used on the caller's
        return result

    def _same_key(self, key: Tuple[Any, ...]) -> bool:
        return len(key) == len(self._key) and not any(
            (a is not b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a != b
            for a, b in zip(key, self._key))

    def _same(self, key: Tuple[Any, ...], inputs: Sequence[torch.Tensor]) -> bool:
        return self._same_key(key) and all(r.shape == t.shape and r.dtype == t.dtype and r.device == t.device
                                           for r, t in zip(self._inputs, inputs))

    def _record(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
        recorded = [t.detach().clone() for t in inputs]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(recorded[0].device)  # as torch.cuda.graph does: nothing pending while recording
        try:
            graph.capture_begin()  # its own memory pool, freed with it (a pool shared with a freed graph cannot be)
            try:
                output = fn(*recorded)
            finally:
                graph.capture_end()
        except Exception as error:  # noqa: BLE001 - any failure to record leaves the calls eager
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
            warnings.warn(f"e3attn: the call could not be recorded as a CUDA graph; it runs eagerly ({self.failed})",
                          RuntimeWarning, stacklevel=3)
            return
        self._graph, self._inputs, self._output = graph, recorded, output  # self._key: set by the caller
        self.captures += 1
        self._replays_before = self.replays
