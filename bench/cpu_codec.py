"""The max-min codec on CPU tensors: its C loops (:mod:`cgx2.codecs.native`; vector and scalar
where the CPU has AVX2) against the torch code they replace and a memory copy, timed in one
process in interleaved rounds.
``python bench/cpu_codec.py [--numel 4M] [--threads 1,2]``; table on stdout, JSON under
bench/results/."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from cgx2.bench.report import environment, format_table, write_json
from cgx2.codecs import maxmin, native
from cgx2.codecs.layout import ChunkedLayout

BUCKET = 512


def seconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def workloads(x: torch.Tensor, bits: int) -> dict[str, tuple]:
    """name -> (function, bytes read + written): the allreduce's three codec stages on 2 ranks."""
    n = x.numel()
    layout = ChunkedLayout.split(n, 2, bits, BUCKET, False)
    rows = maxmin.encode_chunks(x, layout, 1)
    out = torch.empty_like(x)
    own = x[: layout.chunk_size(0)]
    size, payload = n * x.element_size(), rows.numel()
    return {
        "encode": (lambda: maxmin.encode_chunks(x, layout, 1, out=rows), size + payload),
        "decode": (lambda: maxmin.decode_chunks(rows, layout, x.dtype, out=out), size + payload),
        "dse": (
            lambda: maxmin.decode_sum_encode(rows, own.numel(), own, 0, 0.5, bits, BUCKET, 2),
            own.numel() * x.element_size() + payload,
        ),
    }


def _speedup(times: dict[tuple, list[float]], over: tuple, s: float) -> float | None:
    """How many times faster ``s`` seconds are than the median of ``over``, where it ran."""
    return statistics.median(times[over]) / s if over in times else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", default="4M", help="values, e.g. 4M")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    if native.library() is None:
        sys.exit("the C loops did not build here (see the log); nothing to compare")
    numel = int(args.numel.rstrip("Mm")) << 20 if args.numel[-1] in "Mm" else int(args.numel)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    base = torch.randn(numel)
    library = native.library
    simd = library().maxmin_simd()
    impls = ("C", "C-scalar", "torch") if simd else ("C", "torch")
    times: dict[tuple, list[float]] = {}
    moved: dict[tuple, int] = {}
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            dst = torch.empty_like(base)
            key = ("copy", "fp32", threads, "-")
            times.setdefault(key, []).append(seconds(lambda d=dst: d.copy_(base), args.repeats))
            moved[key] = 2 * base.numel() * 4
            for d in args.dtypes.split(","):
                x = base.to(dtypes[d])
                for impl in impls:
                    native.library = library if impl.startswith("C") else lambda: None
                    library().maxmin_simd(impl == "C" and simd)
                    for name, (fn, nbytes) in workloads(x, args.bits).items():
                        key = (name, d, threads, impl)
                        times.setdefault(key, []).append(seconds(fn, args.repeats))
                        moved[key] = nbytes
                native.library = library
                library().maxmin_simd(simd)
    rows = []
    for (name, d, threads, impl), ts in times.items():
        s = statistics.median(ts)
        rows.append(
            {
                "kernel": name,
                "dtype": d,
                "threads": threads,
                "impl": impl,
                "ms": 1e3 * s,
                "gbps": moved[name, d, threads, impl] / s / 1e9,
                "x_torch": _speedup(times, (name, d, threads, "torch"), s),
                "x_scalar": _speedup(times, (name, d, threads, "C-scalar"), s),
            }
        )
    columns = [
        ("kernel", "stage", ""),
        "dtype",
        "threads",
        "impl",
        ("ms", "ms", ".2f"),
        ("gbps", "GB/s moved", ".2f"),
        ("x_torch", "x torch", ".2f"),
        ("x_scalar", "x C-scalar", ".2f"),
    ]
    print(format_table(rows, columns))
    print(
        f"{numel} values, {args.bits} bits, bucket {BUCKET}; the stages of a 2-rank allreduce "
        f"(dse: decode-sum-encode of one chunk); median of {args.rounds} rounds"
    )
    if args.out_dir:
        report = {"env": environment(torch.device("cpu")), "args": vars(args), "rows": rows}
        print(f"raw results: {write_json('cpu_codec', report, args.out_dir)}")


if __name__ == "__main__":
    main()
