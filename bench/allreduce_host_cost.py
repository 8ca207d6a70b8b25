"""Host time per call of the quantized allreduce on GPUs (one a rank, NCCL), against NCCL's own
allreduce and a clone of the same tensor, timed in the same run: what a call costs the host.

Usage: torchrun --nproc-per-node N bench/allreduce_host_cost.py [--numel 65536] [--calls 500]
[--rounds 5] [--label NAME] [--out DIR]. Each setting is ``--calls`` calls back to back (the
GPUs, faster than the host at this size, never hold them up), in rounds that rotate the
settings' order; the median round is kept. Compression is forced (``CGX2_CROSSOVER_BYTES=0``).
Run it with ``PYTHONPATH`` at another cgx2 tree and another ``--label`` to compare two trees.
Rank 0 prints a table and writes allreduce_host_cost_<device>_..._<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives
from cgx2.bench import report


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--numel", type=int, default=65536)
    p.add_argument("--calls", type=int, default=500, help="calls a round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--label", default="tree", help="names this cgx2 tree in the JSON")
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("allreduce_host_cost.py"):
        return
    os.environ["CGX2_CROSSOVER_BYTES"] = "0"
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    group, bits = dist.group.WORLD, args.bits
    x = torch.randn(args.numel, device=device)
    buffer = x.clone()
    settings = {
        "clone": lambda: x.clone(),
        "nccl_all_reduce": lambda: dist.all_reduce(buffer),
        "quantized_allreduce": lambda: cgx2.quantized_allreduce(x, bits),
        "collectives.allreduce": lambda: collectives.allreduce(x, bits, 512, group, "sum"),
    }
    for fn in settings.values():  # kernels compiled, variants bound, groups' state made
        for _ in range(20):
            fn()
    names = list(settings)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rounds[name].append(_per_call_us(settings[name], args.calls))
    us = {name: statistics.median(v) for name, v in rounds.items()}
    rows = [{"call": name, "host_us": us[name], "x_clone": us[name] / us["clone"],
             "x_nccl": us[name] / us["nccl_all_reduce"]} for name in names]  # fmt: skip
    if dist.get_rank() == 0:
        print(report.format_table(rows, [("call", "call", ""), ("host_us", "host µs", ".1f"),
                                         ("x_clone", "× clone", ".2f"),
                                         ("x_nccl", "× NCCL", ".2f")]))  # fmt: skip
        print(report.format_legend([
            ("host µs", f"host time per call, {args.calls} calls back to back, median of "
                        f"{args.rounds} rounds; {args.numel} fp32 values, {bits} bits, "
                        f"{dist.get_world_size()} ranks, tree {args.label!r}"),
            ("quantized_allreduce", "the public function, as users call it (the agreement "
                                    "check included)"),
            ("collectives.allreduce", "the collective it calls, unchecked (DDP's hook's path)"),
        ]))  # fmt: skip
        env = report.environment(device, dist.get_world_size())
        env.update(numel=args.numel, bits=bits, calls=args.calls, rounds=args.rounds,
                   tree=args.label, cgx2_file=cgx2.__file__)  # fmt: skip
        path = report.write_json("allreduce_host_cost", {"env": env, "rows": rows}, args.out)
        print(f"-> {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
