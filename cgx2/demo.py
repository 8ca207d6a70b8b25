"""CPU demo of cgx2: plain vs quantized allreduce over gloo, with bytes sent, error and timing.

Run ``python -m cgx2.demo --help``; it starts ``--world-size`` processes on this host, or, with
``--hosts N`` (root), one in each of N hosts joined by shaped links (:mod:`cgx2.testing.netlab`).
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
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cgx2
from cgx2.bench.report import (
    DEFAULT_OUT,
    SIZES_HELP,
    HelpFormatter,
    format_legend,
    parse_sizes,
    size_name,
)
from cgx2.codecs import ChunkedLayout, native
from cgx2.collectives import policy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUCKET_SIZE = 512
INPUT_SEED = 1234
MB = 1e6

CODECS = {
    True: "its CPU codec's C loops (cgx2.codecs.native)",
    False: "its CPU codec's torch code (no C compiler was found, or CGX2_NATIVE=0)",
}
TRANSPORTS = {
    "shm": "shared memory, as CGX_INNER_COMMUNICATOR_TYPE=SHM (the default) asks",
    "process_group": "gloo too",
}
EVEN = 0.1
"""Speedups within this fraction of 1 count as even: two runs of a row differ by about as much."""
MAX_ITERS = 100
"""The most timed iterations of a row, however short its calls."""
WINDOW_BYTES = 16 << 20
"""The bytes of tensor a timed sample allreduces, in calls back to back (:func:`_timed`): long
enough that the ranks' skew entering it and the scheduler's wake-ups weigh little. A count of
calls fixed by the size, not timed: gloo's first calls after the other's window are the
slowest (its threads wake), so a count that followed a first call's time would move the time
a call between runs."""
MAX_CALLS = 64
"""The most calls one timed sample holds."""
TRIM = 0.1
"""The fraction of a row's samples, fastest and slowest each, left out of its mean: a sample
another process slowed, or a lucky one, moves it little. A median would jump from one of a
call's speeds to the other where they are near even (gloo's: its threads wait for the
scheduler's tick in some windows more than in others)."""


def _speedup(row: dict[str, Any]) -> float:
    return row["plain_ms"] / row["cgx2_ms"]


def _rows_said(rows: list[dict[str, Any]]) -> str:
    """``1M at 2 bits 1.53x, 4M at 4 bits 3.65x``."""
    return ", ".join(f"{r['size']} at {r['bits']} bits {_speedup(r):.2f}x" for r in rows)


def format_verdict(rows: list[dict[str, Any]], native_codec: bool, transport: str) -> str:
    """The closing lines, read from ``rows`` as measured: where cgx2 was faster than gloo,
    where slower, where even, and why in one sentence."""
    won = [r for r in rows if _speedup(r) > 1 + EVEN]
    lost = [r for r in rows if _speedup(r) < 1 - EVEN]
    even = [r for r in rows if r not in won and r not in lost]
    findings = [f"faster than gloo in {len(won) or 'none'} of the {len(rows)} rows"]
    if won:
        findings[0] += f" ({_rows_said(won)})"
    if lost:
        findings.append(f"slower in {len(lost)} ({_rows_said(lost)})")
    if even:
        findings.append(f"even, within {EVEN:.0%}, in {len(even)} ({_rows_said(even)})")
    ratios = [r["compression_ratio"] for r in rows]
    lo, hi = f"{min(ratios):.1f}x", f"{max(ratios):.1f}x"
    more = lo if lo == hi else f"{lo} to {hi}"
    carried = TRANSPORTS.get(transport, transport)
    why = (
        "Why: on one host no network limits either call, so each row weighs cgx2's coding on "
        f"the CPU, with {CODECS[native_codec]}, against gloo's copying of {more} as many bytes "
        f"through loopback TCP (cgx2 moved its own through {carried}): cgx2 wins where those "
        "copies cost more than its coding, and loses where they do not."
    )
    network = (
        "On a real network the sent-bytes columns decide instead, since an allreduce there is "
        "limited by its bytes (python -m cgx2.demo --hosts 2 --link 1gbit, as root, shapes "
        "one); the error columns are the price paid for them."
    )
    return "\n".join(
        textwrap.fill(text, 100, break_on_hyphens=False)
        for text in ("Measured here, cgx2 was " + "; ".join(findings) + ".", why, network)
    )


