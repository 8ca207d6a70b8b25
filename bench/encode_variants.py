"""Times the Triton encode/decode-sum-encode kernels under launch variants (tile size, warps)
in one run, against a device copy: a tuning aid for ``cgx2.codecs.maxmin_triton``.

Run on a GPU: ``python bench/encode_variants.py [--numel N]``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton.testing

from cgx2.codecs import maxmin_triton as tri


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--bits", default="4")
    args = p.parse_args()
    n = args.numel
    x32 = torch.randn(n, device="cuda")
    xbf = x32.bfloat16()
    src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"copy {src.numel() >> 20} MiB: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s")
    base_launch, base_tile = dict(tri._LAUNCH), tri._TILE
    for bits in [int(b) for b in args.bits.split(",")]:
        for tile in (512, 1024, 2048):
            for warps in (1, 2, 4, 8):
                tri._TILE = tile
                tri._LAUNCH = {**base_launch, "num_warps": warps}
                for name, x in (("fp32", x32), ("bf16", xbf)):
                    payload = tri.encode(x, bits, 512, key=1)
                    ms = triton.testing.do_bench(
                        lambda x=x, b=bits: tri.encode(x, b, 512, key=1),
                        rep=100,
                        return_mode="median",
                    )
                    moved = x.numel() * x.element_size() + payload.numel()
                    print(f"encode {name} bits={bits} tile={tile:5d} warps={warps:2d}: "
                          f"{ms:.3f} ms {moved / ms / 1e6:6.0f} GB/s "
                          f"{moved / ms / 1e6 / copy_gbps:4.0%} of copy", flush=True)  # fmt: skip
                    rows = torch.stack([payload] * 4)
                    own = x[: x.numel()]
                    ms = triton.testing.do_bench(
                        lambda x=x, b=bits, rows=rows: tri.decode_sum_encode(
                            rows, x.numel(), x, 1, 0.25, b, 512, key=2
                        ),
                        rep=100,
                        return_mode="median",
                    )
                    moved = 3 * payload.numel() + own.numel() * own.element_size() + payload.numel()
                    print(f"dse    {name} bits={bits} tile={tile:5d} warps={warps:2d}: "
                          f"{ms:.3f} ms {moved / ms / 1e6:6.0f} GB/s "
                          f"{moved / ms / 1e6 / copy_gbps:4.0%} of copy", flush=True)  # fmt: skip
    tri._TILE, tri._LAUNCH = base_tile, base_launch


if __name__ == "__main__":
    main()
