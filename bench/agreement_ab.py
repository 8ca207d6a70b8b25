"""The agreement check alone (cgx2.collectives.agreement.check) on CPU tensors: over the group's
peer sockets (the default up to STORE_MAX_RANKS), through its c10d store by its queues (without
sockets, up to QUEUE_MAX_RANKS) and by keys, against the all-gather (larger groups), in
alternating rounds of one run.

Usage: torchrun --nproc-per-node 2 bench/agreement_ab.py [--rounds 40] [--calls 10] [--out DIR];
across cgx2.testing.netlab's hosts for a real link. Rank 0 prints a table and writes
agreement_ab_<device>_<regime>_w<W>_<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from cgx2.bench import report
from cgx2.collectives import agreement
from cgx2.comm import peers

MODES = {  # (STORE_MAX_RANKS, QUEUE_MAX_RANKS, peer sockets) in each
    "sockets": (agreement.STORE_MAX_RANKS, agreement.QUEUE_MAX_RANKS, True),
    "queues": (agreement.STORE_MAX_RANKS, agreement.QUEUE_MAX_RANKS, False),
    "keys": (agreement.STORE_MAX_RANKS, 0, False),
    "all-gather": (0, 0, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--calls", type=int, default=10, help="calls a round (its median counts)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1 << 14)
    connected = peers.connected
    rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        if rank == 0 and r % 10 == 0:
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
        for mode, (store_ranks, queue_ranks, sockets) in MODES.items():
            agreement.STORE_MAX_RANKS, agreement.QUEUE_MAX_RANKS = store_ranks, queue_ranks
            peers.connected = connected if sockets else lambda group: None
            calls = []
            dist.barrier()
            for _ in range(args.calls + 2):  # the first two warm the mode up
                start = time.perf_counter()
                agreement.check(dist.group.WORLD, "quantized_allreduce", x, {"bits": 4})
                calls.append(time.perf_counter() - start)
            rounds[mode].append(statistics.median(calls[2:]))
    if rank == 0:
        rows = [
            {
                "exchange": mode,
                "ms": 1e3 * statistics.median(ts),
                "p10_ms": 1e3 * statistics.quantiles(ts, n=10)[0],
            }
            for mode, ts in rounds.items()
        ]
        base = next(row["ms"] for row in rows if row["exchange"] == "all-gather")
        for row in rows:
            row["vs_all_gather"] = row["ms"] / base
        print(
            report.format_table(
                rows,
                [
                    ("exchange", "exchange", ""),
                    ("ms", "ms", ".3f"),
                    ("p10_ms", "p10 ms", ".3f"),
                    ("vs_all_gather", "vs all-gather", ".2f"),
                ],
            )
        )
        env = report.environment(torch.device("cpu"), world)
        path = report.write_json(
            "agreement_ab", {"env": env, "args": vars(args), "rows": rows}, args.out
        )
        print(f"rounds of {args.calls} calls, median of {args.rounds} rounds -> {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
