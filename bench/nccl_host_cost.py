"""Host time of one NCCL collective call as the allreduce's pipeline makes it: asynchronous
(on NCCL's stream, a Work to wait on) against ``asyncOp=False`` (on the caller's stream),
on one GPU in a group of one. A tuning aid: ``python bench/nccl_host_cost.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from cgx2.collectives import _options


def host_us(call, n: int = 2000, rounds: int = 5) -> float:
    """Median over rounds of the mean host time of ``n`` calls, the GPU never waited on."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        times.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    x = torch.zeros(256, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    a2a = torch.empty(1, 256, dtype=torch.uint8, device="cuda")
    a2a_out = torch.empty_like(a2a)
    gather = {a: _options(dist.distributed_c10d.AllgatherOptions, a) for a in (True, False)}
    to_all = {a: _options(dist.AllToAllOptions, a) for a in (True, False)}
    has_field = hasattr(gather[True], "asyncOp")
    rows = {
        "all_gather async + wait": lambda: group._allgather_base(out, x, gather[True]).wait(),
        "all_gather asyncOp=False": lambda: group._allgather_base(out, x, gather[False]),
        "all_to_all async + wait": lambda: group.alltoall_base(
            a2a_out, a2a, [], [], to_all[True]
        ).wait(),
        "all_to_all asyncOp=False": lambda: group.alltoall_base(
            a2a_out, a2a, [], [], to_all[False]
        ),
        "event record + stream wait": None,
        "empty(32 MiB) u8": lambda: torch.empty(32 << 20, dtype=torch.uint8, device="cuda"),
    }
    side = torch.cuda.Stream()
    event = torch.cuda.Event()

    def record_wait() -> None:
        event.record()
        side.wait_event(event)

    rows["event record + stream wait"] = record_wait
    for _ in range(3):
        for call in rows.values():
            host_us(call, n=50, rounds=1)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))}, asyncOp field: {has_field}"
    )
    for name, call in rows.items():
        print(f"{name:28s} {host_us(call):7.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
