"""Host time of each step of one quantized allreduce (kernel launches, collective calls,
waits, allocations), under torchrun on GPUs: the functions the pipeline calls are wrapped
with timers, no syncs inside. A tuning aid:
``torchrun --nproc-per-node 2 bench/host_stages.py [--mib 256] [--pipeline-mb 256]``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives, graphs
from cgx2.codecs import direct_launch, maxmin_triton

SPENT: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
            CALLS[name] += 1

    return wrapper


def _enqueue_ms(x: torch.Tensor, iters: int, after_warmup=lambda: None) -> float:
    """Host milliseconds to enqueue one allreduce of ``x``, the GPU idle at each start (after
    three calls of warm-up, then ``after_warmup()``)."""
    total = 0.0
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        if i == 3:
            after_warmup()
        t0 = time.perf_counter()
        cgx2.quantized_allreduce(x, 4, op="avg")
        if i >= 3:
            total += time.perf_counter() - t0
    return total / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--pipeline-mb", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-direct-launch", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="also print rank 0's cProfile")
    p.add_argument("--cuda-graphs", action="store_true", help="replay CUDA graphs (cgx2.graphs)")
    args = p.parse_args()
    graphs.ENABLED = args.cuda_graphs
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    direct_launch.ENABLED = not args.no_direct_launch
    if args.pipeline_mb:
        collectives.PIPELINE_BYTES = args.pipeline_mb << 20
    x = torch.randn(args.mib << 18, device="cuda")
    bare = _enqueue_ms(x, args.iters)  # before the timers below add theirs
    for name in ("encode_chunks", "decode_chunks", "decode_sum_encode"):
        setattr(maxmin_triton, name, timed(name, getattr(maxmin_triton, name)))
    for name in ("_launch_encode", "_launch_decode", "_launch_decode_sum_encode"):
        setattr(maxmin_triton, name, timed(name, getattr(maxmin_triton, name)))
    for name in ("_all_to_all", "_all_gather"):
        setattr(collectives, name, timed(name, getattr(collectives, name)))
    for name in ("run", "_write", "_capture"):
        setattr(graphs, name, timed(f"graphs.{name}", getattr(graphs, name)))
    torch.cuda.CUDAGraph.replay = timed("CUDAGraph.replay", torch.cuda.CUDAGraph.replay)
    collectives._run_pieces = timed("_run_pieces", collectives._run_pieces)
    for name in ("scatter", "reduce", "finish"):
        setattr(collectives._Piece, name, timed(f"piece.{name}", getattr(collectives._Piece, name)))
    timed_ms = _enqueue_ms(x, args.iters, lambda: (SPENT.clear(), CALLS.clear()))
    spent, calls = SPENT.copy(), CALLS.copy()  # the profile below runs the timers again
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            cgx2.quantized_allreduce(x, 4, op="avg")
        prof.disable()
        torch.cuda.synchronize()
        if dist.get_rank() == 0:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if dist.get_rank() == 0:
        n = args.iters
        print(f"direct launch {direct_launch.ENABLED}, {args.mib} MiB fp32, 4 bits: host enqueue "
              f"{bare:.3f} ms per call ({timed_ms:.3f} ms with the timers below)")  # fmt: skip
        for name, s in spent.most_common():
            print(f"  {name:32s} {s / n * 1e3:7.3f} ms per call, {calls[name] // n} calls")
        # The encode alone, back to back (the GPU busy) and after a sync (the GPU idle).
        layout = maxmin_triton.ChunkedLayout.split(x.numel(), 2, 4, 512, False)
        out = torch.empty(2, layout.payload_nbytes, dtype=torch.uint8, device="cuda")
        for synced in (False, True):
            torch.cuda.synchronize()
            spent = 0.0
            for _ in range(n):
                if synced:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                maxmin_triton.encode_chunks(x, layout, 7, out=out)
                spent += time.perf_counter() - t0
            print(
                f"  encode_chunks alone, {'idle' if synced else 'busy'} GPU: "
                f"{spent / n * 1e3:.3f} ms host per call"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
