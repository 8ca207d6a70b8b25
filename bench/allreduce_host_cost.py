"""Host time per call of the quantized allreduce on GPUs (one a rank, NCCL), against NCCL's own
allreduce and a clone of the same tensor, timed in the same run: what a call costs the host.

Usage: torchrun --nproc-per-node N bench/allreduce_host_cost.py [--numel 65536] [--calls 500]
[--rounds 5] [--label NAME] [--profile CALLS] [--profile-setting NAME] [--device cuda|cpu]
[--out DIR]. Each setting
makes ``--calls`` calls, each from an idle device (its host time: what the call costs the
host), then as many back to back (where the device is the slower, its time shows instead), in
rounds that rotate the settings' order; the median round is kept. Compression is forced
(``CGX2_CROSSOVER_BYTES=0``). ``--profile`` then runs that many calls of a setting (the
collective unless ``--profile-setting`` names another) under
cProfile on rank 0 and keeps the functions that took the most host time, then as many under
torch.profiler and keeps the operators (the C++ side: NCCL's enqueue, launches, allocations).
Run it with ``PYTHONPATH`` at another cgx2 tree and another ``--label`` to compare two trees.
Rank 0 prints a table and writes allreduce_host_cost_<device>_..._<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import add_host_cost_options, write_results

import cgx2
from cgx2 import collectives
from cgx2.bench import report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_call_us(
    setting: tuple[Callable[[], object], Callable], calls: int, device: torch.device
) -> dict[str, float]:
    """Microseconds a call: ``idle``, the host's time in a call that starts with the device
    idle (what the call costs the host); ``back_to_back``, the host's in calls made back to
    back, which is the device's time instead wherever the device is the slower (launches then
    wait for room in the device's queue); ``wall``, back to back until the device is done."""
    fn, context = setting
    with context():
        dist.barrier()
        _sync(device)
        idle = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            idle += time.perf_counter() - start
            _sync(device)
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        back_to_back = time.perf_counter() - start
        _sync(device)
        wall = time.perf_counter() - start
    return {
        name: value / calls * 1e6
        for name, value in (("idle", idle), ("back_to_back", back_to_back), ("wall", wall))
    }


