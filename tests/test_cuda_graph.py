"""``e3attn._cuda_graph.ReplayedCall``'s bookkeeping on the CPU, with a stand-in for CUDA's graph API that records
the call's input and output and replays it by computing the result again: which calls are replayed, recorded or
eager (and on which kernels), with and without ``adaptive``. On a GPU, ``tests/test_neighbour_list.py`` checks the
real recordings' results."""
import contextlib

import pytest
import torch

from e3attn import kernels
from e3attn._cuda_graph import ReplayedCall


class FakeGraph:
    """Knows, between capture_begin and capture_end, the recorded call's input and output (set by the call); replay
    computes that call's result from the recorded input into the recorded output, as a CUDA graph's replay does."""

    capturing = None

    def capture_begin(self):
        FakeGraph.capturing = self

    def capture_end(self):
        FakeGraph.capturing = None

    def replay(self):
        self.output.copy_(2 * self.inputs[0])  # what the recorded call computes


@pytest.fixture
def fake_cuda(monkeypatch):
    class Stream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(kernels, "_has_triton", lambda: True)  # where the kernels would run, Triton or not


def counting(log):
    """A call that logs how it ran ('capture' while recorded, 'kernels' where the Triton kernels would run)."""

    def fn(x):
        graph = FakeGraph.capturing
        if graph is not None:
            graph.inputs = [x]
        log.append("capture" if graph is not None else
                   "kernels" if kernels.fused_enabled(torch.device("cuda"), x.dtype) else "plain")
        out = 2 * x
        if graph is not None:
            graph.output = out
        return out

    return fn


def run(replayed, keys, eager_log=None):
    log = []
    fn = counting(log)
    eager = (lambda: eager_log.append("eager") or torch.zeros(2)) if eager_log is not None else None
    results = []
    for step, key in enumerate(keys):
        x = torch.full((2,), float(step))
        results.append(replayed(fn, [x], key=key, eager=eager).clone())
    return log, results


def test_md_records_at_each_search_and_replays_the_values_of_each_call(fake_cuda):
    a, b = torch.zeros(1), torch.zeros(1)  # keys compared by identity: the neighbour list's tensors
    replayed = ReplayedCall(adaptive=True)
    log, results = run(replayed, [(a,)] * 4 + [(b,)] * 3)
    assert (replayed.captures, replayed.replays) == (2, 5)
    # each search: an eager call on the kernels then its recording; the replays call nothing eagerly
    assert log == ["kernels", "capture", "kernels", "capture"]
    assert [float(r[0]) for r in results] == [2.0 * step for step in range(7)]  # replays see the new inputs


def test_a_key_that_changes_every_call_is_recorded_once_then_runs_eager(fake_cuda):
    replayed, eager_log = ReplayedCall(adaptive=True), []
    keys = [(torch.zeros(1),) for _ in range(4)]
    same = (torch.zeros(1),)
    log, _ = run(replayed, keys + [same] * 4, eager_log)
    # the first key recorded (never replayed), the next three eager by the caller's means, outside the kernels'
    # context; then the repeating key: eager once, recorded at its second call, replayed twice
    assert eager_log == ["eager"] * 4
    assert log == ["kernels", "capture", "kernels", "capture"]
    assert (replayed.captures, replayed.replays) == (2, 2)


def test_without_adaptive_every_new_key_is_recorded(fake_cuda):
    replayed = ReplayedCall()
    log, _ = run(replayed, [(torch.zeros(1),) for _ in range(3)])
    assert (replayed.captures, replayed.replays) == (3, 0)
    assert log == ["kernels", "capture"] * 3


def test_a_failed_recording_warns_once_and_leaves_the_calls_eager(fake_cuda, monkeypatch):
    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(FakeGraph, "capture_begin", broken)
    replayed, eager_log = ReplayedCall(adaptive=True), []
    key = (torch.zeros(1),)
    with pytest.warns(RuntimeWarning, match="could not be recorded as a CUDA graph"):
        log, results = run(replayed, [key] * 3, eager_log)
    assert replayed.failed.startswith("RuntimeError: operation not permitted")
    assert (replayed.captures, replayed.replays) == (0, 0)
    assert log == ["kernels"] and eager_log == ["eager", "eager"]


def test_the_kernels_run_only_in_recordings_by_default(fake_cuda):
    previous = kernels.set_cuda_kernels(None)
    try:
        log, _ = run(ReplayedCall(), [(torch.zeros(1),)])
        assert not kernels.fused_enabled(torch.device("cuda"), torch.float32)  # outside: eager calls plain
    finally:
        kernels.set_cuda_kernels(previous)
    assert log == ["kernels", "capture"]


def test_switched_off_kernels_stay_off_in_recordings(fake_cuda):
    previous = kernels.set_cuda_kernels(False)
    try:
        log, _ = run(ReplayedCall(), [(torch.zeros(1),)])
    finally:
        kernels.set_cuda_kernels(previous)
    assert log == ["plain", "capture"]
