"""Where the Triton encode kernel spends its time: its stages switched off one by one (the
Philox random numbers, the min/max statistics) and Philox with fewer rounds, timed against
the codec's own encode (into a preallocated payload, as the allreduce calls it) and a device
copy in one run. A tuning aid for ``cgx2.codecs.maxmin_triton``; every variant but the
10-round one with statistics writes wrong bytes on purpose (that one is checked against the
codec).

Run on a GPU: ``python bench/encode_ablation.py [--numel N] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl
import triton.testing

from cgx2.bench.report import environment, write_json
from cgx2.codecs import maxmin_triton as tri
from cgx2.codecs.layout import ChunkedLayout
from cgx2.codecs.maxmin_triton import (
    _group_halves,
    _levels,
    _load_tile,
    _pack_store,
    _params,
    _philox,
    _stats,
    _store_meta,
)


@triton.jit(do_not_specialize=["k0", "k1"])
def _ablated_encode(
    x_ptr, lev_ptr, meta_ptr, k0, k1,
    BITS: tl.constexpr, B: tl.constexpr, BUCKETS: tl.constexpr,
    ROUNDS: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """The codec's encode of complete buckets (stream 0), with ROUNDS Philox rounds (0: a
    constant instead) and, unless STATS, a fixed [-4, 4] range instead of min/max."""
    q = tl.program_id(0).to(tl.int64) * BUCKETS + tl.arange(0, BUCKETS)
    qmask = q < (tl.program_id(0) + 1) * BUCKETS
    v0, v1, valid0, valid1 = _load_tile(x_ptr, q, qmask, 0, 0, B, B, True)
    if STATS:
        lo, hi = _stats(v0, v1, valid0, valid1)
    else:
        lo = tl.zeros((BUCKETS,), tl.float32) - 4.0
        hi = tl.zeros((BUCKETS,), tl.float32) + 4.0
    lo, step, scale, finite = _params(lo, hi, BITS)
    G: tl.constexpr = B // 8
    if ROUNDS:
        zero = tl.zeros((BUCKETS, G), dtype=tl.uint32)
        c0 = zero + tl.arange(0, G).to(tl.uint32)[None, :]
        c1 = zero + (q & 0xFFFFFFFF).to(tl.uint32)[:, None]
        c2 = zero + (q >> 32).to(tl.uint32)[:, None]
        r0, r1, r2, r3 = _philox(c0, c1, c2, zero, k0.to(tl.uint32), k1.to(tl.uint32), ROUNDS)
        h0 = _group_halves(r0, r2, BUCKETS, G)
        h1 = _group_halves(r1, r3, BUCKETS, G)
    else:
        h0 = tl.full((BUCKETS, G, 4), 0x8000, tl.uint32)
        h1 = h0
    l0 = _levels(v0, valid0, h0, lo, scale, BITS)
    l1 = _levels(v1, valid1, h1, lo, scale, BITS)
    _pack_store(lev_ptr, l0, l1, finite, q, qmask, 0, 0, BITS, B, B, True)
    _store_meta(meta_ptr, q, qmask, lo, step)


def ablated(x, payload, bits, b, key, buckets, warps, rounds, stats) -> torch.Tensor:
    """Encode ``x`` (whole buckets of ``b``) into ``payload``, the codec's layout."""
    nq = x.numel() // b
    levels_at = (8 * nq + 15) // 16 * 16
    _ablated_encode[(nq // buckets,)](
        x, payload[levels_at:], payload.view(torch.float32), key & 0xFFFFFFFF, key >> 32,
        BITS=bits, B=b, BUCKETS=buckets, ROUNDS=rounds, STATS=stats,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    results: list[dict] = []
    n, bits, b, key = args.numel, 4, 512, 0x1234_5678_9ABC
    x32 = torch.randn(n, device="cuda")
    src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"copy {src.numel() >> 20} MiB: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s")

    def report(label: str, fn, x: torch.Tensor) -> None:
        ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
        gbps = (n * x.element_size() + n * bits // 8) / ms / 1e6
        print(f"{label}: {ms:.3f} ms {gbps:6.0f} GB/s {gbps / copy_gbps:4.0%} of copy", flush=True)
        results.append({"variant": label, "ms": ms, "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})  # fmt: skip

    for x, name in ((x32, "fp32"), (x32.bfloat16(), "bf16")):
        expected = tri.encode(x, bits, b, key=key)
        whole = ChunkedLayout(n, 1, n, bits, b, False)
        codec = functools.partial(
            tri.encode_chunks, x, whole, key, out=expected.clone().view(1, -1)
        )
        report(f"{name} codec encode_chunks", codec, x)
        payload = torch.zeros_like(expected)
        for buckets, warps in ((1, 1), (2, 2)):
            for rounds, stats in ((10, True), (7, True), (0, True), (10, False), (0, False)):
                fn = functools.partial(ablated, x, payload, bits, b, key, buckets, warps, rounds,
                                       stats)  # fmt: skip
                same = bool(torch.equal(fn(), expected)) if (rounds, stats) == (10, True) else "-"
                report(f"{name} rounds={rounds} stats={stats} buckets={buckets} warps={warps} "
                       f"(codec's bytes: {same})", fn, x)  # fmt: skip
    if args.out_dir:
        report_json = {"env": environment(x32.device), "numel": n, "bits": bits, "bucket": b,
                       "copy_ms": copy_ms, "copy_gbps": copy_gbps, "rows": results}  # fmt: skip
        print(f"raw results: {write_json('encode_ablation', report_json, args.out_dir)}")


if __name__ == "__main__":
    main()
