"""The max-min kernels on a tensor of more than 2**31 values (their indices must be 64-bit
there): encode + decode and decode-sum-encode + decode, each value checked against its
bucket's bound on the GPU (a CPU reference of 2**31 values would take minutes). A value
written to the wrong place, or not at all, breaks the bound. Needs ~45 GB of GPU memory:
``python bench/gpu_large_check.py [--numel N] [--bits 4,8]``; the JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from cgx2.bench.report import environment, write_json
from cgx2.codecs import maxmin_triton as tri

BUCKET = 512


def _worst(decoded: torch.Tensor, exact: torch.Tensor, bits: int) -> tuple[float, int]:
    """max over values of |decoded - exact| / its bound, and how many exceed it. The bound is
    the tests' (tests/bounds.py): one step of the bucket, widened by 1e-5 for the fp32
    rounding of the level's computation, plus 8 fp32 ulps of the bucket's largest value."""
    n = exact.numel()
    full = n // BUCKET * BUCKET
    worst, over = 0.0, 0
    for part, width in ((slice(0, full), BUCKET), (slice(full, n), n - full)):
        if width == 0:
            continue
        e, d = exact[part].view(-1, width), decoded[part].view(-1, width)
        lo, hi = e.aminmax(dim=1)
        step = (hi.double() - lo.double()) / (2**bits - 1)
        absmax = torch.maximum(hi.abs(), lo.abs()).double()
        bound = (step * (1 + 1e-5) + 8 * 2.0**-23 * absmax).clamp_min(1e-45).float()
        ratio = (d - e).abs_() / bound[:, None]
        worst = max(worst, ratio.max().item())
        over += int((ratio > 1).sum().item())
        del ratio
    return worst, over


def _record(
    rows: list[dict], op: str, said: str, decoded: torch.Tensor, want: torch.Tensor, bits: int
) -> None:
    """``decoded``'s worst error against the bound around ``want``: a row of ``rows``, a line."""
    worst, over = _worst(decoded, want, bits)
    rows.append({"op": op, "bits": bits, "worst_over_bound": worst, "over": over})
    print(f"{said}: worst |err|/bound {worst:.3f}, {over} values over the bound", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=2**31 + 4099)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke test
    p.add_argument("--out-dir", default="bench/results", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(args.numel, device=device, generator=g)
    x[-(1 << 16) :] = torch.linspace(-3.0, 5.0, 1 << 16, device=device)  # the last buckets
    z = torch.randn(args.numel, device=device, generator=g)
    rows = []
    for bits in (int(b) for b in args.bits.split(",")):
        payload = tri.encode(x, bits, BUCKET, key=0xDEADBEEF_CAFEF00D)
        decoded = tri.decode(payload, args.numel, bits, BUCKET)
        _record(
            rows, "encode+decode", f"encode+decode, {bits} bits, n={args.numel}", decoded, x, bits
        )
        del decoded
        # Row 0 stands for our own chunk (skipped); row 1 is z's payload.
        pz = tri.encode(z, bits, BUCKET, key=0x12345678_9ABCDEF1)
        summed = x + tri.decode(pz, args.numel, bits, BUCKET)
        out = tri.decode_sum_encode(
            torch.stack([payload, pz]),
            args.numel,
            x,
            0,
            None,
            bits,
            BUCKET,
            key=0x0F0F0F0F_F0F0F0F0,
        )
        del payload, pz
        decoded = tri.decode(out, args.numel, bits, BUCKET)
        _record(rows, "dse+decode", f"decode-sum-encode+decode, {bits} bits", decoded, summed, bits)
        del decoded
        del out, summed
        torch.cuda.empty_cache()
    failed = any(r["over"] for r in rows)
    report = {"env": environment(device), "numel": args.numel, "rows": rows, "failed": failed}
    print(f"raw results: {write_json('gpu_large_check', report, args.out_dir)}")
    print("===== FAILED" if failed else "===== OK")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
