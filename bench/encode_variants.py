"""Times the Triton encode, decode and decode-sum-encode kernels under launch variants (values
per program, warps, tiles per program) in one run, against a device copy: a tuning aid for
``cgx2.codecs.maxmin_triton`` (its ``_SHAPE``, per kernel and value width). Encode writes
into a preallocated payload, as the allreduce calls it.

Run on a GPU: ``python bench/encode_variants.py [--numel N] [--bits 4] [--warps 1,2,4]
[--tiles-per-program 1,4,16]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton.testing

from cgx2.bench.report import environment, write_json
from cgx2.codecs import maxmin_triton as tri
from cgx2.codecs.layout import ChunkedLayout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--bits", default="4")
    p.add_argument("--tiles", default="512,1024,2048")
    p.add_argument("--warps", default="1,2,4")
    p.add_argument(
        "--tiles-per-program",
        default=str(tri._TILES_PER_PROGRAM),
        help="tiles each program of the strided kernels walks (comma list)",
    )
    p.add_argument("--kernels", default="encode,decode,dse")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    results: list[dict] = []
    n = args.numel
    x32 = torch.randn(n, device="cuda")
    xbf = x32.bfloat16()
    src = torch.empty(n * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    print(f"copy {src.numel() >> 20} MiB: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s")
    base = dict(tri._SHAPE)
    base_depth = tri._TILES_PER_PROGRAM

    kernels = args.kernels.split(",")

    def report(kernel: str, name: str, bits: int, tile: int, warps: int, fn, moved: int) -> None:
        if kernel not in kernels:
            return
        ms = triton.testing.do_bench(fn, rep=100, return_mode="median")
        gbps = moved / ms / 1e6
        depth = tri._TILES_PER_PROGRAM
        print(f"{kernel:6s} {name} bits={bits} tile={tile:5d} warps={warps:2d} "
              f"tiles/program={depth:3d}: {ms:.3f} ms {gbps:6.0f} GB/s "
              f"{gbps / copy_gbps:4.0%} of copy", flush=True)  # fmt: skip
        results.append({"kernel": kernel, "dtype": name, "bits": bits, "tile": tile, "warps": warps,
                        "tiles_per_program": depth, "ms": ms, "gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})  # fmt: skip

    for bits in [int(b) for b in args.bits.split(",")]:
        for tile in [int(t) for t in args.tiles.split(",")]:
            for warps, depth in itertools.product(
                [int(w) for w in args.warps.split(",")],
                [int(d) for d in args.tiles_per_program.split(",")],
            ):
                tri._SHAPE = dict.fromkeys(base, (tile, warps))
                tri._TILES_PER_PROGRAM = depth
                for name, x in (("fp32", x32), ("bf16", xbf)):
                    if name not in args.dtypes.split(","):
                        continue
                    payload = tri.encode(x, bits, 512, key=1)
                    size = x.numel() * x.element_size()
                    layout = ChunkedLayout(n, 1, n, bits, 512, False)
                    report("encode", name, bits, tile, warps,
                           lambda x=x, lay=layout, p=payload: tri.encode_chunks(
                               x, lay, 1, out=p.view(1, -1)),
                           size + payload.numel())  # fmt: skip
                    report("decode", name, bits, tile, warps,
                           lambda p=payload, x=x, b=bits: tri.decode(p, n, b, 512, x.dtype),
                           size + payload.numel())  # fmt: skip
                    # 4 rows of n/4 values, as `python -m cgx2.bench kernels` times it
                    own = x[: n // 4]
                    row = tri.encode(own, bits, 512, key=2)
                    payloads = torch.stack([row] * 4)
                    moved = 4 * row.numel() + own.numel() * own.element_size()
                    report("dse", name, bits, tile, warps,
                           lambda r=payloads, o=own, b=bits: tri.decode_sum_encode(
                               r, o.numel(), o, 1, 0.25, b, 512, key=2), moved)  # fmt: skip
    tri._SHAPE = base
    tri._TILES_PER_PROGRAM = base_depth
    if args.out_dir:
        report_json = {"env": environment(x32.device), "numel": n, "copy_ms": copy_ms,
                       "copy_gbps": copy_gbps, "rows": results}  # fmt: skip
        print(f"raw results: {write_json('encode_variants', report_json, args.out_dir)}")


if __name__ == "__main__":
    main()