def format_error_note(rows: list[dict[str, Any]]) -> str:
    """What the error columns mean, at the fewest bits measured: a rel. error above 1 is an
    error larger than the sum itself, and why so few bits are that coarse."""
    fewest = min(r["bits"] for r in rows)
    at = [r for r in rows if r["bits"] == fewest]
    worst = max(r["rel_error"] for r in at)
    spread = statistics.mean(r["bucket_range_sd"] for r in at)
    step = spread / (2**fewest - 1)
    levels = 2**fewest
    if worst > 1:
        meaning = (
            f"At {fewest} bits the rel. error is {worst:.2f}: the error is larger than the exact "
            "sum itself, so one call's result is mostly rounding noise."
        )
    else:
        meaning = (
            f"At {fewest} bits the rel. error is {worst:.2f}: the error's norm is "
            f"{worst:.0%} of the exact sum's."
        )
    why = (
        f"{fewest} bits give {levels} levels per bucket of {BUCKET_SIZE} values, so a level's "
        f"step is 1/{levels - 1} of the bucket's range, here {step:.1f} standard deviations of "
        "the values, and stochastic rounding moves each value by up to a step (the result is "
        "quantized twice: each rank's chunks, then their sum). The rounding is unbiased, so the "
        "error averages out over training steps (cgx2.ddp's hooks can also feed it back: "
        "error_feedback=True), but where one call must be close, use more bits: each bit "
        "halves the step."
    )
    return textwrap.fill(f"{meaning} {why}", 100, break_on_hyphens=False)


@dataclass
class Row:
    """One (size, bits) measurement, as rank 0 saw it."""

    size: str
    bytes: int
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
    iters: int
    bucket_range_sd: float
    transport: str


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


def _timed(
    fns: list[Any], calls: int, iters: int, seconds: float
) -> tuple[list[float], int, list[Any]]:
    """Wall time (ms) of a call of each of ``fns``, the slowest rank's, after one untimed
    warm-up call each. A timed sample is a window of ``calls`` calls back to back, divided by
    them; the windows of ``fns`` are taken in turn (a, b, a, b, ...: drift cannot favour one),
    each round started by one collective that aligns the ranks and says whether to go on. At
    least ``iters`` rounds, and more until ``seconds`` have passed on rank 0 (up to
    :data:`MAX_ITERS`). A call's time is the trimmed mean of its samples
    (:func:`trimmed_mean`). Returns the times, the samples and the last results."""
    outs = [fn() for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    stop = torch.zeros(1, dtype=torch.uint8)
    while True:
        n = len(times[0])
        stop.fill_(n >= iters and (n >= MAX_ITERS or time.perf_counter() - start >= seconds))
        dist.broadcast(stop, 0)  # rank 0's clock decides: every rank runs as many rounds
        if stop.item():
            break
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                outs[i] = fn()
            times[i].append((time.perf_counter() - t0) / calls)
    means = torch.tensor([trimmed_mean(t) for t in times], dtype=torch.float64)
    dist.all_reduce(means, op=dist.ReduceOp.MAX)
    return [1e3 * m for m in means.tolist()], len(times[0]), outs


def calls_a_window(nbytes: int) -> int:
    """The calls of a timed sample of a tensor of ``nbytes``: :data:`WINDOW_BYTES` of it, at
    least one call and at most :data:`MAX_CALLS`."""
    return max(1, min(MAX_CALLS, round(WINDOW_BYTES / nbytes)))


def trimmed_mean(samples: list[float]) -> float:
    """The mean of ``samples`` less the :data:`TRIM` fastest and slowest of them."""
    cut = int(len(samples) * TRIM)
    return statistics.mean(sorted(samples)[cut : len(samples) - cut])


def _bit_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _bucket_range_sd(x: torch.Tensor) -> float:
    """The mean range of ``x``'s buckets in standard deviations of its values: what one
    quantization step is a fraction of."""
    whole = x.numel() // BUCKET_SIZE * BUCKET_SIZE
    buckets = x[:whole].float().view(-1, BUCKET_SIZE)
    spread = (buckets.amax(1) - buckets.amin(1)).mean()
    return (spread / x.float().std()).item()


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[Row]:
    dtype = DTYPES[args.dtype]
    group = dist.group.WORLD
    rows = []
    for nbytes in args.sizes:
        numel = nbytes // dtype.itemsize
        gen = torch.Generator().manual_seed(INPUT_SEED + rank)
        x = torch.randn(numel, generator=gen).to(dtype)
        exact = x.double()
        dist.all_reduce(exact)  # fp64 sum of the inputs as given: the reference
        for bits in args.bits:
            if rank == 0:
                print(f"size {size_name(nbytes)} bits {bits} ...", file=sys.stderr, flush=True)
            route = policy.route(x, group, bits, BUCKET_SIZE)
            transport = route.transport.__name__.rsplit(".", 1)[-1]

            # Both in place on a copy of x made into a buffer of their own: the same copy each,
            # and no fresh memory a call (whose page faults come and go with the allocator).
            plain_buf, cgx2_buf = torch.empty_like(x), torch.empty_like(x)

            def plain(x: torch.Tensor = x, buf: torch.Tensor = plain_buf) -> None:
                dist.all_reduce(buf.copy_(x))

            def quantized(
                x: torch.Tensor = x, buf: torch.Tensor = cgx2_buf, bits: int = bits
            ) -> torch.Tensor:
                return cgx2.quantized_allreduce_(buf.copy_(x), bits=bits, bucket_size=BUCKET_SIZE)

            timed = _timed([plain, quantized], calls_a_window(nbytes), args.iters, args.seconds)
            (plain_ms, cgx2_ms), iters, (_, out) = timed
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out)
            identical = all(torch.equal(_bit_view(g), _bit_view(out)) for g in gathered)
            err = out.double() - exact
            plain_b, cgx2_b = sent_bytes(numel, x.element_size(), bits, world)
            rows.append(
                Row(
                    size=size_name(nbytes),
                    bytes=nbytes,
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
                    iters=iters,
                    bucket_range_sd=_bucket_range_sd(x),
                    transport=transport if route.compress else "plain",
                )
            )
    return rows


