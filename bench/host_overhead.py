"""Where the host time of one quantized allreduce goes, under torchrun on GPUs: the time to
enqueue the call (no sync) against its GPU time, per pipeline piece size, and the top CPU
ops from torch.profiler. A tuning aid: ``torchrun --nproc-per-node 2 bench/host_overhead.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank()
    for numel in (16 << 20, 64 << 20):
        x = torch.randn(numel, device="cuda")
        for piece_mb in (16, 64, 256):
            collectives.PIPELINE_BYTES = piece_mb << 20
            pieces = -(-numel * 4 // collectives.PIPELINE_BYTES)
            host, total = [], []
            for i in range(12):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cgx2.quantized_allreduce(x, 4, op="avg")
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if i >= 2:
                    host.append((t1 - t0) * 1e3)
                    total.append((t2 - t0) * 1e3)
            if rank == 0:
                h, t = statistics.median(host), statistics.median(total)
                print(f"{numel * 4 >> 20:5d} MiB fp32, {piece_mb:3d} MiB pieces ({pieces:2d}): "
                      f"host enqueue {h:6.3f} ms ({h / pieces:.3f} ms/piece), "
                      f"call to sync {t:6.3f} ms", flush=True)  # fmt: skip
    collectives.PIPELINE_BYTES = 64 << 20
    x = torch.randn(64 << 20, device="cuda")
    for _ in range(3):
        cgx2.quantized_allreduce(x, 4, op="avg")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            cgx2.quantized_allreduce(x, 4, op="avg")
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
