"""The GPU timeline of one quantized allreduce, under torchrun: each kernel and collective
(start, duration, gap before it) and the host's enqueue calls, from torch.profiler, to see
where the time between the speed of light and the measured time goes. A tuning aid:
``torchrun --nproc-per-node 2 bench/allreduce_timeline.py [--mib 256] [--bits 4]``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import cgx2


def _start(e) -> float:
    return e.time_range.start


def _row(e, t0: float) -> None:
    print(f"  {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:70]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    x = torch.randn((args.mib << 20) // dtype.itemsize, device="cuda").to(dtype)
    os.environ["CGX2_CROSSOVER_BYTES"] = "0"
    for _ in range(5):
        cgx2.quantized_allreduce(x, args.bits, op="avg")
    torch.cuda.synchronize()
    dist.barrier()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        cgx2.quantized_allreduce(x, args.bits, op="avg")
        end.record()
        end.synchronize()
    if dist.get_rank() == 0:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.time_range.start)
        host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
        t0 = min(e.time_range.start for e in host)
        print(f"{args.mib} MiB {args.dtype} {args.bits}-bit: {start.elapsed_time(end):.3f} ms "
              f"between events; GPU work (start us, duration us, name):")  # fmt: skip
        for e in events:
            _row(e, t0)
        names = ("cudaLaunch", "cuLaunch", "c10d::", "aten::zero", "aten::empty", "nccl:")
        print("host calls (start us, duration us, name):")
        for e in sorted((e for e in host if e.name.startswith(names)), key=_start):
            _row(e, t0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
