"""What the ranks' agreement check (cgx2.collectives.agreement) costs a quantized allreduce:
the public op (checked) and the collective it calls (unchecked), call by call, under torchrun.

Usage: torchrun --nproc-per-node 2 bench/agreement_cost.py [--sizes 64K,1M,16M] [--iters 20]
[--device cpu|cuda] [--out DIR]; in bench/hosts.sh's namespaces for a real link. Rank 0 prints a
table and writes agreement_cost_<device>_<regime>_w<W>_<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives
from cgx2.bench import report


def timed(x: torch.Tensor, iters: int) -> tuple[list[float], list[float]]:
    """Milliseconds of each call, checked (the public op) and unchecked (the collective it
    calls), in ABBA order, the ranks lined up by a barrier before each."""
    group, calls = dist.group.WORLD, ([], [])
    run = (lambda: cgx2.quantized_allreduce(x, 4),
           lambda: collectives.allreduce(x, 4, 512, group, "sum"))  # fmt: skip
    for i in range(2 * iters):
        which = (i + i // 2) % 2  # checked, unchecked, unchecked, checked, ...: neither always
        dist.barrier()  # follows the other (the allocator's pages, the caches)
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run[which]()
        if x.is_cuda:
            torch.cuda.synchronize()
        calls[which].append((time.perf_counter() - start) * 1e3)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--sizes", default="64K,1M,16M", help="input bytes (K, M, G: KiB, MiB, GiB)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and setting")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("agreement_cost.py"):
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = []
    # Forced compression; the check as configured (CGX2_CHECK_AGREEMENT: on off NCCL).
    with cgx2.config.tuned(crossover_bytes=0):
        for nbytes in report.parse_sizes(args.sizes):
            x = torch.randn(nbytes // 4, device=device)
            timed(x, 2)  # warm-up
            on, off = timed(x, args.iters)
            row = {"size": report.size_name(nbytes), "bytes": nbytes}
            row["checked_ms"], row["unchecked_ms"] = statistics.median(on), statistics.median(off)
            row["cost_ms"] = row["checked_ms"] - row["unchecked_ms"]
            row["cost_pct"] = 100 * row["cost_ms"] / row["unchecked_ms"]
            rows.append(row)
    if dist.get_rank() == 0:
        columns = [("size", "size", ""), ("unchecked_ms", "unchecked ms", ".3f"),
                   ("checked_ms", "checked ms", ".3f"), ("cost_ms", "cost ms", ".3f"),
                   ("cost_pct", "cost %", ".1f")]  # fmt: skip
        print(report.format_table(rows, columns))
        print(report.format_legend([
            ("unchecked ms", "median of cgx2.collectives.allreduce, which does not check"),
            ("checked ms", "median of cgx2.quantized_allreduce (the check, then the same call),"
             " alternating with the unchecked calls"),
            ("cost %", "(checked - unchecked) / unchecked"),
        ]))  # fmt: skip
        env = report.environment(device, dist.get_world_size())
        path = report.write_json("agreement_cost", {"env": env, "rows": rows}, args.out)
        print(f"-> {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
