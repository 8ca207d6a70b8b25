"""CPU demo of cgx2: plain vs quantized allreduce over gloo, with bytes sent, error and timing.

Run ``python -m cgx2.demo --help``; it starts ``--world-size`` processes on this host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cgx2
from cgx2.codecs import ChunkedLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUCKET_SIZE = 512
INPUT_SEED = 1234
MB = 1e6

NOTE = (
    "Note: all ranks run on one CPU host, so gloo moves bytes over loopback, which is not "
    "bandwidth-bound, and cgx2 uses its torch reference codec on the CPU (the Triton kernels "
    "are for GPUs). The time columns therefore do not show where cgx2 wins: here it took "
    "{slow} the time of the plain allreduce. The sent-bytes columns are what it saves on a real "
    "network, where an allreduce is limited by those bytes; the error column is the price paid "
    "for them."
)


def format_note(rows: list[dict[str, Any]]) -> str:
    """The closing note, with the measured range of cgx2 time / plain time."""
    ratios = [r["cgx2_ms"] / r["plain_ms"] for r in rows if r["plain_ms"] > 0]
    lo, hi = (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))
    slow = f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}x to {hi:.1f}x"
    return NOTE.format(slow=slow)


@dataclass
class Row:
    """One (size, bits) measurement, as rank 0 saw it."""

    size: str
    numel: int
    dtype: str
    bits: int
    plain_ms: float
    cgx2_ms: float
    sent_bytes_plain: int
    sent_bytes_cgx2: int
    compression_ratio: float
    max_abs_error: float
    rel_error: float
    identical: bool


def parse_size(text: str) -> int:
    """``"256K"`` -> 262144, ``"4M"`` -> 4194304, ``"1000"`` -> 1000 (K and M are binary)."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    try:
        n = int(digits) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 65536, 64K, 4M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def size_label(n: int) -> str:
    for suffix, mult in (("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def parse_bits(text: str) -> list[int]:
    try:
        bits = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad bits list {text!r} (use e.g. 2,4,8)") from None
    if not bits or any(not 1 <= b <= 8 for b in bits):
        raise argparse.ArgumentTypeError(f"bits must be in 1..8, got {text!r}")
    return bits


def sent_bytes(numel: int, elem_size: int, bits: int, world: int) -> tuple[int, int]:
    """Bytes one rank sends: ring allreduce of the tensor vs cgx2's all_to_all + all_gather."""
    plain = 2 * (world - 1) * numel * elem_size // world
    payload = ChunkedLayout.split(numel, world, bits, BUCKET_SIZE, False).payload_nbytes
    return plain, 2 * (world - 1) * payload


def _timed(fn: Any, iters: int) -> tuple[float, Any]:
    """Median wall time (ms) of ``fn()`` over ``iters`` calls, each started after a barrier,
    after one untimed warm-up call; returns it with the last result."""
    out = fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), out


def _bit_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[Row]:
    dtype = DTYPES[args.dtype]
    rows = []
    for numel in args.sizes:
        gen = torch.Generator().manual_seed(INPUT_SEED + rank)
        x = torch.randn(numel, generator=gen).to(dtype)
        exact = x.double()
        dist.all_reduce(exact)  # fp64 sum of the inputs as given: the reference
        plain_ms, _ = _timed(lambda x=x: dist.all_reduce(x.clone()), args.iters)
        for bits in args.bits:
            if rank == 0:
                print(f"size {size_label(numel)} bits {bits} ...", file=sys.stderr, flush=True)
            cgx2_ms, out = _timed(
                lambda x=x, b=bits: cgx2.quantized_allreduce(x, bits=b, bucket_size=BUCKET_SIZE),
                args.iters,
            )
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out)
            identical = all(torch.equal(_bit_view(g), _bit_view(out)) for g in gathered)
            err = out.double() - exact
            plain_b, cgx2_b = sent_bytes(numel, x.element_size(), bits, world)
            rows.append(
                Row(
                    size=size_label(numel),
                    numel=numel,
                    dtype=args.dtype,
                    bits=bits,
                    plain_ms=plain_ms,
                    cgx2_ms=cgx2_ms,
                    sent_bytes_plain=plain_b,
                    sent_bytes_cgx2=cgx2_b,
                    compression_ratio=plain_b / cgx2_b,
                    max_abs_error=err.abs().max().item(),
                    rel_error=(err.norm() / exact.norm()).item(),
                    identical=identical,
                )
            )
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Share the cores between the ranks instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        cgx2.manual_seed(0)  # every rank draws the same call seeds: reproducible bytes
        rows = _measure(rank, world, args)
        dist.barrier()
        if rank == 0:
            results.put([asdict(r) for r in rows])
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "size",
        "bits",
        "plain ms",
        "cgx2 ms",
        "sent MB plain",
        "sent MB cgx2",
        "saved (x)",
        "max abs err",
        "rel. error",
        "identical on all ranks",
    )
    body = [
        (
            r["size"],
            str(r["bits"]),
            f"{r['plain_ms']:.2f}",
            f"{r['cgx2_ms']:.2f}",
            f"{r['sent_bytes_plain'] / MB:.3f}",
            f"{r['sent_bytes_cgx2'] / MB:.3f}",
            f"{r['compression_ratio']:.2f}",
            f"{r['max_abs_error']:.3g}",
            f"{r['rel_error']:.4f}",
            "yes" if r["identical"] else "NO",
        )
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in (header, *body)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx2.demo",
        description="Compare plain and cgx2 quantized allreduce over gloo on this host (CPU).",
    )
    p.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("256K,1M,4M"),
        help="tensor sizes in elements, K/M = 2^10/2^20 (default 256K,1M,4M)",
    )
    p.add_argument("--bits", type=parse_bits, default=[2, 4, 8], help="default 2,4,8")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="default fp32")
    p.add_argument("--iters", type=int, default=3, help="timed iterations after 1 warm-up")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world_size < 2:
        print("--world-size must be at least 2", file=sys.stderr)
        return 2
    if args.iters < 1:
        print("--iters must be at least 1", file=sys.stderr)
        return 2

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    print(
        f"cgx2 demo: {args.world_size} ranks, gloo on 127.0.0.1, {args.dtype}, "
        f"{args.iters} timed iters after 1 warm-up",
        file=sys.stderr,
        flush=True,
    )
    procs = mp.start_processes(
        _worker,
        args=(args.world_size, free_port(), args, results),
        nprocs=args.world_size,
        join=False,
        start_method="spawn",
    )
    try:
        while not procs.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # join() has already terminated the other workers.
        print(f"cgx2 demo: a worker failed: {e}", file=sys.stderr)
        return 1
    if results.empty():
        print("cgx2 demo: rank 0 returned no results", file=sys.stderr)
        return 1
    rows = results.get()

    print(
        f"cgx2 quantized allreduce vs plain allreduce: {args.world_size} ranks, gloo, "
        f"{args.dtype}, bucket {BUCKET_SIZE}, median of {args.iters}; "
        f"bytes sent per rank (MB = 1e6 bytes)\n"
    )
    print(format_table(rows))
    print()
    print(format_note(rows))

    if args.json:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cgx2": cgx2.__version__,
            "world_size": args.world_size,
            "dtype": args.dtype,
            "bucket_size": BUCKET_SIZE,
            "iters": args.iters,
            "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")

    if not all(r["identical"] for r in rows):
        print("cgx2 demo: results were NOT identical on all ranks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
