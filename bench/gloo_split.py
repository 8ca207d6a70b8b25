"""gloo's all-gather of one payload, whole and as 2, 4 and 8 concurrent parts
(cgx2.comm.process_group's split): how much of a link one collective keeps busy, under torchrun.

Usage (root, two hosts joined by a shaped link):
    python -m cgx2.testing.netlab --hosts 2 --rate 1gbit -- bash -c 'torchrun --nnodes 2 \\
      --nproc-per-node 1 --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29511 \\
      bench/gloo_split.py [--sizes 1M,4M,16M] [--splits 1,2,4,8] [--iters 7] [--out DIR]'
Sizes are the bytes each rank sends. Calls rotate over the split counts, the ranks lined up by a
barrier before each; medians. Rank 0 prints a table and writes gloo_split_<device>_..._<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from common import write_results

from cgx2.bench import report
from cgx2.comm import process_group

COLUMNS = [  # key, header, format, meaning: the table and its legend
    ("size", "size", "", "bytes each rank sends (and receives from each other rank)"),
    ("splits", "parts", "", "concurrent all-gathers the payload is cut into"),
    ("ms", "ms", ".1f", None),
    ("mb_per_s", "MB/s", ".0f", "a rank's bytes sent over the median time"),
    ("speedup", "vs first", ".2f", "the first split count's median time over this one's"),
]


def gather(out: torch.Tensor, send: torch.Tensor, splits: int) -> None:
    group = dist.group.WORLD
    if splits == 1:
        group._allgather_base(out, send).wait()
    else:
        process_group.all_gather_in_parts(out, send, group, splits).wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--sizes", default="1M,4M,16M", help="bytes a rank sends (K, M, G suffixes)")
    p.add_argument("--splits", default="1,2,4,8", help="concurrent parts, comma-separated")
    p.add_argument("--iters", type=int, default=7, help="timed calls per size and split")
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("gloo_split.py"):
        return
    dist.init_process_group("gloo")
    world, splits = dist.get_world_size(), [int(k) for k in args.splits.split(",")]
    rows = []
    for nbytes in report.parse_sizes(args.sizes):
        send = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        out = torch.empty(world * nbytes, dtype=torch.uint8)
        calls: dict[int, list[float]] = {k: [] for k in splits}
        for i in range(len(splits) * (args.iters + 1)):
            k = splits[(i + i // len(splits)) % len(splits)]  # no count always follows another
            dist.barrier()
            start = time.perf_counter()
            gather(out, send, k)
            if i >= len(splits):  # the first round warms up
                calls[k].append((time.perf_counter() - start) * 1e3)
        whole = statistics.median(calls[splits[0]])
        for k in splits:
            ms = statistics.median(calls[k])
            rows.append(
                {
                    "size": report.size_name(nbytes),
                    "bytes": nbytes,
                    "splits": k,
                    "ms": ms,
                    "mb_per_s": nbytes / ms / 1e3,
                    "speedup": whole / ms,
                }
            )
    if dist.get_rank() == 0:
        print("\n".join(report.format_columns(rows, COLUMNS)))
        write_results("gloo_split", torch.device("cpu"), rows, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
