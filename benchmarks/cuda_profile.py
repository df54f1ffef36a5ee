"""CUDA launches and top kernels per MD call (calculator, fcc copper) and per layer force step, via torch.profiler.

Example (on a GPU)::

    python benchmarks/cuda_profile.py --atoms 108 864
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "examples", ROOT / "benchmarks"):
    sys.path.insert(0, str(path))

import md_speed  # noqa: E402
import molecules  # noqa: E402
from e3attn import kernels  # noqa: E402
from e3attn.calculator import E3AttnCalculator  # noqa: E402


def profile_md(num_atoms: int, calls: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = molecules.build_model(molecules.parse_args([]))
    atoms = md_speed.fcc_copper(num_atoms)
    atoms.calc = E3AttnCalculator(model, list(molecules.SPECIES), device="cuda", dtype=torch.float32)
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
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item",
                                                     "aten::_local_scalar_dense"))
    enabled = kernels.fused_enabled(torch.device("cuda"), torch.float32)
    print(f"md {num_atoms} atoms, cuda kernels {enabled}: "
          f"{launches / calls:.0f} GPU kernels per call, GPU busy {gpu_us / calls / 1e3:.2f} ms per call, "
          f"{syncs / calls:.1f} item/sync per call")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--atoms", type=int, nargs="+", default=[108, 864])
    args = p.parse_args()
    for enabled in (False, True):
        kernels.set_cuda_kernels(enabled)
        for n in args.atoms:
            profile_md(n)


if __name__ == "__main__":
    main()
