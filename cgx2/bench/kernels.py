"""Throughput of the Triton max-min kernels (encode, decode, decode-sum-encode) against a
device-to-device copy timed in the same run: ``python -m cgx2.bench kernels`` (and gpu_check).
Triton is imported when a kernel is timed, so that ``--help`` and the helpers need none."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cgx2.codecs import maxmin as ref
from cgx2.codecs.layout import ChunkedLayout, MaxMinLayout
from cgx2.config import parse_bytes

from .report import (
    DTYPES,
    add_bits_argument,
    add_bucket_size_argument,
    add_dtypes_argument,
    add_out_argument,
    bit_widths,
    dtype_names,
    environment,
    parser,
    write_json,
)

__all__ = [
    "CONVENTIONS",
    "CopyBaseline",
    "format_timing",
    "main",
    "make_input",
    "run_timing",
    "time_ms",
    "timing_row",
]

KEY = 0xDEADBEEF_CAFEF00D  # both 32-bit halves >= 2**31 (Triton passes them as uint32)
K = 4  # rows of decode_sum_encode / chunks of encode_chunks
DTYPE_NAME = {v: k for k, v in DTYPES.items()}
M64 = 64 * 1024 * 1024
INTERPRET_NUMEL = 1 << 16  # default under TRITON_INTERPRET=1: the interpreter is slow
CONVENTIONS = {
    "GB": "1e9 bytes",
    "gbps": "(bytes_read + bytes_written) / median time",
    "copy": "dst.copy_(src) of copy_bytes = bytes_moved/2 bytes; "
    "copy_gbps = 2 * copy_bytes / copy time",
    "encode": "read numel*elt, write payload",
    "decode": "read payload, write numel*elt",
    "dse": f"read {K - 1} payload rows (row own_index is not read) "
    "+ own numel*elt, write one payload",
    "timed_calls": "encode: encode_chunks into a preallocated payload (the allreduce's "
    "call; the public encode() adds a torch.zeros of it); decode, decode_sum_encode: the "
    "public functions",
}

_T0 = time.monotonic()


def log(msg: str) -> None:
    """Progress line on stderr."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def make_input(n: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Gaussian values whose scale changes every 256 elements by 2**[-10, 10]."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, generator=g, device=device, dtype=torch.float32)
    blocks = n // 256 + 1
    exps = torch.randint(-10, 11, (blocks,), generator=g, device=device).to(torch.float32)
    x *= torch.exp2(exps).repeat_interleave(256)[:n]
    return x.to(dtype)


