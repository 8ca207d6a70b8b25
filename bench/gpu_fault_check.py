"""A peer that dies while the others replay the quantized allreduce as a CUDA graph (NCCL's
kernels out of the process group's watchdog's sight): the survivor raises within its group's
timeout instead of waiting forever (cgx2.collectives.replay_watch).

Usage: torchrun --nproc-per-node 2 bench/gpu_fault_check.py [--timeout 30]. Rank 1 leaves
once the allreduce replays; rank 0 prints ``ok`` or ``FAIL`` and exits 0 or 1.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

import cgx2
from cgx2.collectives import graphs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--timeout", type=float, default=30, help="the group's timeout, seconds")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl",
        device_id=torch.device("cuda", local),
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    rank = dist.get_rank()
    # Whatever happens, never hang the device call: dump the stacks and leave.
    faulthandler.dump_traceback_later(4 * args.timeout + 60, exit=True)
    x = torch.randn(1 << 20, device="cuda")
    with cgx2.config.tuned(cuda_graphs=True, crossover_bytes=0):
        for _ in range(4):  # eager, capture, replays
            cgx2.quantized_allreduce_(x, 4)
        torch.cuda.synchronize()
        replays = graphs.stats()["replays"]
        dist.barrier()
        if rank == 1:
            sys.stdout.flush()
            os._exit(0)  # gone, as a killed host is: no goodbye to NCCL
        time.sleep(2)
        start, error = time.monotonic(), None
        try:
            for _ in range(3):  # the first replay hangs on the dead peer; the watch aborts it
                cgx2.quantized_allreduce_(x, 4)
                torch.cuda.synchronize()
        except RuntimeError as e:
            error = e
        took = time.monotonic() - start
    ok = replays >= 2 and error is not None and took < 2 * args.timeout + 30
    print(
        f"{'ok  ' if ok else 'FAIL'} a dead peer mid-replay: the survivor raised after "
        f"{took:.0f} s (timeout {args.timeout:.0f} s, {replays} replays before): "
        f"{str(error)[:200]}",
        flush=True,
    )
    os._exit(0 if ok else 1)  # the group is broken: tearing it down could wait on the peer


if __name__ == "__main__":
    main()
