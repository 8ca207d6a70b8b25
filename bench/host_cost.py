"""Host time per call of the codec's public ops against a ``clone`` of the same tensor, eager and
compiled: what a small tensor's call costs before any kernel runs.

Usage: python bench/host_cost.py [--numel 65536] [--calls 2000] [--device cuda|cpu]
[--profile] [--out DIR]. Each setting is timed as ``--calls`` calls back to back (the GPU,
faster than the host at this size, never holds them up), in rounds that rotate the settings'
order; the median round is kept. Prints a table and writes host_cost_<device>_..._<date>.json;
``--profile`` also prints cProfile's top functions of the eager quantize and dequantize.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from common import add_host_cost_options

import cgx2
from cgx2.bench import report


def _per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    add_host_cost_options(p, calls=2000, rounds=7)
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    report.add_out_argument(p)
    args = p.parse_args()
    device = torch.device(args.device)
    n, bits = args.numel, args.bits
    x = torch.randn(n, device=device)
    payload = torch.ops.cgx.quantize(x, bits, 512, 1)
    ops = torch.ops.cgx

    def round_trip(t: torch.Tensor, seed: int = 1) -> torch.Tensor:
        return ops.dequantize(ops.quantize(t, bits, 512, seed), n, bits, 512)

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    compiled = torch.compile(round_trip, fullgraph=True)
    settings = {
        "clone": lambda: x.clone(),
        "clone_compiled": torch.compile(clone, fullgraph=True),
        "op_quantize": lambda: ops.quantize(x, bits, 512, 1),
        "op_dequantize": lambda: ops.dequantize(payload, n, bits, 512),
        "quantize": lambda: cgx2.quantize(x, bits, 512, 1),
        "dequantize": lambda: cgx2.dequantize(payload, n, bits, 512),
        "round_trip_eager": lambda: round_trip(x),
        "round_trip_compiled": lambda: compiled(x),
    }
    settings["clone_compiled"] = functools.partial(settings["clone_compiled"], x)
    if device.type == "cuda":  # CUDA graphs: torch.compile's answer to per-call host time
        graphed = torch.compile(round_trip, fullgraph=True, mode="reduce-overhead")
        settings["round_trip_compiled_cudagraphs"] = lambda: graphed(x)
        # Unseeded: captured too, its key drawn on the device at every replay.
        settings["round_trip_compiled_cudagraphs_unseeded"] = lambda: graphed(x, -1)
        settings["round_trip_eager_unseeded"] = lambda: round_trip(x, -1)
    for fn in settings.values():  # compiled, warmed, variants launched once
        for _ in range(20):
            fn()
    names = list(settings)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rounds[name].append(_per_call_us(settings[name], args.calls, device))
    us = {name: statistics.median(v) for name, v in rounds.items()}
    rows = [
        {"call": name, "host_us": us[name], "x_clone": us[name] / us["clone"]} for name in names
    ]
    print(
        report.format_table(
            rows,
            [("call", "call", ""), ("host_us", "host µs", ".1f"), ("x_clone", "× clone", ".2f")],
        )
    )
    print(
        report.format_legend(
            [
                (
                    "host µs",
                    f"host time per call, {args.calls} calls back to back, median of "
                    f"{args.rounds} rounds; {n} fp32 values, {bits} bits",
                ),
                ("op_*", "torch.ops.cgx.*; quantize/dequantize: cgx2.quantize/dequantize (eager)"),
                (
                    "round_trip_*",
                    "quantize then dequantize, eager and torch.compile(fullgraph=True)"
                    "; _cudagraphs: mode='reduce-overhead'",
                ),
                (
                    "clone_compiled",
                    "torch.compile(fullgraph=True) of a clone: its fixed cost a call",
                ),
            ]
        )
    )
    if args.profile:
        for name in ("op_quantize", "op_dequantize"):
            profiler = cProfile.Profile()
            profiler.runcall(lambda fn=settings[name]: [fn() for _ in range(args.calls)])
            print(f"\n== {name}: cProfile, {args.calls} calls")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    env = report.environment(device, 1)
    env.update(numel=n, bits=bits, calls=args.calls, rounds=args.rounds)
    path = report.write_json("host_cost", {"env": env, "rows": rows}, args.out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