def time_ms(fn: Callable[[], Any], device: torch.device, rep_ms: int) -> float:
    """Median time of ``fn`` in ms: triton.testing.do_bench (CUDA events, L2 flushed between
    reps) on CUDA; a wall clock on the CPU (meaningless, smoke test only)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


class CopyBaseline:
    """``dst.copy_(src)`` of S uint8 bytes moves 2*S bytes (S read + S written); a kernel that
    reads + writes T bytes is compared with a copy of S = T/2 bytes, timed in the same run."""

    def __init__(self, device: torch.device, rep_ms: int) -> None:
        self.device, self.rep_ms = device, rep_ms
        self.cache: dict[int, float] = {}

    def ms(self, moved: int) -> float:
        s = max(16, moved // 2 // 16 * 16)
        if s not in self.cache:
            src = torch.empty(s, dtype=torch.uint8, device=self.device).random_(0, 256)
            dst = torch.empty_like(src)
            self.cache[s] = time_ms(lambda: dst.copy_(src), self.device, self.rep_ms)
            del src, dst
        return self.cache[s]

    def gbps(self, moved: int) -> float:
        s = max(16, moved // 2 // 16 * 16)
        return 2 * s / (self.ms(moved) * 1e-3) / 1e9


def timing_row(
    op: str,
    dtype: torch.dtype,
    bits: int,
    numel: int,
    fn: Callable[[], Any],
    read: int,
    written: int,
    copy: CopyBaseline,
    rep_ms: int,
    bucket: int = 512,
) -> dict[str, Any]:
    """Time ``fn``, which reads ``read`` and writes ``written`` bytes, against the copy."""
    ms = time_ms(fn, copy.device, rep_ms)
    moved = read + written
    gbps = moved / (ms * 1e-3) / 1e9
    cgbps = copy.gbps(moved)
    row = {
        "op": op,
        "dtype": DTYPE_NAME[dtype],
        "bits": bits,
        "bucket": bucket,
        "numel": numel,
        "ms": ms,
        "bytes_read": read,
        "bytes_written": written,
        "bytes_moved": moved,
        "gbps": gbps,
        "copy_bytes": max(16, moved // 2 // 16 * 16),
        "copy_ms": copy.ms(moved),
        "copy_gbps": cgbps,
        "frac_of_copy": gbps / cgbps if cgbps else 0.0,
    }
    log(
        f"time {op:<14} {DTYPE_NAME[dtype]} b={bits}: {ms:.3f} ms, {gbps:.0f} GB/s "
        f"({100 * gbps / cgbps:.0f}% of copy {cgbps:.0f} GB/s)"
    )
    return row


def run_timing(
    n: int,
    device: torch.device,
    rep_ms: int,
    bits_list: Sequence[int] = (2, 4, 8),
    bucket: int = 512,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    rotation: str | None = None,
    measured: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of encode, decode and dse per dtype and width, the torch reference's encode (4 bits,
    or the first width) and the copy of ``4 n`` bytes, all on ``n`` elements; ``rotation``
    ("hadamard"): the rotated kernels' rows too, beside the unrotated ones. ``measured`` is
    given the rows so far after each width (a run cut short still leaves them)."""
    from cgx2.codecs import maxmin_triton as tri  # Triton's: imported only when timed

    copy = CopyBaseline(device, rep_ms)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        x = make_input(n, dtype, device, 12345)
        elt = x.element_size()
        for bits in bits_list:
            payload = tri.encode(x, bits, bucket, KEY)
            p = MaxMinLayout(numel=n, bits=bits, bucket_size=bucket).nbytes
            whole = ChunkedLayout(
                numel=n,
                num_chunks=1,
                chunk_numel=n,
                bits=bits,
                bucket_size=bucket,
                skip_incomplete=False,
            )
            rows.append(
                timing_row(
                    "encode",
                    dtype,
                    bits,
                    n,
                    lambda x=x, w=whole, pl=payload: tri.encode_chunks(
                        x, w, KEY, out=pl.view(1, -1)
                    ),
                    n * elt,
                    p,
                    copy,
                    rep_ms,
                    bucket,
                )
            )
            rows.append(
                timing_row(
                    "decode",
                    dtype,
                    bits,
                    n,
                    lambda pl=payload, b=bits, d=dtype: tri.decode(pl, n, b, bucket, d),
                    p,
                    n * elt,
                    copy,
                    rep_ms,
                    bucket,
                )
            )
            # Stage 2 of the allreduce on one of K ranks: K rows of n/K values, own row in full
            # precision (the kernel does not read payload row own_index).
            cl = ChunkedLayout.split(n, K, bits, bucket, False)
            m, pm = cl.chunk_size(0), cl.chunk(0).nbytes
            chunks = tri.encode_chunks(x, cl, KEY)
            own = x[:m]
            out = torch.zeros(cl.payload_nbytes, dtype=torch.uint8, device=device)
            rows.append(
                timing_row(
                    f"dse(K={K})",
                    dtype,
                    bits,
                    m,
                    lambda ch=chunks, o=own, b=bits, m=m, out=out: tri.decode_sum_encode(
                        ch, m, o, 0, 0.25, b, bucket, KEY, 0, False, out
                    ),
                    (K - 1) * pm + m * elt,
                    pm,
                    copy,
                    rep_ms,
                    bucket,
                )
            )
            del payload, chunks, out
            if rotation is not None:
                rows += _rotated_rows(x, bits, bucket, rotation, copy, rep_ms)
            if measured is not None:
                measured(rows)
        del x
    ref_bits = 4 if 4 in bits_list else bits_list[0]
    x = make_input(n, torch.float32, device, 12345)
    p = MaxMinLayout(numel=n, bits=ref_bits, bucket_size=bucket).nbytes
    rows.append(
        timing_row(
            "torch_ref_enc",
            torch.float32,
            ref_bits,
            n,
            lambda x=x: ref.encode(x, ref_bits, bucket, KEY),
            n * 4,
            p,
            copy,
            rep_ms,
            bucket,
        )
    )
    del x
    s = n * 4
    cms = copy.ms(2 * s)
    rows.append(
        {
            "op": "copy",
            "dtype": "u8",
            "bits": 0,
            "bucket": 0,
            "numel": s,
            "ms": cms,
            "bytes_read": s,
            "bytes_written": s,
            "bytes_moved": 2 * s,
            "gbps": 2 * s / (cms * 1e-3) / 1e9,
            "copy_bytes": s,
            "copy_ms": cms,
            "copy_gbps": 2 * s / (cms * 1e-3) / 1e9,
            "frac_of_copy": 1.0,
        }
    )
    log(f"time copy of {s / 2**20:.0f} MiB: {cms:.3f} ms, {rows[-1]['gbps']:.0f} GB/s")
    return rows


