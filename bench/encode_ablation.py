"""Where the Triton encode kernel spends its time: the kernel with its stages switched off one
by one (random numbers, min/max, packing), a persistent, software-pipelined variant, and a
grouped 4-bit variant (a [buckets, B/8, 8] tile: one Philox call and one word per group, no
re-layout; with 10 rounds it writes the codec's bytes, which the run checks), timed against a
device copy in one run. A tuning aid for ``cgx2.codecs.maxmin_triton``; the other variants
write wrong bytes on purpose.

Run on a GPU: ``python bench/encode_ablation.py [--numel N]``.
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
from cgx2.codecs.maxmin_triton import _pack_store, _params, _philox, _stats, _tile, _uniforms


@triton.jit
def _minmax(a_lo, a_hi, b_lo, b_hi):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi)


@triton.jit(do_not_specialize=["k0", "k1", "stream"])
def _ablated_encode(
    x_ptr, out_u8, nq, quant, k0, k1, stream,
    BITS: tl.constexpr, B: tl.constexpr, BUCKETS: tl.constexpr, BLOCK: tl.constexpr,
    RNG: tl.constexpr, STATS: tl.constexpr, PACK: tl.constexpr, RNG_FIRST: tl.constexpr,
):  # fmt: skip
    q = tl.program_id(0).to(tl.int64) * BUCKETS + tl.arange(0, BUCKETS)
    qmask = q < nq
    e, valid = _tile(q, qmask, quant, 0, B, BLOCK)
    v = tl.load(x_ptr + e, mask=valid, other=0.0).to(tl.float32)
    if RNG_FIRST:
        r0 = _uniforms(k0.to(tl.uint32), k1.to(tl.uint32), q, stream, 0, BUCKETS, BLOCK)
    if STATS == 2:
        lo, hi = tl.reduce(
            (
                tl.where(valid, tl.where(v == v, v, float("-inf")), float("inf")),
                tl.where(valid, v, float("-inf")),
            ),
            1,
            _minmax,
        )
    elif STATS:
        lo, hi = _stats(v, valid)
    else:
        lo = tl.zeros((BUCKETS,), tl.float32) - 4.0
        hi = tl.zeros((BUCKETS,), tl.float32) + 4.0
    lo, step, scale, finite = _params(lo, hi, BITS)
    if RNG_FIRST:
        r = r0
    elif RNG == 1:
        r = _uniforms(k0.to(tl.uint32), k1.to(tl.uint32), q, stream, 0, BUCKETS, BLOCK)
    elif RNG == 2:  # a cheap hash per value, to price Philox against any in-kernel generator
        h = (e.to(tl.uint32) ^ k0.to(tl.uint32)) * 0x9E3779B1
        h = (h ^ (h >> 15)) * 0x85EBCA77
        r = (h >> 16).to(tl.float32) * (1.0 / 65536.0)
    else:
        r = 0.5
    lmax: tl.constexpr = (1 << BITS) - 1
    level = tl.floor((v - lo[:, None]) * scale[:, None] + r)
    level = tl.minimum(tl.maximum(level, 0.0), lmax)
    level = tl.where(valid & finite[:, None], level, 0.0)
    if PACK:
        _pack_store(out_u8, level, finite, q, qmask, quant, 0, BITS, B, BUCKETS, BLOCK, True)
    else:
        tl.store(out_u8 + e, level.to(tl.uint8), mask=valid)
    tl.store(out_u8.to(tl.pointer_type(tl.float32)) + q, step, mask=qmask)


@triton.jit(do_not_specialize=["k0", "k1", "stream"])
def _persistent_encode(
    x_ptr, out_u8, nq, quant, k0, k1, stream,
    BITS: tl.constexpr, B: tl.constexpr, BUCKETS: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    ntiles = tl.cdiv(nq, BUCKETS)
    for t in tl.range(tl.program_id(0), ntiles, tl.num_programs(0), num_stages=STAGES):
        q = (tl.zeros((BUCKETS,), tl.int64) + t) * BUCKETS + tl.arange(0, BUCKETS)
        qmask = q < nq
        e, valid = _tile(q, qmask, quant, 0, B, BLOCK)
        v = tl.load(x_ptr + e, mask=valid, other=0.0).to(tl.float32)
        lo, hi = _stats(v, valid)
        lo, step, scale, finite = _params(lo, hi, BITS)
        r = _uniforms(k0.to(tl.uint32), k1.to(tl.uint32), q, stream, 0, BUCKETS, BLOCK)
        lmax: tl.constexpr = (1 << BITS) - 1
        level = tl.floor((v - lo[:, None]) * scale[:, None] + r)
        level = tl.minimum(tl.maximum(level, 0.0), lmax)
        level = tl.where(valid & finite[:, None], level, 0.0)
        _pack_store(out_u8, level, finite, q, qmask, quant, 0, BITS, B, BUCKETS, BLOCK, True)
        tl.store(out_u8.to(tl.pointer_type(tl.float32)) + q, step, mask=qmask)


@triton.jit(do_not_specialize=["k0", "k1"])
def _grouped_encode(
    x_ptr, lev_ptr, meta_ptr, k0, k1,
    B: tl.constexpr, BUCKETS: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    """4-bit encode of complete buckets on a [BUCKETS, B/8, 8] tile: each group of 8 values is
    one Philox call and one 32-bit word, so no re-layout joins the random numbers to the
    values. With 10 rounds it writes the codec's bytes (stream 0)."""
    G: tl.constexpr = B // 8
    q = tl.program_id(0).to(tl.int64) * BUCKETS + tl.arange(0, BUCKETS)
    g = tl.arange(0, G)
    k = tl.arange(0, 8)
    e = q[:, None, None] * B + g[None, :, None] * 8 + k[None, None, :]
    v = tl.load(x_ptr + e).to(tl.float32)
    lo = tl.min(tl.min(tl.where(v == v, v, float("-inf")), axis=2), axis=1)
    hi = tl.max(tl.max(v, axis=2), axis=1)
    lo, step, scale, finite = _params(lo, hi, 4)
    zero = tl.zeros((BUCKETS, G), dtype=tl.uint32)
    c0 = zero + g.to(tl.uint32)[None, :]
    c1 = zero + (q & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = zero + (q >> 32).to(tl.uint32)[:, None]
    r0, r1, r2, r3 = _philox(c0, c1, c2, zero, k0.to(tl.uint32), k1.to(tl.uint32), ROUNDS)
    kk = k[None, None, :]
    # The codec's order of the four words over a group: r0, r2, r1, r3 (see .philox).
    w = tl.where(kk < 2, r0[:, :, None], tl.where(kk < 4, r2[:, :, None],
                 tl.where(kk < 6, r1[:, :, None], r3[:, :, None])))  # fmt: skip
    half = tl.where(kk % 2 == 0, w & 0xFFFF, w >> 16)
    u = half.to(tl.float32) * (1.0 / 65536.0)
    level = tl.floor((v - lo[:, None, None]) * scale[:, None, None] + u)
    level = tl.where(level > 15.0, 15.0, level)
    level = tl.where(level >= 0.0, level, 0.0)
    level = tl.where(finite[:, None, None], level, 0.0)
    word = tl.sum(level.to(tl.uint32) << (kk.to(tl.uint32) * 4), axis=2)  # disjoint bits
    tl.store(lev_ptr.to(tl.pointer_type(tl.uint32)) + q[:, None] * G + g[None, :], word)
    tl.store(meta_ptr + 2 * q, lo)
    tl.store(meta_ptr + 2 * q + 1, step)


def grouped(x: torch.Tensor, payload: torch.Tensor, b: int, key: int, buckets: int,
            rounds: int, warps: int) -> torch.Tensor:  # fmt: skip
    """Encode ``x`` (whole buckets of ``b``) into ``payload``, the codec's layout."""
    nq = x.numel() // b
    levels_at = (8 * nq + 15) // 16 * 16
    _grouped_encode[(nq // buckets,)](
        x, payload[levels_at:], payload.view(torch.float32), key & 0xFFFFFFFF, key >> 32,
        B=b, BUCKETS=buckets, ROUNDS=rounds, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return payload


def persistent(x, out, n, bits, b, warps, buckets, stages, per_sm) -> None:
    nq = n // b
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(triton.cdiv(nq, buckets), sms * per_sm),)
    _persistent_encode[grid](
        x, out, nq, n, 12345, 678, 3, BITS=bits, B=b, BUCKETS=buckets, BLOCK=b, STAGES=stages,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip


def ablated(x, out, n, bits, b, warps, buckets, rng, stats, pack, first) -> None:
    nq = n // b
    _ablated_encode[(nq // buckets,)](
        x, out, nq, n, 12345, 678, 3, BITS=bits, B=b, BUCKETS=buckets, BLOCK=b,
        RNG=rng, STATS=stats, PACK=pack, RNG_FIRST=first, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--parts", default="grouped,stages,persistent", help="which variants to time")
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    results: list[dict] = []
    parts = set(args.parts.split(","))
    n, bits, b = args.numel, 4, 512
    x32 = torch.randn(n, device="cuda")
    src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"copy {src.numel() >> 20} MiB: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s")
    out = torch.empty(n, dtype=torch.uint8, device="cuda")

    def report(label: str, fn, x: torch.Tensor) -> None:
        ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
        gbps = (n * x.element_size() + n * bits // 8) / ms / 1e6
        print(f"{label}: {ms:.3f} ms {gbps:6.0f} GB/s {gbps / copy_gbps:4.0%} of copy", flush=True)
        results.append({"variant": label, "ms": ms, "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})  # fmt: skip

    from cgx2.codecs import maxmin_triton as tri

    for x, name in ((x32, "fp32"), (x32.bfloat16(), "bf16")) if "grouped" in parts else ():
        expected = tri.encode(x, bits, b, key=0x1234_5678_9ABC)
        payload = torch.zeros_like(expected)
        for buckets, warps in ((1, 1), (1, 2), (2, 2), (4, 4)):
            for rounds in (10, 7):
                fn = functools.partial(grouped, x, payload, b, 0x1234_5678_9ABC, buckets, rounds,
                                       warps)  # fmt: skip
                same = bool(torch.equal(fn(), expected)) if rounds == 10 else "-"
                report(f"{name} grouped rounds={rounds} buckets={buckets} warps={warps} "
                       f"(codec's bytes: {same})", fn, x)  # fmt: skip
    for x, name in ((x32, "fp32"), (x32.bfloat16(), "bf16")) if "stages" in parts else ():
        # rng 0: none, 1: Philox, 2: a cheap hash; stats 0: none, 1: two reductions, 2: one
        variants = ((1, 1, 1, 0), (1, 1, 1, 1), (1, 2, 1, 0), (0, 1, 1, 0),
                    (2, 1, 1, 0), (1, 0, 1, 0), (1, 1, 0, 0), (0, 0, 0, 0))  # fmt: skip
        for rng, stats, pack, first in variants:
            for warps, buckets in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 4)):
                fn = functools.partial(ablated, x, out, n, bits, b, warps, buckets, rng, stats,
                                       pack, first)  # fmt: skip
                report(f"{name} rng={rng} stats={stats} pack={pack} rng_first={first} "
                       f"warps={warps} buckets={buckets}", fn, x)  # fmt: skip
    for x, name in ((x32, "fp32"), (x32.bfloat16(), "bf16")) if "persistent" in parts else ():
        for warps, buckets in ((1, 1), (1, 2), (2, 2)):
            for stages in (1, 3):
                for per_sm in (8, 32):
                    fn = functools.partial(persistent, x, out, n, bits, b, warps, buckets,
                                           stages, per_sm)  # fmt: skip
                    report(f"{name} persistent warps={warps} buckets={buckets} "
                           f"stages={stages} per_sm={per_sm}", fn, x)  # fmt: skip
    if args.out_dir:
        report_json = {"env": environment(x32.device), "numel": n, "bits": bits, "bucket": b,
                       "copy_ms": copy_ms, "copy_gbps": copy_gbps, "rows": results}  # fmt: skip
        print(f"raw results: {write_json('encode_ablation', report_json, args.out_dir)}")


if __name__ == "__main__":
    main()
