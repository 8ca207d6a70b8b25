"""The Python host time of one eager ``cgx2.quantized_allreduce_`` call, its kernels and
collectives stubbed out, on any machine (no GPU or process group needed): what the op's own
code costs per call, the part of the NVLink regime's host-bound time that is ours to cut.
A tuning aid: ``python bench/host_python.py [--calls 20000] [--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["CGX2_CROSSOVER_BYTES"] = "0"  # always the quantized path

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives


class _Group(dist.ProcessGroup):
    """A group of two that is never called: the collectives are stubbed."""


def stub_out(group: dist.ProcessGroup) -> None:
    """Replace the codec's kernels and the collectives by no-ops, and route ``group`` as
    NCCL's (its fallback is never taken)."""
    codec = types.SimpleNamespace(
        encode_chunks=lambda x, layout, key, skip_chunk=None, out=None: out,
        decode_sum_encode=lambda *args, out=None, **kwargs: out,
        decode_chunks=lambda rows, layout, dtype, out=None: out,
    )
    collectives.maxmin_codec = lambda device: codec
    collectives._all_to_all = lambda out, send, group, async_op=True: None
    collectives._all_gather = lambda out, send, group, async_op=True: None
    collectives._ROUTES[id(group)] = (None, True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--numel", type=int, default=1 << 16)
    p.add_argument("--profile", action="store_true", help="also print the top functions")
    args = p.parse_args()
    group = _Group(0, 2)
    stub_out(group)
    x = torch.randn(args.numel)

    def call() -> None:
        cgx2.quantized_allreduce_(x, 4, group=group, op="avg")

    for _ in range(100):
        call()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    us = (time.perf_counter() - t0) / args.calls * 1e6
    print(
        f"quantized_allreduce_, one piece, stubbed: {us:.1f} us a call, torch {torch.__version__}",
        flush=True,
    )
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [call() for _ in range(args.calls // 4)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