def _rotated_rows(
    x: torch.Tensor, bits: int, bucket: int, name: str, copy: CopyBaseline, rep_ms: int
) -> list[dict[str, Any]]:
    """The rows of ``run_timing`` for the rotated kernels (``op`` ending in ``+rot``): the
    same calls with ``rotation`` (blocks of 128, a key that changes nothing in the cost)."""
    from cgx2.codecs import maxmin_triton as tri
    from cgx2.codecs.rotation import rotation_for

    rot = rotation_for(name, KEY ^ 0x5555)
    n, dtype, elt = x.numel(), x.dtype, x.element_size()
    whole = ChunkedLayout.split(n, 1, bits, bucket, False)
    payload = tri.encode(x, bits, bucket, KEY, rotation=rot)
    p = payload.numel()
    cl = ChunkedLayout.split(n, K, bits, bucket, False)
    m, pm = cl.chunk_size(0), cl.chunk(0).nbytes
    chunks = tri.encode_chunks(x, cl, KEY, rotation=rot)
    out = torch.zeros(cl.payload_nbytes, dtype=torch.uint8, device=x.device)
    calls = [
        (
            "encode+rot",
            n,
            n * elt,
            p,
            lambda: tri.encode_chunks(x, whole, KEY, out=payload.view(1, -1), rotation=rot),
        ),
        (
            "decode+rot",
            n,
            p,
            n * elt,
            lambda: tri.decode(payload, n, bits, bucket, dtype, rotation=rot),
        ),
        (
            f"dse+rot(K={K})",
            m,
            (K - 1) * pm + m * elt,
            pm,
            lambda: tri.decode_sum_encode(
                chunks, m, x[:m], 0, 0.25, bits, bucket, KEY, 0, False, out, rotation=rot
            ),
        ),
    ]
    return [
        timing_row(op, dtype, bits, numel, fn, read, written, copy, rep_ms, bucket)
        for op, numel, read, written, fn in calls
    ]


