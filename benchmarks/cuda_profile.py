"""CUDA launches and top kernels per MD call (calculator, fcc copper) and per layer force step, via torch.profiler.

Example (on a GPU)::

    python benchmarks/cuda_profile.py --atoms 108 864
    python benchmarks/cuda_profile.py --atoms --layer large:10000 guide:100000   # the layer's force step only

``--layer CONFIG:NODES`` profiles one force-training step of :mod:`layer`'s configuration (the Triton kernels and
the plain formulation in turn) and lists the operations by GPU time, then by the host's time: where a step of the
layer spends it.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples", ROOT / "benchmarks"):
    sys.path.insert(0, str(path))

import layer as layer_benchmark  # noqa: E402
import md_speed  # noqa: E402
import molecules  # noqa: E402
from e3attn import kernels  # noqa: E402
from e3attn.calculator import E3AttnCalculator  # noqa: E402


def _kernels(events) -> list:
    """The events that are work on the GPU: not the ranges of ``torch.profiler.record_function`` (e3attn's
    operators name their kernels' calls so), which the profiler also lists on the GPU and which span kernels
    already counted."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


def profile_md(num_atoms: int, calls: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = molecules.build_model(molecules.parse_args([]))
    atoms = md_speed.fcc_copper(num_atoms)
    atoms.calc = E3AttnCalculator(model, list(molecules.SPECIES), device="cuda", dtype=torch.float32,
                                  cuda_graphs=False)  # eager: the operations of a call
    traj = md_speed.Trajectory(atoms.positions.copy())
    for t in range(5):
        atoms.positions = traj.frame(t)
        atoms.get_forces()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for t in range(calls):
            atoms.positions = traj.frame(10 + t)
            atoms.get_forces()
        torch.cuda.synchronize()
    events = prof.key_averages()
    on_device = _kernels(events)
    launches = sum(e.count for e in on_device)
    gpu_us = sum(e.self_device_time_total for e in on_device)
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                     "aten::_local_scalar_dense"))
    enabled = kernels.fused_enabled(torch.device("cuda"), torch.float32)
    print(f"md {num_atoms} atoms, cuda kernels {enabled}: "
          f"{launches / calls:.0f} GPU kernels per call, GPU busy {gpu_us / calls / 1e3:.2f} ms per call, "
          f"{syncs / calls:.1f} item/sync per call")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def profile_layer(case: str, device: torch.device, steps: int = 3) -> None:
    """Operations of :mod:`layer`'s force step on ``case`` (``CONFIG:NODES``), by GPU time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    config, nodes = case.split(":")
    models, f, pos, edge_index = layer_benchmark.build(config, int(nodes), 14.0, device, seed=0)
    step = layer_benchmark._calls(models["e3attn"], f, pos, edge_index)["force"]
    step()
    layer_benchmark.sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        layer_benchmark.sync(device)
    events = prof.key_averages()
    on_device = _kernels(events)
    busy = sum(e.self_device_time_total for e in on_device)
    enabled = kernels.fused_enabled(device, torch.float32)
    print(f"layer {case}, {edge_index.shape[1]} edges, cuda kernels {enabled}: "
          f"{sum(e.count for e in on_device) / steps:.0f} GPU kernels per force step, "
          f"GPU busy {busy / steps / 1e3:.2f} ms per step")
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=25, max_name_column_width=70))
    if device.type == "cuda":  # where the host's time goes (a step of a small graph is bound by it)
        host = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        print(f"layer {case}, cuda kernels {enabled}: host {host:.2f} ms per step (profiled), by self CPU time:")
        print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--atoms", type=int, nargs="*", default=[108, 864], help="MD calls on fcc copper of these sizes")
    p.add_argument("--layer", nargs="*", default=[], metavar="CONFIG:NODES",
                   help=f"force steps of benchmarks/layer.py's configurations ({', '.join(layer_benchmark.CONFIGS)})")
    p.add_argument("--device", type=torch.device, default=torch.device("cuda"), help="device of --layer (default cuda)")
    args = p.parse_args()
    for case in args.layer:
        config, _, nodes = case.partition(":")
        if config not in layer_benchmark.CONFIGS or not nodes.isdigit():
            p.error(f"--layer: expected CONFIG:NODES with CONFIG in {list(layer_benchmark.CONFIGS)}, got {case!r}")
    for enabled in (False, True):
        kernels.set_cuda_kernels(enabled)
        for n in args.atoms:
            profile_md(n)
        for case in args.layer:
            profile_layer(case, args.device)


if __name__ == "__main__":
    main()
