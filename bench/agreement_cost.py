"""What the ranks' agreement check (cgx2.collectives.agreement) costs a quantized allreduce:
the public op checked at once, checked deferred (CUDA tensors), and the collective it calls
(unchecked), call by call in rotating order, under torchrun.

Usage: torchrun --nproc-per-node 2 bench/agreement_cost.py [--sizes 64K,1M,16M] [--iters 20]
[--device cpu|cuda] [--backend gloo|nccl] [--out DIR]; in bench/hosts.sh's namespaces for a real
link; ranks may share one GPU on gloo. Rank 0 prints a table and writes
agreement_cost_<device>_<regime>_w<W>_<date>.json.
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

COLUMNS = [
    ("size", "size", ""),
    ("off_ms", "unchecked ms", ".3f"),
    ("on_ms", "checked ms", ".3f"),
    ("on_pct", "cost %", ".1f"),
]
"""The table's columns: key, header, format."""
DEFERRED_COLUMNS = [
    ("deferred_ms", "deferred ms", ".3f"),
    ("deferred_pct", "deferred cost %", ".1f"),
]
"""With CUDA tensors: the deferred check's time and cost."""
LEGEND = [
    ("unchecked ms", "median of cgx2.collectives.allreduce, which does not check"),
    (
        "checked ms",
        "median of cgx2.quantized_allreduce, CGX2_CHECK_AGREEMENT=on: the"
        " check read at once, then the same call",
    ),
    (
        "deferred ms",
        "the same, CGX2_CHECK_AGREEMENT=deferred: compared on the GPU, the result masked",
    ),
    ("cost %", "checked / unchecked - 1"),
]


def timed(x: torch.Tensor, iters: int, modes: list[str]) -> dict[str, list[float]]:
    """Milliseconds of each call in each mode (``off``: the collective the op calls, which does
    not check), in rotating order, the ranks lined up by a barrier before each."""
    group, calls = dist.group.WORLD, {mode: [] for mode in modes}
    unchecked = collectives.CallSettings(4, 512)

    def run(mode: str) -> None:
        if mode == "off":
            collectives.allreduce(x, group, unchecked)
            return
        with cgx2.config.tuned(check_agreement=mode):
            cgx2.quantized_allreduce(x, 4)

    for i in range(len(modes) * iters):
        mode = modes[(i + i // len(modes)) % len(modes)]  # no mode always follows another
        calls[mode].append(timed_ms(functools.partial(run, mode), x.is_cuda))
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--sizes", default="64K,1M,16M", help="input bytes (K, M, G: KiB, MiB, GiB)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and setting")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl for cuda (one GPU a rank), gloo for cpu",
    )
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("agreement_cost.py"):
        return
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    dist.init_process_group(backend)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    modes = ["off", "on", "deferred"] if device.type == "cuda" else ["off", "on"]
    rows = []
    with cgx2.config.tuned(crossover_bytes=0):  # forced compression
        for nbytes in report.parse_sizes(args.sizes):
            x = torch.randn(nbytes // 4, device=device)
            timed(x, 2, modes)  # warm-up
            calls = timed(x, args.iters, modes)
            row = {"size": report.size_name(nbytes), "bytes": nbytes}
            for mode in modes:
                row[f"{mode}_ms"] = statistics.median(calls[mode])
            for mode in modes[1:]:
                row[f"{mode}_pct"] = 100 * (row[f"{mode}_ms"] / row["off_ms"] - 1)
            rows.append(row)
    if dist.get_rank() == 0:
        deferred = "deferred" in modes
        print(report.format_table(rows, COLUMNS + (DEFERRED_COLUMNS if deferred else [])))
        legend = [item for item in LEGEND if deferred or item[0] != "deferred ms"]
        print(report.format_legend(legend))
        write_results("agreement_cost", device, rows, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