def format_timing(rows: list[dict[str, Any]]) -> str:
    """The table of ``run_timing``'s rows, with the conventions above it."""
    lines = [
        f"timing: n={rows[0]['numel']:,} (dse: {K} rows of n/{K}), bucket {rows[0]['bucket']}, "
        "median of do_bench; GB/s = (bytes read + bytes written) / time / 1e9 for kernels and "
        "copy; copy = dst.copy_(src) of (read+written)/2 bytes, same run",
        f"{'op':<14}{'dtype':<6}{'bits':>4}{'ms':>9}{'MB moved':>10}{'GB/s':>8}"
        f"{'copyGB/s':>10}{'%copy':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['op']:<14}{r['dtype']:<6}{r['bits']:>4}{r['ms']:>9.3f}"
            f"{r['bytes_moved'] / 1e6:>10.1f}{r['gbps']:>8.0f}{r['copy_gbps']:>10.0f}"
            f"{100 * r['frac_of_copy']:>6.0f}%"
        )
    ms = {(r["op"], r["dtype"], r["bits"]): r["ms"] for r in rows}
    for (op, dtype, bits), ref_ms in ms.items():
        if op == "torch_ref_enc" and ("encode", dtype, bits) in ms:
            speedup = ref_ms / ms[("encode", dtype, bits)]
            lines.append(
                f"triton encode {dtype} {bits}-bit: {speedup:.1f}x faster than the torch reference"
            )
        if op.endswith("+rot") or "+rot(" in op:
            plain = op.replace("+rot", "")
            if (plain, dtype, bits) in ms:
                lines.append(
                    f"{plain} {dtype} {bits}-bit rotated: {ms[(plain, dtype, bits)] / ref_ms:.0%} "
                    "of the unrotated kernel's speed (same run)"
                )
    return "\n".join(lines)


PROG = "python -m cgx2.bench kernels"
DESCRIPTION = """\
Times the max-min codec's Triton kernels (encode, decode, and the allreduce's fused
decode-sum-encode) on one GPU, against a device-to-device copy of as many bytes timed in the
same run; and the torch reference's encode. GB/s counts the bytes each kernel reads plus
those it writes. Needs Triton and a CUDA GPU (TRITON_INTERPRET=1 runs it on the CPU, where
the times mean nothing).
"""


def parse_count(text: str) -> int:
    """``"16M"`` -> 16777216 (K, M, G: 2**10, 2**20, 2**30); an ``ArgumentTypeError`` else."""
    value = parse_bytes(text)
    if not value:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive count (e.g. 65536, 16M)")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, DESCRIPTION)
    p.add_argument(
        "--numel",
        type=parse_count,
        default=None,
        help=f"elements timed; K, M, G mean 2^10, 2^20, 2^30 (default: 64M, or "
        f"{INTERPRET_NUMEL} under TRITON_INTERPRET=1)",
    )
    add_bits_argument(p)
    add_dtypes_argument(p)
    add_bucket_size_argument(p)
    p.add_argument(
        "--rotation",
        choices=["hadamard"],
        default=None,
        help="time the rotated kernels too (blocks of 128), beside the unrotated ones",
    )
    p.add_argument(
        "--rep-ms",
        type=int,
        default=200,
        help="milliseconds of repetitions per measurement (triton.testing.do_bench)",
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    args.bits = bit_widths(p, args.bits)
    args.dtypes = dtype_names(p, args.dtypes)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print(
            f"{PROG}: it times the Triton kernels, and Triton is not installed "
            "(pip install triton)",
            file=sys.stderr,
        )
        return 2
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print(
            f"{PROG}: no CUDA device is available; it times the Triton "
            "kernels on a GPU (set TRITON_INTERPRET=1 for a CPU smoke run, whose times mean "
            "nothing)",
            file=sys.stderr,
        )
        return 2
    if args.numel is None:
        args.numel = INTERPRET_NUMEL if interpret else M64
    env = environment(device)
    log(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}")
    log(f"timing on {args.numel:,} elements")

    def report(rows: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        return {
            "env": env,
            "args": vars(args),
            "conventions": CONVENTIONS,
            "complete": complete,
            "rows": rows,
        }

    rows = run_timing(
        args.numel,
        device,
        args.rep_ms,
        args.bits,
        args.bucket_size,
        [DTYPES[d] for d in args.dtypes],
        args.rotation,
        # The file is rewritten as rows come (complete: false until the end).
        measured=(lambda so_far: write_json("kernels", report(so_far, False), args.out))
        if args.out
        else None,
    )
    print(format_timing(rows))
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}")
    if args.out:
        print(f"results: {write_json('kernels', report(rows, True), args.out)}")
    return 0
