"""GPU check of the NCCL transport (cgx2.comm.nccl, CGX2_TRANSPORT=nccl): its all-to-all,
all-gather and ring shift deliver the process group's bytes, and the quantized allreduce (the
scatter-reduce-allgather, and the ring from three ranks) through it equals the one through
torch's NCCL collectives bit for bit. On one GPU only the plumbing runs (a rank's transfers to
itself); every rank on its own GPU checks the rest.

Run: ``torchrun --nproc-per-node N bench/gpu_nccl_transport_check.py`` (N GPUs); exits 1 on
any failure. Rank 0 prints one line a check and writes gpu_nccl_transport_check_....json.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives
from cgx2.bench import report
from cgx2.collectives import policy
from cgx2.comm import nccl, process_group


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    group, dev = dist.group.WORLD, torch.device("cuda", local)
    ok: dict[str, bool] = {"the NCCL transport is available": nccl.available()}
    g = torch.Generator(device=dev).manual_seed(rank)
    send = torch.randint(0, 256, (world, 4099), dtype=torch.uint8, device=dev, generator=g)
    for name in ("all_to_all", "all_gather", "all_gather in place", "shift"):
        got, want = torch.empty_like(send), torch.empty_like(send)
        if name == "all_to_all":
            nccl.all_to_all(got, send, group)
            process_group.wait(process_group.all_to_all(want, send, group, False))
        elif name == "all_gather":
            nccl.all_gather(got.view(-1), send[0], group)
            process_group.wait(process_group.all_gather(want.view(-1), send[0], group, False))
        elif name == "all_gather in place":  # our slot of the output is the input
            got[rank].copy_(send[0])
            nccl.all_gather(got.view(-1), got[rank], group)
            process_group.wait(process_group.all_gather(want.view(-1), send[0], group, False))
        else:
            nccl.shift(got[0], send[0], group)
            process_group.wait(process_group.shift(want[0], send[0], group, False))
            got, want = got[0], want[0]
        if name == "all_to_all":  # our own row is left undefined
            got[rank], want[rank] = 0, 0
        ok[f"{name} == the process group's"] = torch.equal(got, want)
    x = torch.randn(3_000_017, device=dev, generator=g)
    algorithms = ("auto", "ring") if world > 2 else ("auto",)
    for algorithm in algorithms:
        results = {}
        for transport in ("nccl", "process_group"):
            with cgx2.config.tuned(transport=transport, crossover_bytes=0, algorithm=algorithm):
                route = policy.route(x, group, 4, 512)
                results[transport] = (
                    collectives.allreduce(x, group, collectives.CallSettings(4, 512, seed=3)),
                    route.transport,
                )
        ok[f"{algorithm}: allreduce through nccl == through the process group"] = torch.equal(
            results["nccl"][0], results["process_group"][0]
        ) and (world == 1 or results["nccl"][1] is nccl)
    torch.cuda.synchronize()
    failed = [name for name, good in ok.items() if not good]
    if rank == 0:
        for name, good in ok.items():
            print(f"{'ok  ' if good else 'FAIL'} {name}")
        env = report.environment(dev, world)
        path = report.write_json(
            "gpu_nccl_transport_check", {"env": env, "checks": ok}, "bench/results"
        )
        print(f"gpu_nccl_transport_check: {len(ok) - len(failed)} of {len(ok)} passed -> {path}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
