"""The transports side by side: the allreduce of one host's ranks, plain and 4-bit, through the
process group (gloo) and through shared memory (cgx2.comm.shm), settings interleaved call by call.

Usage: torchrun --nproc-per-node 2 bench/transports.py [--sizes 1M,4M,16M,64M] [--iters 20]
[--bits 4] [--device cpu|cuda] [--out DIR]. CUDA tensors ride a gloo group (ranks may share one
GPU). Rank 0 prints a table and writes transports_<device>_<regime>_w<W>_<date>.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.distributed as dist
from common import timed_ms, write_results

import cgx2
from cgx2 import collectives
from cgx2.bench import report

SETTINGS = [  # (column, transport, compressed, algorithm)
    ("gloo_plain", "process_group", False, "sra"),
    ("shm_plain", "shm", False, "sra"),
    ("gloo_q", "process_group", True, "sra"),
    ("shm_q", "shm", True, "sra"),
]
RING_SETTINGS = [("gloo_ring", "process_group", True, "ring"), ("shm_ring", "shm", True, "ring")]
"""With three ranks or more: the quantized ring (CGX2_ALGORITHM=ring) through each transport."""


def _call(x: torch.Tensor, transport: str, compressed: bool, algorithm: str, bits: int) -> None:
    with cgx2.config.tuned(transport=transport, crossover_bytes=0, algorithm=algorithm):
        call = collectives.CallSettings(bits if compressed else 32, 512)
        collectives.allreduce_(x, dist.group.WORLD, call)


def timed(x: torch.Tensor, iters: int, bits: int, settings: list) -> dict[str, list[float]]:
    """Milliseconds of each call per setting, the settings in a rotating order (none always
    follows another), the ranks lined up by a barrier before each call."""
    calls: dict[str, list[float]] = {name: [] for name, *_ in settings}
    for i in range(iters):
        order = settings[i % len(settings) :] + settings[: i % len(settings)]
        for name, transport, compressed, algorithm in order:
            call = functools.partial(_call, x, transport, compressed, algorithm, bits)
            calls[name].append(timed_ms(call, x.is_cuda))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="input bytes (K, M, G)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and setting")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("transports.py"):
        return
    dist.init_process_group("gloo")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rows = []
    ring = dist.get_world_size() > 2
    settings = SETTINGS + (RING_SETTINGS if ring else [])
    for nbytes in report.parse_sizes(args.sizes):
        x = torch.randn(nbytes // 4, device=device)
        timed(x, 2, args.bits, settings)  # warm-up: segments grown, pools started
        calls = timed(x, args.iters, args.bits, settings)
        row = {"size": report.size_name(nbytes), "bytes": nbytes}
        for name, *_ in settings:
            row[f"{name}_ms"] = statistics.median(calls[name])
        row["plain_x"] = row["gloo_plain_ms"] / row["shm_plain_ms"]
        row["q_x"] = row["gloo_q_ms"] / row["shm_q_ms"]
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"{row['size']}: done", flush=True)
    if dist.get_rank() == 0:
        columns = [
            ("size", "size", ""),
            ("gloo_plain_ms", "gloo ms", ".2f"),
            ("shm_plain_ms", "shm ms", ".2f"),
            ("plain_x", "shm x", ".2f"),
            ("gloo_q_ms", f"{args.bits}-bit gloo ms", ".2f"),
            ("shm_q_ms", f"{args.bits}-bit shm ms", ".2f"),
            ("q_x", f"{args.bits}-bit shm x", ".2f"),
        ]
        if ring:
            columns += [
                ("gloo_ring_ms", "ring gloo ms", ".2f"),
                ("shm_ring_ms", "ring shm ms", ".2f"),
            ]
        print(report.format_table(rows, columns))
        print(
            report.format_legend(
                [
                    (
                        "gloo ms / shm ms",
                        "median of the plain allreduce through gloo / shared memory",
                    ),
                    (
                        f"{args.bits}-bit ...",
                        "the quantized allreduce, its bytes through gloo / shared memory",
                    ),
                    ("x", "gloo's time / shared memory's (above 1: shared memory is faster)"),
                    *(
                        [("ring ...", f"the {args.bits}-bit ring allreduce (CGX2_ALGORITHM=ring)")]
                        if ring
                        else []
                    ),
                ]
            )
        )
        write_results("transports", device, rows, args.out, {"bits": args.bits})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