def rank_cores(rank: int, world: int, cores: list[int]) -> list[int]:
    """The cores ``rank`` keeps to: its own share of ``cores``, none of another rank's, where
    each rank can have one (else none: it goes where the scheduler puts it). Where the ranks'
    threads may meet on a core in one run and not in the next, cgx2's times differ between
    the runs more than between their samples."""
    share = len(cores) // world
    return cores[rank * share : (rank + 1) * share]


def _worker(
    rank: int,
    world: int,
    port: int,
    args: argparse.Namespace,
    results: Any,
    address: str = "127.0.0.1",
) -> None:
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    # Share the cores between the ranks instead of oversubscribing them.
    cores = rank_cores(rank, world, sorted(os.sched_getaffinity(0)))
    if cores:
        os.sched_setaffinity(0, cores)  # the threads gloo and cgx2 start inherit it
    torch.set_num_threads(max(1, len(cores)))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        cgx2.manual_seed(0)  # every rank draws the same call seeds: reproducible bytes
        rows = _measure(rank, world, args)
        dist.barrier()
        if rank == 0:
            results.put({"rows": [asdict(r) for r in rows], "native_codec": _native_codec()})
    finally:
        dist.destroy_process_group()


class _ResultFile:
    """Where the rank 0 of ``--hosts`` puts its results: a file its parent reads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def put(self, found: dict[str, Any]) -> None:
        Path(self.path).write_text(json.dumps(found))


def _in_host(args: argparse.Namespace) -> int:
    """One rank of a ``--hosts`` run, inside its host (the lab's variables name it)."""
    _worker(
        int(os.environ["HOST"]),
        int(os.environ["NHOSTS"]),
        int(os.environ["MASTER_PORT"]),
        args,
        _ResultFile(args.in_host),
        os.environ["MASTER_ADDR"],
    )
    return 0


def _across_hosts(args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank 0's results of one rank in each of ``args.hosts`` hosts joined by ``args.link``
    links; None (said why) where it cannot run or a rank failed."""
    from cgx2.testing import netlab

    reason = netlab.unavailable()
    if reason:
        print(
            f"cgx2 demo: --hosts makes hosts of Linux network namespaces joined by links "
            f"shaped with tc, which needs root and iproute2 (ip, tc); here: {reason}. "
            "Without --hosts the demo runs on this host.",
            file=sys.stderr,
        )
        return None
    sizes = ",".join(str(n) for n in args.sizes)
    bits = ",".join(str(b) for b in args.bits)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        command = [
            sys.executable,
            "-m",
            "cgx2.demo",
            "--in-host",
            out,
            "--sizes",
            sizes,
            "--bits",
            bits,
            "--dtype",
            args.dtype,
            "--iters",
            str(args.iters),
            "--seconds",
            str(args.seconds),
        ]
        env = {**os.environ, "MASTER_PORT": str(free_port())}
        with netlab.Lab(hosts=args.hosts, link=netlab.Link(rate=args.link)) as lab:
            done = lab.run(command, env=env, timeout=3600)
        failed = [(i, r) for i, r in enumerate(done) if r.returncode != 0]
        if failed or not os.path.exists(out):
            host, result = failed[0] if failed else (0, done[0])
            print(
                f"cgx2 demo: host {host} failed (exit {result.returncode}):\n"
                f"{result.stderr[-3000:]}",
                file=sys.stderr,
            )
            return None
        return json.loads(Path(out).read_text())


def format_link_note(rows: list[dict[str, Any]], hosts: int, link: str) -> str:
    """What the link saved: each size and width, gloo's time against cgx2's."""
    lines = [
        f"{hosts} hosts (network namespaces on this machine), one rank each, each host's "
        f"link shaped to {link} each way; the ranks share this machine's cores for the "
        "coding. Time saved over the link:"
    ]
    for r in rows:
        saved = r["plain_ms"] - r["cgx2_ms"]
        lines.append(
            f"  {r['size']:>5} at {r['bits']} bits: gloo {r['plain_ms']:.1f} ms, cgx2 "
            f"{r['cgx2_ms']:.1f} ms: {saved:.1f} ms {'saved' if saved >= 0 else 'lost'} "
            f"({r['plain_ms'] / r['cgx2_ms']:.2f}x)"
        )
    return "\n".join(lines)


def _iters_said(args: argparse.Namespace) -> str:
    more = f" (more within {args.seconds:g} s a row)" if args.seconds else ""
    return f"at least {args.iters} timed iterations{more}"


def _iters_range(rows: list[dict[str, Any]]) -> str:
    lo, hi = min(r["iters"] for r in rows), max(r["iters"] for r in rows)
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _native_codec() -> bool:
    """Whether this process encodes CPU tensors with the codec's C loops (else in torch)."""
    return native.library() is not None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLUMNS = [
    ("size", "the tensor's size in bytes (K, M, G: KiB, MiB, GiB)"),
    ("bits", "bits per value that cgx2 sends"),
    (
        "gloo ms",
        "gloo's own allreduce of the tensor (torch.distributed.all_reduce), in place on a copy",
    ),
    ("cgx2 ms", "cgx2.quantized_allreduce_ of the tensor, in place on a copy as gloo's"),
    ("speedup vs gloo", "gloo ms / cgx2 ms: above 1, cgx2 is faster"),
    (
        "sent MB gloo",
        "bytes one rank sends in gloo's ring allreduce, 2(W-1)/W of the tensor "
        "for W ranks (MB = 1e6 bytes)",
    ),
    (
        "sent MB cgx2",
        "bytes one rank sends in cgx2's all_to_all and all_gather of the compressed chunks",
    ),
    ("sent less", "sent MB gloo / sent MB cgx2"),
    ("max abs err", "the largest error of cgx2's result against the exact sum (in fp64)"),
    ("rel. error", "the error's norm over the exact sum's norm"),
    ("identical on all ranks", "whether every rank got the same bits"),
]


def format_table(rows: list[dict[str, Any]]) -> str:
    header = tuple(name for name, _ in COLUMNS)
    body = [
        (
            r["size"],
            str(r["bits"]),
            f"{r['plain_ms']:.2f}",
            f"{r['cgx2_ms']:.2f}",
            f"{r['plain_ms'] / r['cgx2_ms']:.2f}",
            f"{r['sent_bytes_plain'] / MB:.3f}",
            f"{r['sent_bytes_cgx2'] / MB:.3f}",
            f"{r['compression_ratio']:.2f}x",
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


DESCRIPTION = """\
Compares gloo's plain allreduce with cgx2's quantized allreduce on this host's CPU: it starts
--world-size processes, allreduces random tensors of each size both ways, and prints the time
each took, the bytes each sends, and the error that quantizing costs. No GPU, Triton or
torchrun is needed:

  python -m cgx2.demo
  python -m cgx2.demo --sizes 64M --bits 4 --world-size 4
  python -m cgx2.demo --hosts 2 --link 1gbit   (root: two hosts joined by 1 Gbit/s links)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx2.demo", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2, help="processes to start")
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default="1M,4M,16M",
        help=f"tensor sizes, comma-separated, in {SIZES_HELP}",
    )
    p.add_argument(
        "--bits", type=parse_bits, default="2,4,8", help="bits per value, comma-separated, 1 to 8"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the tensors' dtype")
    p.add_argument(
        "--iters",
        type=int,
        default=7,
        help="timed iterations of each call at least, after 1 warm-up; more where they fit in "
        f"--seconds (their mean, less the fastest and slowest {100 * TRIM:.0f}%%, is taken)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="time to spend on each row's timed iterations, gloo's and cgx2's taken in turn "
        f"(at most {MAX_ITERS} iterations; 0: exactly --iters)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=DEFAULT_OUT,
        help="directory for the JSON results, created if missing; '' writes none",
    )
    p.add_argument("--json", metavar="FILE", help="write the JSON results to this file instead")
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run one rank in each of this many hosts (network namespaces) joined "
        "by --link links instead (root, iproute2)",
    )
    p.add_argument("--link", default="1gbit", help="with --hosts: each link's rate (tc's units)")
    p.add_argument("--in-host", help=argparse.SUPPRESS)  # a --hosts rank: where to put results
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.seconds < 0:
        parser.error("--seconds must be at least 0")
    itemsize = DTYPES[args.dtype].itemsize
    for nbytes in args.sizes:
        if nbytes % itemsize:
            parser.error(f"--sizes: {nbytes} bytes is not a whole number of {args.dtype} values")

    if args.in_host:
        return _in_host(args)
    if args.hosts:
        if args.hosts < 2:
            parser.error("--hosts must be at least 2")
        print(
            f"cgx2 demo: {args.hosts} hosts joined by {args.link} links, one rank each, "
            f"gloo, {args.dtype}, {_iters_said(args)} after 1 warm-up",
            file=sys.stderr,
            flush=True,
        )
        found = _across_hosts(args)
        if found is None:
            return 2
        world = args.hosts
    else:
        found = _on_this_host(args)
        if found is None:
            return 1
        world = args.world_size
    rows = found["rows"]

    ranks = f"{world} hosts joined by {args.link} links" if args.hosts else f"{world} ranks"
    title = (
        f"cgx2 quantized allreduce vs plain allreduce: {ranks}, gloo, {args.dtype}, bucket "
        f"{BUCKET_SIZE}, the slowest rank's mean of {_iters_range(rows)} samples less the "
        f"fastest and slowest {TRIM:.0%} (each {size_name(WINDOW_BYTES)} of tensor allreduced "
        "in calls back to back, or one call), gloo's and cgx2's in turn"
    )
    print(textwrap.fill(title, 100) + "\n")
    print(format_table(rows))
    print("\nColumns:")
    print(format_legend(COLUMNS))
    print()
    if args.hosts:
        print(format_link_note(rows, args.hosts, args.link))
    else:
        print(format_verdict(rows, found["native_codec"], rows[0]["transport"]))
    print()
    print(format_error_note(rows))

    if args.json or args.out:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cgx2": cgx2.__version__,
            "world_size": world,
            "hosts": args.hosts or None,
            "link": args.link if args.hosts else None,
            "dtype": args.dtype,
            "bucket_size": BUCKET_SIZE,
            "iters": args.iters,
            "seconds": args.seconds,
            "native_codec": found["native_codec"],
            "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
            "rows": rows,
        }
        if args.json:
            path = Path(args.json)
        else:
            stamp = report["date"].replace(":", "").replace("-", "")[:15]
            tag = f"h{args.hosts}_{args.link}" if args.hosts else f"w{world}"
            path = Path(args.out) / f"demo_cpu_{tag}_{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nresults: {path}")

    if not all(r["identical"] for r in rows):
        print("cgx2 demo: results were NOT identical on all ranks", file=sys.stderr)
        return 1
    return 0


def _on_this_host(args: argparse.Namespace) -> dict[str, Any] | None:
    """Rank 0's results of ``args.world_size`` processes on this host; None (said why) if a
    worker failed."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    print(
        f"cgx2 demo: {args.world_size} ranks, gloo on 127.0.0.1, {args.dtype}, "
        f"{_iters_said(args)} after 1 warm-up",
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
        return None
    if results.empty():
        print("cgx2 demo: rank 0 returned no results", file=sys.stderr)
        return None
    return results.get()


if __name__ == "__main__":
    sys.exit(main())