def _trace(fn: Callable[[], object], calls: int, device: torch.device, top: int = 30) -> str:
    """torch.profiler's operators by their host (self CPU) time over ``calls`` calls of
    ``fn``, each from an idle device: the C++ side that cProfile cannot split (rank 0's)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            _sync(device)
            fn()
        _sync(device)
    if dist.get_rank() != 0:
        return ""
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _profile(fn: Callable[[], object], calls: int, device: torch.device, top: int = 30) -> str:
    """The functions that took the most host time over ``calls`` calls of ``fn``, each from
    an idle device (rank 0's; every rank makes the calls)."""
    profiler = cProfile.Profile() if dist.get_rank() == 0 else None
    dist.barrier()
    for _ in range(calls):
        _sync(device)
        if profiler is not None:
            profiler.enable()
        fn()
        if profiler is not None:
            profiler.disable()
    _sync(device)
    if profiler is None:
        return ""
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    add_host_cost_options(p, calls=500, rounds=5)
    p.add_argument("--label", default="tree", help="names this cgx2 tree in the JSON")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="then profile this many calls of the collective on rank 0",
    )
    p.add_argument(
        "--profile-setting",
        default="collectives.allreduce",
        metavar="NAME",
        help="the setting --profile profiles (a row of the table)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: CPU tensors on gloo (the script's own check, on any machine)",
    )
    report.add_out_argument(p)
    args = p.parse_args()
    if report.refused_single_process("allreduce_host_cost.py"):
        return
    os.environ["CGX2_CROSSOVER_BYTES"] = "0"
    if args.device == "cuda":
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    group, bits = dist.group.WORLD, args.bits
    x = torch.randn(args.numel, device=device)
    buffer = x.clone()
    plain = contextlib.nullcontext
    # The collective in either API, so that bench/host_cost_ab.sh times it in a tree from before
    # CallSettings too (fb90910, issue 43's baseline: allreduce(t, bits, bucket, group, op)).
    if hasattr(collectives, "CallSettings"):
        call = collectives.CallSettings(bits, 512)

        def collective() -> torch.Tensor:
            return collectives.allreduce(x, group, call)

    else:

        def collective() -> torch.Tensor:
            return collectives.allreduce(x, bits, 512, group, "sum")

    settings = {
        "clone": (lambda: x.clone(), plain),
        "plain_all_reduce": (lambda: dist.all_reduce(buffer), plain),
        "quantized_allreduce": (lambda: cgx2.quantized_allreduce(x, bits), plain),
        "collectives.allreduce": (collective, plain),
    }
    if device.type == "cuda":
        # The same collective launched eagerly (CGX2_CUDA_GRAPHS=0; by default, a call of this
        # size replays a CUDA graph), and through cgx2's own NCCL transport (eagerly too).
        settings["collectives.allreduce, eager"] = (
            collective,
            lambda: cgx2.config.tuned(cuda_graphs=False),
        )
        settings["collectives.allreduce, nccl transport"] = (
            collective,
            lambda: cgx2.config.tuned(transport="nccl"),
        )
    if args.profile and args.profile_setting not in settings:
        raise SystemExit(f"--profile-setting: one of {', '.join(settings)}")
    for fn, context in settings.values():  # kernels compiled, variants bound, state made
        with context():
            for _ in range(20):
                fn()
    names = list(settings)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rounds[name].append(_per_call_us(settings[name], args.calls, device))
    us = {name: {k: statistics.median(t[k] for t in v) for k in v[0]} for name, v in rounds.items()}
    clone, plain_us = us["clone"]["idle"], us["plain_all_reduce"]["idle"]
    rows = [
        {
            "call": name,
            "host_us": us[name]["idle"],
            "x_clone": us[name]["idle"] / clone,
            "x_plain": us[name]["idle"] / plain_us,
            "back_to_back_us": us[name]["back_to_back"],
            "wall_us": us[name]["wall"],
        }
        for name in names
    ]
    profile = ""
    if args.profile:
        fn, context = settings[args.profile_setting]
        with context():
            profile = f"profiled: {args.profile_setting}\n"
            profile += _profile(fn, args.profile, device) + "\n" + _trace(fn, args.profile, device)
    if dist.get_rank() == 0:
        columns = [  # key, header, format, meaning
            ("call", "call", "", None),
            (
                "host_us",
                "host µs",
                ".1f",
                f"host time a call made with the device idle, mean of {args.calls} "
                f"calls, median of {args.rounds} rounds; {args.numel} fp32 values, "
                f"{bits} bits, {dist.get_world_size()} ranks, tree {args.label!r}",
            ),
            ("x_clone", "× clone", ".2f", None),
            ("x_plain", "× plain", ".2f", None),
            (
                "back_to_back_us",
                "back to back µs",
                ".1f",
                "host time a call, the calls back to back: the device's time "
                "a call instead where it is the slower",
            ),
            (
                "wall_us",
                "wall µs",
                ".1f",
                "the calls back to back until the device is done, a call",
            ),
        ]
        calls_said = [
            (
                "quantized_allreduce",
                "the public function, as users call it (the agreement check included)",
            ),
            (
                "collectives.allreduce",
                "the collective it calls, unchecked (DDP's hook's path); "
                "on GPUs, a CUDA graph's replay at this size by default",
            ),
            ("plain_all_reduce", f"{dist.get_backend()}'s own allreduce of the same tensor"),
        ]
        # format_table and format_legend: format_columns came after fb90910
        print(report.format_table(rows, [column[:3] for column in columns]))
        legend = [(head, meaning) for _, head, _, meaning in columns if meaning is not None]
        print(report.format_legend(legend + calls_said))
        if profile:
            print(profile)
        env = {
            "numel": args.numel,
            "bits": bits,
            "calls": args.calls,
            "rounds": args.rounds,
            "tree": args.label,
            "cgx2_file": cgx2.__file__,
        }
        write_results("allreduce_host_cost", device, rows, args.out, env, profile=profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
