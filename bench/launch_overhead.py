"""Host cost of launching the codec kernels: per call of encode_chunks on a tiny tensor, with
the launch options cgx2 passes and without them; of each codec call with and without the direct
launch (:mod:`cgx2.codecs.direct_launch`, in turns; written to bench/results/); and of torch.zeros
against torch.empty.
A tuning aid: ``python bench/launch_overhead.py``."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from cgx2.bench.report import environment, write_json
from cgx2.codecs import ChunkedLayout, direct_launch
from cgx2.codecs import maxmin_triton as tri


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    x = torch.randn(4096, device="cuda")
    own = x[:2048]
    y = torch.empty_like(x)
    layout = ChunkedLayout.split(4096, 2, 4, 512, False)
    rows = tri.encode_chunks(x, layout, 1)
    base = dict(tri._LAUNCH)
    for options in (base, {"num_warps": 2}, {}):
        tri._LAUNCH = options
        us = per_call_us(lambda: tri.encode_chunks(x, layout, 1))
        print(f"encode_chunks, launch options {options}: {us:.1f} us")
    tri._LAUNCH = base
    codec_calls = {
        "encode_chunks": lambda: tri.encode_chunks(x, layout, 1, out=rows),
        "decode_chunks": lambda: tri.decode_chunks(rows, layout, torch.float32, out=y),
        "decode_sum_encode": lambda: tri.decode_sum_encode(rows, 2048, own, 0, 0.5, 4, 512, 3),
    }
    times = {(name, on): [] for name in codec_calls for on in (True, False)}
    for _ in range(7):  # rounds taken in turn: the host's speed drifts
        for on in (True, False):
            direct_launch.ENABLED = on
            for name, fn in codec_calls.items():
                times[name, on].append(per_call_us(fn, 500))
    direct_launch.ENABLED = True
    rows_out = []
    for (name, on), us in times.items():
        rows_out.append({"call": name, "direct_launch": on, "median_us": statistics.median(us),
                         "rounds_us": us})  # fmt: skip
        print(f"{name}, direct launch {on}: median {statistics.median(us):.1f} us "
              f"(of 7 rounds: {min(us):.1f}-{max(us):.1f})")  # fmt: skip
    report = {"env": environment(x.device), "rows": rows_out}
    print(f"raw results: {write_json('launch_overhead', report)}")
    cases = {
        "torch.zeros 2 MiB": lambda: torch.zeros(2 << 20, dtype=torch.uint8, device="cuda"),
        "torch.empty 2 MiB": lambda: torch.empty(2 << 20, dtype=torch.uint8, device="cuda"),
        "ChunkedLayout.split": lambda: ChunkedLayout.split(1 << 26, 2, 4, 512, False).chunk(1),
    }
    for name, fn in cases.items():
        print(f"{name}: {per_call_us(fn):.1f} us")


if __name__ == "__main__":
    main()
