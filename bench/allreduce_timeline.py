"""The GPU timeline of one quantized allreduce, under torchrun: each kernel and collective
(start and duration, from the host's start of the call) and a summary of where the time between
the speed of light and the measured time goes. A tuning aid:
``torchrun --nproc-per-node 2 bench/allreduce_timeline.py [--mib 256] [--bits 4] [--dtype bf16]``.

Each call starts as the benchmark's do (synced GPUs, a barrier); the first profiled calls are
warm-up steps, so that the profiler's own first-call stall falls outside the one reported.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import cgx2
from cgx2 import config
from cgx2.bench.report import add_choice, add_number

MARK = "cgx2_timed_call"


def _is_nccl(e) -> bool:
    return e.name.startswith(("ncclDevKernel", "ncclKernel"))


def _summary(events: list, t0: float, t1: float) -> dict[str, float]:
    """Microseconds from the call's host start ``t0``; ``t1`` its host end."""
    nccl = [e for e in events if _is_nccl(e)]
    kernels = [e for e in events if not _is_nccl(e) and not e.name.startswith("nccl:")]
    end = max(e.time_range.end for e in events)
    busy = sum(e.time_range.elapsed_us() for e in nccl)
    span = nccl[-1].time_range.end - nccl[0].time_range.start if nccl else 0.0
    return {
        "host call": t1 - t0,
        "to first GPU work": min(e.time_range.start for e in events) - t0,
        "to first collective": nccl[0].time_range.start - t0 if nccl else 0.0,
        "collectives, busy": busy,
        "collectives, idle between": span - busy,
        "after the last collective": end - nccl[-1].time_range.end if nccl else 0.0,
        "coding kernels, busy": sum(e.time_range.elapsed_us() for e in kernels),
        "GPU end": end - t0,
    }


def _gpu_events(prof: torch.profiler.profile, start: float) -> list:
    """The profile's GPU events that start at ``start`` or later, in the order they start."""
    return sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= start
        ),
        key=lambda e: e.time_range.start,
    )


def _on_rank_0(value: object) -> list | None:
    """Every rank's ``value`` in rank order, on rank 0 (None on the others)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone if dist.get_rank() == 0 else None


def _back_to_back(prof: torch.profiler.profile, args: argparse.Namespace) -> None:
    """Per call of the profiled step: its host time and the GPU's idle time before its last
    GPU work ends (summed over the ranks' own timelines); idle GPU time while calls are queued
    means the host fell behind."""
    # The host's ranges only: the profiler also records each range's GPU annotation.
    cpu = torch.autograd.DeviceType.CPU
    marks = sorted(
        (e for e in prof.events() if e.name == MARK and e.device_type == cpu),
        key=lambda e: e.time_range.start,
    )
    gpu = _gpu_events(prof, marks[0].time_range.start)
    rows, end = [], gpu[0].time_range.start
    for i, mark in enumerate(marks):
        # A call's GPU work: what starts after its host start and before the next call's.
        until = marks[i + 1].time_range.start if i + 1 < len(marks) else float("inf")
        mine = [e for e in gpu if mark.time_range.start <= e.time_range.start < until]
        idle = 0.0
        for e in mine:
            idle += max(0.0, e.time_range.start - end)
            end = max(end, e.time_range.end)
        rows.append(
            {
                "host us": mark.time_range.elapsed_us(),
                "GPU idle us": idle,
                "GPU end us": end - marks[0].time_range.start,
            }
        )
    everyone = _on_rank_0(rows)
    if everyone is not None:
        print(
            f"{args.mib} MiB {args.dtype} {args.bits}-bit, {args.calls} calls back to back "
            f"(host time of each call; GPU idle before its work; GPU end from the first "
            f"call's host start), us"
        )
        print("call" + "".join(f"  rank {r}: host    idle     end" for r in range(len(everyone))))
        for i in range(len(rows)):
            cells = (
                f"{c['host us']:7.1f} {c['GPU idle us']:7.1f} {c['GPU end us']:7.1f}"
                for c in (r[i] for r in everyone)
            )
            print(f"{i:4d}" + "".join(f"        {c}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser()
    add_number(p, "--mib", 256)
    add_number(p, "--bits", 4)
    add_choice(p, "--dtype", ("fp32", "bf16"))
    p.add_argument(
        "--cuda-graphs", action="store_true", help="replay CUDA graphs (CGX2_CUDA_GRAPHS)"
    )
    p.add_argument("--host", action="store_true", help="also list the call's host-side events")
    add_number(
        p,
        "--calls",
        1,
        "calls back to back in the profiled step (as `cgx2.bench --calls`): with more than "
        "one, each call's host time and where the GPU sat idle between them are reported",
    )
    args = p.parse_args()
    if args.cuda_graphs:
        os.environ["CGX2_CUDA_GRAPHS"] = "1"
        config.reload()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    x = torch.randn((args.mib << 20) // dtype.itemsize, device="cuda").to(dtype)
    os.environ["CGX2_CROSSOVER_BYTES"] = "0"
    for _ in range(5):
        cgx2.quantized_allreduce(x, args.bits, op="avg")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(wait=0, warmup=3, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for _ in range(4):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            for _ in range(args.calls):
                with torch.profiler.record_function(MARK):
                    cgx2.quantized_allreduce(x, args.bits, op="avg")
            torch.cuda.synchronize()
            prof.step()
    if args.calls > 1:
        _back_to_back(prof, args)
        dist.destroy_process_group()
        return
    mark = next(e for e in prof.events() if e.name == MARK)
    t0, t1 = mark.time_range.start, mark.time_range.end
    gpu = _gpu_events(prof, t0)
    summary = _summary(gpu, t0, t1)
    summaries = _on_rank_0(summary)
    if summaries is not None:
        print(
            f"{args.mib} MiB {args.dtype} {args.bits}-bit, one profiled call (us from the "
            f"host's start of the call):"
        )
        for e in gpu:
            print(
                f"  {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:70]}"
            )
        if args.host:
            host = sorted(
                (
                    e
                    for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CPU
                    and t0 <= e.time_range.start
                    and e.time_range.end <= t1
                    and e.name != MARK
                ),
                key=lambda e: e.time_range.start,
            )
            print("host events (us from the call's start, duration):")
            for e in host[:60]:
                print(
                    f"  {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  "
                    f"{e.name[:70]}"
                )
        print("summary, us" + "".join(f"   rank {r}" for r in range(len(summaries))))
        for key in summary:
            print(f"  {key:28s}" + "".join(f" {s[key]:8.1f}" for s in summaries))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
