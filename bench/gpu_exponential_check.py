"""GPU check of the exponential dithering codec: the Triton kernels against the torch reference,
bit for bit, on CUDA; then encode + decode of 64M fp32 values timed against a device-to-device copy.

    python bench/gpu_exponential_check.py                      # on a CUDA machine
    python bench/gpu_exponential_check.py --device cpu --sizes 1,7,100   # smoke test, interpreter

Prints one ``ok``/``FAIL`` line per case and a summary line; exits 1 if any case failed.
"""

from __future__ import annotations

import os
import sys

# Before torch/triton are imported: the repo root goes on sys.path (so `import cgx2` works without
# installing), and `--device cpu` needs Triton's interpreter.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.join(sys.path[0], "tests"))  # the suite's edge values: fp32_edges
if any(
    a == "--device=cpu" or (p == "--device" and a == "cpu")
    for p, a in zip(sys.argv, sys.argv[1:], strict=False)
):
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
from collections.abc import Callable

import torch
import triton.testing
from fp32_edges import EDGES as FP32_EDGES
from fp32_edges import INF, NON_FINITE

from cgx2.codecs import exponential as ref
from cgx2.codecs import exponential_triton as tri

KEY = 0xDEADBEEF_CAFEF00D  # both 32-bit halves >= 2**31
SMALL_KEY = 0x12345678_00000042  # both < 2**31: Triton passes them as int32, another signature
STREAM = 3
EDGES = [*FP32_EDGES, *NON_FINITE]  # the test suite's, ahead of the random values
M64 = 64 * 1024 * 1024


def make_input(n: int, device: torch.device, seed: int, finite: bool) -> torch.Tensor:
    """[-1, 1] scaled by 2**-(0..159) (every binade, subnormals too), edge values first."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.rand(n, generator=g, device=device) * 2 - 1
    x *= torch.exp2(-torch.randint(0, 160, (n,), generator=g, device=device).float())
    edges = torch.tensor([e for e in EDGES if not finite or abs(e) < INF], device=device)[:n]
    x[: edges.numel()] = edges
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Bit-identical (any NaN equals any NaN: a GPU's fp32 add returns its own NaN); else where."""
    a, b = a.cpu(), b.cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        differ = (nan_a != nan_b) | (~nan_a & ~nan_b & (a.view(torch.int32) != b.view(torch.int32)))
    else:
        differ = a != b
    if not differ.any():
        return True, ""
    where = differ.nonzero().flatten()
    i = int(where[0])
    return False, f"{where.numel()} of {a.numel()} differ, first at {i}: {a[i]} vs {b[i]}"


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        try:
            ok, why = fn()
        except Exception as e:  # a crash is a failed case, not the end of the run
            ok, why = False, f"{type(e).__name__}: {e}"
        self.passed += ok
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}{'' if ok else '  ' + why}", flush=True)


def run_checks(device: torch.device, sizes: list[int], bits_list: list[int]) -> Checks:
    checks = Checks()
    for n in sizes:
        for bits in bits_list:
            for finite in (True, False):
                g = make_input(n, device, seed=n + bits, finite=finite)
                # With NaN/Inf present the global norm would make everything NaN: no norm then.
                norm = g.abs().amax().reshape(1) if finite and n else None
                key = KEY if bits % 2 else SMALL_KEY
                name = f"n={n} bits={bits} {'finite/norm' if finite else 'edges/no norm'}"
                expected = ref.encode(g, norm, bits, key, STREAM)
                codes = tri.encode(g, norm, bits, key, STREAM)
                checks.check(f"encode      {name}", lambda c=codes, e=expected: same(c, e))
                checks.check(
                    f"decode      {name}", lambda e=expected: same(tri.decode(e), ref.decode(e))
                )
                rows = torch.stack([expected, expected.roll(1), -expected.flip(0)])
                scale = torch.tensor([0.37], device=device)
                checks.check(
                    f"decode_sum  {name}",
                    lambda r=rows, s=scale: same(tri.decode_sum(r, s), ref.decode_sum(r, s)),
                )
    n = max(sizes)
    for dtype in (torch.bfloat16, torch.float16):
        g = make_input(n, device, seed=5, finite=True).to(dtype)
        norm = g.abs().amax().float().reshape(1)
        checks.check(
            f"encode      n={n} bits=8 {str(dtype).removeprefix('torch.')}/norm",
            lambda g=g, nm=norm: same(tri.encode(g, nm, 8, KEY), ref.encode(g, nm, 8, KEY)),
        )
    every = {
        torch.int8: torch.arange(-128, 128),
        torch.int32: torch.cat([torch.arange(-200, 201), torch.tensor([-(2**31), 2**31 - 1])]),
    }
    for dtype, codes in every.items():
        codes = codes.to(device, dtype)
        checks.check(
            f"decode      every {str(dtype).removeprefix('torch.')} code",
            lambda c=codes: same(tri.decode(c), ref.decode(c)),
        )
    return checks


def time_ms(fn: Callable[[], object], rep_ms: int) -> float:
    """Median of triton.testing.do_bench (CUDA events, L2 flushed between reps)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def run_timing(device: torch.device, n: int, bits_list: list[int], rep_ms: int) -> None:
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), rep_ms)
    copy_gbps = 2 * src.nbytes / copy_ms / 1e6
    print(f"copy        {n} fp32: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s (read + write)")
    g = src
    norm = g.abs().amax().reshape(1)
    for bits in bits_list:
        codes = tri.encode(g, norm, bits, KEY)
        moved = g.nbytes + codes.nbytes  # encode and decode each move this much
        enc = time_ms(lambda b=bits: tri.encode(g, norm, b, KEY), rep_ms)
        dec = time_ms(lambda c=codes: tri.decode(c), rep_ms)
        for op, ms, nbytes in (
            ("encode", enc, moved),
            ("decode", dec, moved),
            ("encode+decode", enc + dec, 2 * moved),
        ):
            gbps = nbytes / ms / 1e6
            print(
                f"time {op:<14} bits={bits} n={n}: {ms:.3f} ms, {gbps:.0f} GB/s "
                f"({100 * gbps / copy_gbps:.0f}% of copy)",
                flush=True,
            )
    ref_ms = time_ms(lambda: ref.decode(ref.encode(g, norm, 8, KEY)), rep_ms)
    print(f"time reference encode+decode bits=8 n={n}: {ref_ms:.3f} ms (torch, for scale)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--sizes",
        default="1,7,4095,4096,4097,65537,1000003,16777221",
        help="comma-separated element counts for the bit-for-bit checks",
    )
    parser.add_argument("--bits", default="2,3,4,7,8,9,12,16")
    parser.add_argument("--bench-numel", type=int, default=M64, help="0: no timing")
    parser.add_argument("--bench-bits", default="8,16")
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (use --device cpu for the interpreter smoke test)")
    sizes = [int(s) for s in args.sizes.split(",")]
    bits_list = [int(b) for b in args.bits.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    checks = run_checks(device, sizes, bits_list)
    total = checks.passed + checks.failed
    if device.type == "cuda" and args.bench_numel > 0:
        run_timing(
            device, args.bench_numel, [int(b) for b in args.bench_bits.split(",")], args.rep_ms
        )
    elif args.bench_numel > 0:
        print("timing skipped: it needs a CUDA device")
    verdict = "all ok" if not checks.failed else f"{checks.failed} FAILED"
    print(f"exponential kernels: {checks.passed}/{total} ok ({verdict})", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
