"""Where an FSDP2 block's quantized reduce-scatter spends its time, under torchrun: the plain
reduce-scatter against cgx2's, with one segment and with a block's parameter segments, and the
host time to enqueue each (a call that returns before the GPU finishes is host-light).

Run (socket regime): ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc-per-node 2
bench/fsdp_reduce_scatter.py``
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from cgx2.fsdp import reduce_scatter_quantized


def _time(fn, iters: int = 10) -> tuple[float, float]:
    """(median ms per call, median ms of host time to enqueue it)."""
    total, host = [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 3:
            total.append((t2 - t0) * 1e3)
            host.append((t1 - t0) * 1e3)
    return statistics.median(total), statistics.median(host)


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    dim = 768  # one block of examples/train_fsdp.py: 2 norms, attention in/out, MLP up/down
    shapes = [(dim,), (dim,), (dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,),
              (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]  # fmt: skip
    sizes = [torch.Size(s).numel() // world for s in shapes]  # per row, FSDP's padded shards
    n = sum(sizes)
    segments, at = [], 0
    for shape, k in zip(shapes, sizes, strict=True):
        segments.append((at, k, len(shape) > 1 and torch.Size(shape).numel() >= 1024))
        at += k
    x = torch.randn(world * n, device="cuda")
    out = torch.empty(n, device="cuda")
    group = dist.group.WORLD
    rows = {
        "plain reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x),
        "cgx2, one segment": lambda: reduce_scatter_quantized(out, x, group, 4, 512, 0.5),
        "cgx2, block segments": lambda: reduce_scatter_quantized(
            out, x, group, 4, 512, 0.5, segments
        ),
    }
    for name, fn in rows.items():
        ms, host = _time(fn)
        if dist.get_rank() == 0:
            print(f"{name:24s} {ms:8.3f} ms  (host {host:.3f} ms)  {world * n * 4 / 2**20:.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
