"""nccl-tests-style benchmark: cgx2's quantized allreduce against the process group's own,
the cast to bf16 and the speed of light, per size, dtype and bits; ``python -m cgx2.bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives, comm, config
from cgx2.codecs import ChunkedLayout
from cgx2.collectives import graphs, policy

from .report import (
    DTYPES,
    Progress,
    add_bits_argument,
    add_bucket_size_argument,
    add_choice,
    add_dtypes_argument,
    add_out_argument,
    add_repeat_arguments,
    add_sizes_argument,
    bit_widths,
    dtype_names,
    environment,
    format_columns,
    matplotlib_missing,
    parser,
    size_name,
    started,
    write_json,
)

__all__ = ["main", "parse_args"]

PROG = "python -m cgx2.bench"
DESCRIPTION = """\
Times cgx2's quantized allreduce against the process group's own allreduce (NCCL on GPUs,
gloo on CPUs), in one run, per tensor size, dtype and bits: the numbers nccl-tests would
give, plus how close cgx2 gets to the speed of light of its own algorithm. Run it with
several processes:

  torchrun --nproc-per-node 4 -m cgx2.bench --bits 4

Rank 0 prints a table, a legend of its columns, and the path of the JSON file it wrote.

Other benchmarks:
  python -m cgx2.bench kernels --help     the codec's GPU kernels against a device copy
  python -m cgx2.bench calibrate --help   measure where compression pays on this machine
  python -m cgx2.bench plot --help        draw saved results as a PNG (as --plot does)
"""

BACKEND_NAMES = {"nccl": "NCCL"}
"""How the table names a backend (``dist.get_backend``'s name otherwise)."""


class Timer:
    """Median time of ``fn`` over ``iters`` windows after ``warmup``, each started together on
    all ranks (barrier), timed with CUDA events on GPUs; the slowest rank's median is returned.

    A window holds ``calls`` calls of ``fn``, and its time is their mean. One call a window
    times a call from an idle GPU: its latency, the host's work before its first launch
    included. Several are launched back to back, as nccl-tests does, so that the host's work
    for one call overlaps the GPU's for the one before, as in training, where the allreduce is
    enqueued behind the backward's kernels."""

    def __init__(self, device: torch.device, warmup: int, iters: int, calls: int = 1) -> None:
        if calls < 1:
            raise ValueError(f"calls={calls}: a window needs at least one call")
        self.device, self.warmup, self.iters, self.calls = device, warmup, iters, calls

    def _once(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            dist.barrier()
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / self.calls
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / self.calls

    def __call__(self, fn: Callable[[], Any]) -> float:
        (ms,) = self.interleaved(fn)
        return ms

    def interleaved(self, *fns: Callable[[], Any]) -> list[float]:
        """Each function's time, the calls taken in turn (a, b, a, b, ...), so that clock and
        cache drift between them cannot favour one: for ratios of near-equal times."""
        for _ in range(self.warmup):
            for fn in fns:
                self._once(fn)
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(self.iters):
            for fn, out in zip(fns, times, strict=True):
                out.append(self._once(fn))
        medians = torch.tensor(
            [statistics.median(t) for t in times], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
        return medians.tolist()


def _busbw(nbytes: int, ms: float, world: int) -> float:
    """nccl-tests' allreduce bus bandwidth, GB/s."""
    return nbytes / (ms * 1e-3) / 1e9 * 2 * (world - 1) / world


def _bench_size(
    timer: Timer,
    nbytes: int,
    dtype_name: str,
    args: argparse.Namespace,
    device: torch.device,
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[dtype_name]
    n = nbytes // dtype.itemsize
    x = torch.randn(n, device=device, dtype=torch.float32).to(dtype)
    buf = x.clone()
    # NCCL averages natively; gloo only sums (values then grow, which does not change speed).
    plain_op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
    plain_ms = timer(lambda: dist.all_reduce(buf, op=plain_op))

    def cast() -> None:
        y = x.to(torch.bfloat16)
        dist.all_reduce(y, op=plain_op)
        y.to(torch.float32)

    cast_ms = timer(cast) if dtype == torch.float32 else None
    rows = []
    for bits in args.bits:
        if rank == 0:
            progress(f"{dtype_name} {size_name(nbytes)} {bits}-bit")
        layout = ChunkedLayout.split(n, world, bits, args.bucket_size, False)
        send = torch.randint(
            0, 255, (world, layout.payload_nbytes), dtype=torch.uint8, device=device
        )
        recv = torch.empty_like(send)
        gathered = torch.empty(world * layout.payload_nbytes, dtype=torch.uint8, device=device)

        # The route the timed quantized call takes (cgx2_ms): the light goes the same way,
        # through the same transport, or it could be slower than the call it bounds.
        with config.tuned(crossover_bytes=0, cuda_graphs=False):
            route = policy.route(x, dist.group.WORLD, bits, args.bucket_size)
        # Gathering all, no chunks are swapped: no all_to_all to stand in for.
        pair_gather, transport = route.pair_gather and not route.gather_all, route.transport

        if route.gather_all:  # one all-gather of every rank's whole payload stands for both
            whole = ChunkedLayout.split(n, 1, bits, args.bucket_size, False).payload_nbytes
            gathered = torch.empty(world * whole, dtype=torch.uint8, device=device)

        def speed_of_light(
            send=send, recv=recv, gathered=gathered, pair=pair_gather, route=route
        ) -> None:
            # The collectives the pipeline itself calls, through its transport, each once on
            # the whole payload; pair=False: all_to_all + all_gather, whatever the world size.
            group, route_transport = dist.group.WORLD, route.transport
            if route.gather_all:
                mine = gathered.view(world, -1)[rank]
                route_transport.wait(route_transport.all_gather(gathered, mine, group, False))
                return
            route_transport.wait(
                collectives.exchange(
                    recv, send, group, world, rank, pair, async_op=False, transport=route_transport
                )
            )
            # In place where the pipeline gathers in place (NCCL: its own slot as the input).
            slot = gathered.view(world, -1)[rank] if route.gather_in_place else recv[0]
            route_transport.wait(route_transport.all_gather(gathered, slot, group, async_op=False))

        def quantized(bits: int = bits) -> None:
            cgx2.quantized_allreduce(x, bits, op="avg", bucket_size=args.bucket_size)

        shm_ms = shm_plain_ms = None
        if args.shm:  # the same calls with shared memory moving the bytes
            with config.tuned(crossover_bytes=0, transport="shm"):
                shm_ms = timer(quantized)
            op = "avg" if plain_op == dist.ReduceOp.AVG else "sum"
            shm_plain_ms = timer(lambda op=op: comm.shm.allreduce_plain_(buf, dist.group.WORLD, op))
        sol_ms = timer(speed_of_light)
        sol_a2a_ms = timer(lambda: speed_of_light(pair=False)) if pair_gather else sol_ms
        # Always quantize, launching eagerly: what the codec and pipeline cost.
        with config.tuned(crossover_bytes=0, cuda_graphs=False):
            cgx_ms = timer(quantized)
            hier_ms = None
            if args.hierarchical:
                hier_ms = timer(
                    lambda bits=bits: cgx2.hierarchical_allreduce(
                        x, bits, args.mesh, op="sum", bucket_size=args.bucket_size
                    )
                )
            graphs_ms = None
        if args.cuda_graphs:
            with config.tuned(crossover_bytes=0), _graphs_on():
                graphs_ms = timer(quantized)
        auto_buf = x.clone()

        def auto(bits: int = bits, buf: torch.Tensor = auto_buf) -> None:
            cgx2.quantized_allreduce_(buf, bits, op="avg", bucket_size=args.bucket_size)

        def plain_avg(buf: torch.Tensor = auto_buf) -> None:
            # The average auto computes, as DDP's own hook does: where the backend has no AVG
            # (gloo), a sum and a division.
            dist.all_reduce(buf, op=plain_op)
            if plain_op != dist.ReduceOp.AVG:
                buf.div_(world)

        # In place, as the hook and backend use it (plain below the crossover): timed in turn
        # with the backend's average, since below the crossover the two differ by microseconds.
        plain_paired_ms, auto_ms = timer.interleaved(plain_avg, auto)
        graphs.clear()  # those auto replayed (CGX2_CUDA_GRAPHS=auto), before the next size
        auto_path = _path(auto_buf, bits, args)
        graphs_auto_path = graphs_plain_paired_ms = graphs_auto_ms = None
        if args.cuda_graphs:  # in place with graphs, plain below the graphs' crossover
            with _graphs_on():
                graphs_auto_path = _path(auto_buf, bits, args)
                graphs_plain_paired_ms, graphs_auto_ms = timer.interleaved(plain_avg, auto)
        rows.append(
            {
                "dtype": dtype_name,
                "bytes": nbytes,
                "size": size_name(nbytes),
                "numel": n,
                "bits": bits,
                "bucket_size": args.bucket_size,
                "payload_bytes_per_rank": layout.payload_nbytes,
                "plain_ms": plain_ms,
                "plain_busbw": _busbw(nbytes, plain_ms, world),
                "cgx2_ms": cgx_ms,
                "cgx2_busbw": _busbw(nbytes, cgx_ms, world),
                "cast_bf16_ms": cast_ms,
                "sol_ms": sol_ms,
                "sol_all_to_all_ms": sol_a2a_ms,
                "transport": _name(transport),
                "pair_gather": pair_gather,
                "gather_all": route.gather_all,
                "auto_ms": auto_ms,
                "auto_path": auto_path,
                "auto_crossover_bytes": policy.crossover_bytes(device, dtype, dist.group.WORLD),
                "plain_paired_ms": plain_paired_ms,
                "auto_vs_plain": plain_paired_ms / auto_ms,
                "speedup_vs_plain": plain_ms / cgx_ms,
                "fraction_of_sol": sol_ms / cgx_ms,
                "cast_speedup_vs_plain": None if cast_ms is None else plain_ms / cast_ms,
                "cgx2_shm_ms": shm_ms,
                "shm_plain_ms": shm_plain_ms,
                "shm_plain_speedup": None if shm_plain_ms is None else plain_ms / shm_plain_ms,
                "hier_ms": hier_ms,
                "hier_vs_flat": None if hier_ms is None else cgx_ms / hier_ms,
                "cgx2_graphs_ms": graphs_ms,
                "graphs_speedup_vs_plain": None if graphs_ms is None else plain_ms / graphs_ms,
                "graphs_fraction_of_sol": None if graphs_ms is None else sol_ms / graphs_ms,
                "graphs_auto_path": graphs_auto_path,
                "graphs_auto_ms": graphs_auto_ms,
                "graphs_auto_vs_plain": (
                    None if graphs_auto_ms is None else graphs_plain_paired_ms / graphs_auto_ms
                ),
            }
        )
    return rows


def _path(buf: torch.Tensor, bits: int, args: argparse.Namespace) -> str:
    """The path "auto" took: the route the policy gives ``buf``'s in-place call on the
    default group, under the settings that call ran with (the same thread, after it ran:
    a crossover measured at its first use is the one it took)."""
    route = policy.route(buf, dist.group.WORLD, bits, args.bucket_size)
    return "quantized" if route.compress else "plain"


def _name(transport: Any) -> str:
    """A transport module's short name: ``shm``, ``nccl``, ``process_group``."""
    return getattr(transport, "__name__", str(transport)).rsplit(".", 1)[-1]


@contextlib.contextmanager
def _graphs_on() -> Iterator[None]:
    """CUDA-graph replay inside: a timer's warm-up runs a signature's first call eagerly and
    its second captures; each result is freed before the next call, so the next lands at the
    same address and replays. The graphs are dropped after."""
    try:
        with config.tuned(cuda_graphs=True):
            yield
    finally:
        graphs.clear()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All sizes, dtypes and bits; the report every rank returns (rank 0 prints it)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timer = Timer(device, args.warmup, args.iters, args.calls)
    # Shared memory's columns where the ranks share a host (every rank asks: collective).
    args.shm = comm.shm.available() and comm.shm.serves(dist.group.WORLD)
    # The node mesh's allreduce beside the flat one, where the job spans hosts of several ranks.
    launch = config.launch()
    args.hierarchical = launch.spans_nodes and launch.local_world_size >= 2
    args.mesh = collectives.node_mesh(device.type) if args.hierarchical else None
    # One untimed pass at the smallest size first: the run's start (first calls of each
    # collective, dtype and codec, on every rank) would otherwise weigh on the first row.
    _bench_size(
        Timer(device, 0, 1, args.calls),
        min(args.sizes),
        args.dtypes[0],
        args,
        device,
        lambda _: None,
    )
    progress = Progress()
    rows = [
        row
        for dtype_name in args.dtypes
        for nbytes in args.sizes
        for row in _bench_size(timer, nbytes, dtype_name, args, device, progress)
    ]
    progress.close()
    args.mesh = None  # not for the JSON
    return {"env": environment(device, dist.get_world_size()), "args": vars(args), "rows": rows}


@dataclass(frozen=True)
class Run:
    """What the legend is written for, so that it says only what applies to this run: the
    device, the regime, what moved the quantized call's bytes and how two ranks swapped them,
    and the crossover auto went by (said in words, with where it came from)."""

    device_type: str = "cuda"
    nccl: bool = True
    regime: str = "nvlink"
    transport: str = "process_group"
    pair_gather: bool = False
    gather_all: bool = False
    crossover: str = ""


TRANSPORT_WORDS = {
    "process_group": "the process group's own collectives",
    "shm": "shared memory between the ranks (cgx2's shm transport)",
    "nccl": "cgx2's NCCL send/receive",
}


def columns(
    backend: str,
    cuda_graphs: bool = False,
    shm: bool = False,
    hierarchical: bool = False,
    run: Run | None = None,
) -> list[tuple[str, str, str, str]]:
    """The table's columns, ``(row key, header, format spec, meaning)``, named after the
    process group's ``backend`` (as the table prints it: NCCL, gloo...); ``shm``: the
    shared-memory transport's too; ``hierarchical``: the node mesh's allreduce's; ``run``:
    the device, regime and route the meanings are written for (a GPU run on NCCL if None)."""
    run = Run() if run is None else run
    cuda = run.device_type == "cuda"
    moved = TRANSPORT_WORDS.get(run.transport, run.transport)
    swap = (
        "two all_gathers (two ranks swap their chunks by all_gather"
        + (", as the pipeline does off NVLink)" if cuda else ")")
        if run.pair_gather
        else "an all_to_all plus an all_gather"
    )
    if run.gather_all:
        swap = "one all_gather of every rank's whole payload (CGX2_ALGORITHM=allgather)"
    graphs_said = (
        f", replaying a CUDA graph up to {policy.GRAPHS_AUTO_MAX_BYTES >> 20} MiB"
        if cuda and run.nccl
        else ""
    )
    crossover = f" The crossover here: {run.crossover}" if run.crossover else ""
    cols = [
        ("dtype", "dtype", "", "the tensor's element type"),
        ("size", "size", "", "the tensor's size in bytes (K, M, G: KiB, MiB, GiB)"),
        ("bits", "bits", "d", "bits per value that cgx2 sends"),
        (
            "plain_ms",
            f"{backend} ms",
            ".3f",
            f"{backend}'s own allreduce of the tensor (torch.distributed.all_reduce)",
        ),
        (
            "plain_busbw",
            f"{backend} GB/s",
            ".2f",
            "its bus bandwidth as nccl-tests counts it: size / time * 2(W-1)/W for W ranks",
        ),
        (
            "cgx2_ms",
            "cgx2 ms",
            ".3f",
            "cgx2.quantized_allreduce of the tensor, compressing at every size"
            + (", launched eagerly (CGX2_CUDA_GRAPHS=0)" if cuda else "")
            + f"; its bytes moved by {moved}",
        ),
        (
            "cgx2_busbw",
            "cgx2 GB/s",
            ".2f",
            "its bus bandwidth, counted on the uncompressed size as above",
        ),
        (
            "cast_bf16_ms",
            "bf16 cast ms",
            ".3f",
            f"cast to bf16, {backend}'s allreduce, cast back: what torch's bf16_compress_hook "
            "does (fp32 tensors only)",
        ),
        (
            "sol_ms",
            "SoL ms",
            ".3f",
            "speed of light: the collectives cgx2's allreduce calls, through the same transport "
            f"and timed the same way, run bare on a payload of the compressed size, once each, "
            f"with no encoding or decoding: {swap}. cgx2 cannot be faster than this but by "
            "timing noise, or where its pipeline's smaller transfers move faster than one large "
            "one (said below the table where it happened)",
        ),
    ]
    if run.pair_gather:
        cols.append(
            (
                "sol_all_to_all_ms",
                "a2a SoL ms",
                ".3f",
                "the same, as an all_to_all plus an all_gather",
            )
        )
    cols += [
        (
            "speedup_vs_plain",
            f"speedup vs {backend}",
            ".2f",
            f"{backend} ms / cgx2 ms: above 1, cgx2 is faster",
        ),
        (
            "fraction_of_sol",
            "% of SoL",
            ".0%",
            "SoL ms / cgx2 ms: how close cgx2 comes to its speed of light",
        ),
        (
            "auto_path",
            "auto",
            "",
            "the path cgx2.quantized_allreduce_ (in place, as the DDP hook and the cgx backend "
            "call it) took at this size, as the policy routed it: quantized at and above the "
            f"crossover{graphs_said}, plain below it.{crossover}",
        ),
        (
            "auto_vs_plain",
            "auto speedup",
            ".2f",
            f"{backend}'s average (its allreduce"
            + (", then a division where it has no AVG, as DDP's hook does" if not run.nccl else "")
            + ") / auto's time, the two timed in turn",
        ),
    ]
    if shm:
        cols += [
            (
                "cgx2_shm_ms",
                "cgx2 shm ms",
                ".3f",
                "cgx2 ms with shared memory moving the bytes (CGX2_TRANSPORT=shm; "
                "docs/transports.md)",
            ),
            (
                "shm_plain_ms",
                "shm plain ms",
                ".3f",
                "the uncompressed allreduce through shared memory",
            ),
            ("shm_plain_speedup", "shm plain speedup", ".2f", f"{backend} ms / shm plain ms"),
        ]
    if hierarchical:
        cols += [
            (
                "hier_ms",
                "hier ms",
                ".3f",
                "cgx2.hierarchical_allreduce: plain inside each host, quantized between hosts "
                "(the node mesh the DDP hook and the cgx backend use across nodes)",
            ),
            ("hier_vs_flat", "hier vs flat", ".2f", "cgx2 ms / hier ms: above 1, the mesh wins"),
        ]
    if cuda_graphs:
        cols += [
            (
                "cgx2_graphs_ms",
                "graphs ms",
                ".3f",
                "cgx2 ms with the allreduce replayed as a CUDA graph (CGX2_CUDA_GRAPHS=1)",
            ),
            ("graphs_speedup_vs_plain", "graphs speedup", ".2f", f"{backend} ms / graphs ms"),
            ("graphs_fraction_of_sol", "graphs % of SoL", ".0%", "SoL ms / graphs ms"),
            ("graphs_auto_path", "graphs auto", "", "auto's path with CUDA graphs"),
            (
                "graphs_auto_vs_plain",
                "graphs auto speedup",
                ".2f",
                f"{backend}'s allreduce time / auto's with CUDA graphs, timed in turn",
            ),
        ]
    return cols


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, DESCRIPTION)
    add_sizes_argument(p, "1M,4M,16M,64M,256M,1G")
    add_dtypes_argument(p)
    add_bits_argument(p)
    add_bucket_size_argument(p)
    add_repeat_arguments(p, warmup=3, iters=10, what="windows")
    p.add_argument(
        "--calls",
        type=int,
        default=1,
        help="calls per timed window, launched back to back (as nccl-tests does) and averaged; "
        "1: each call alone from an idle GPU, its host time before the first launch included",
    )
    p.add_argument(
        "--pipeline-mb",
        type=int,
        default=None,
        help="input MiB per pipeline piece (default: the regime's own)",
    )
    p.add_argument(
        "--no-pair-gather",
        action="store_true",
        help="two ranks swap chunks by all_to_all rather than all_gather",
    )
    p.add_argument(
        "--no-direct-launch",
        action="store_true",
        help="launch the codec's Triton kernels through Triton's own dispatch",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time cgx2 replaying CUDA graphs (GPUs only)",
    )
    add_choice(
        p,
        "--backend",
        ("auto", "nccl", "gloo"),
        "the process group's: auto is NCCL where there are GPUs, else gloo; gloo on GPUs "
        "allreduces CUDA tensors over gloo (ranks sharing a GPU, hosts without NCCL)",
    )
    add_out_argument(p)
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw cgx2's speedup against the tensor's size, per dtype and bits, into "
        "this PNG (needs matplotlib)",
    )
    args = p.parse_args(argv)
    if args.plot:
        missing = matplotlib_missing("--plot")
        if missing:
            p.error(missing)
    if args.backend == "nccl" and not torch.cuda.is_available():
        p.error("--backend nccl needs CUDA GPUs")
    args.dtypes = dtype_names(p, args.dtypes)
    args.bits = bit_widths(p, args.bits)
    if args.calls < 1 or args.iters < 1:
        p.error("--calls and --iters must be at least 1")
    if args.cuda_graphs and args.backend == "gloo":
        p.error("--cuda-graphs replays NCCL's collectives: not with --backend gloo")
    if args.cuda_graphs and not torch.cuda.is_available():
        p.error("--cuda-graphs needs CUDA GPUs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = started(PROG, parse_args, argv)
    if args is None:
        return 2
    with config.tuned(**settings_from_flags(args)):
        return _main(args)


def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`cgx2.config.TuningConfig` fields the command line sets; the others keep
    their ``CGX2_*`` variables' values."""
    settings: dict[str, Any] = {}
    if args.pipeline_mb is not None:
        settings["pipeline_bytes"] = args.pipeline_mb << 20
    if args.no_pair_gather:
        settings["pair_gather"] = False
    if args.no_direct_launch:
        settings["direct_launch"] = False
    return settings


def _main(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = args.backend if args.backend != "auto" else "nccl" if cuda else "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    args.pipeline_bytes = config.tuning().pipeline_bytes  # None: the regime's PIECE_NUMEL
    dist.init_process_group(backend)
    if args.pipeline_bytes is None:  # values a piece (of any dtype), as the pipeline cuts them
        probe = torch.empty(0, device=device or torch.device("cpu"))
        with config.tuned(crossover_bytes=0):
            args.piece_numel = policy.route(
                probe, dist.group.WORLD, 4, args.bucket_size, numel=1
            ).piece_numel
    try:
        report = run(args)
        if dist.get_rank() == 0:
            _print_report(report, args)
    finally:
        dist.destroy_process_group()
    return 0


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Rank 0's table, the legend of what applies to this run, what in the rows needs saying
    (a % of SoL above 100, auto slower than the plain allreduce), the run, and the files."""
    name = dist.get_backend()
    backend = BACKEND_NAMES.get(name, name)
    rows, env = report["rows"], report["env"]
    cuda = torch.cuda.is_available()  # the tensors' device, as run() chose it
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    run = Run(
        device_type=device.type,
        nccl=name == "nccl",
        regime=env["regime"],
        transport=rows[0]["transport"],
        pair_gather=rows[0]["pair_gather"],
        gather_all=rows[0].get("gather_all", False),
        crossover=crossover_words(rows, device, name, env["regime"]),
    )
    cols = columns(backend, args.cuda_graphs, args.shm, args.hierarchical, run)
    table, legend = format_columns(rows, cols)
    print(f"{table}\n\nColumns:\n{legend}")
    notes = row_notes(rows, backend)
    if notes:
        print()
        print("\n".join(textwrap.fill(note, 100, break_on_hyphens=False) for note in notes))
    nccl = f", NCCL {env['nccl']}" if "nccl" in env else ""
    print(
        f"\n{env['device']} x{env['world_size']}, {name}, regime {env['regime']}, "
        f"torch {env['torch']}{nccl}, "
        + (
            "one call per timed window"
            if args.calls == 1
            else f"{args.calls} calls back to back per timed window"
        )
    )
    if args.out:
        print(f"results: {write_json('allreduce', report, args.out)}")
    if args.plot:
        print(f"plot: {plot([report], args.plot)}")


def crossover_words(
    rows: list[dict[str, Any]], device: torch.device, backend: str, regime: str
) -> str:
    """The crossover auto went by, per dtype, and where it came from, in words."""
    override = config.crossover_override()
    found = policy.calibration(dist.group.WORLD)
    crossovers = []
    for dtype_name in dict.fromkeys(r["dtype"] for r in rows):
        # Across hosts the link is measured at the first call that asks, so the rows before it
        # may have gone by another crossover: the last row's is the one the policy settled on.
        seen = [r["auto_crossover_bytes"] for r in rows if r["dtype"] == dtype_name]
        value, earlier = seen[-1], [v for v in dict.fromkeys(seen) if v != seen[-1]]
        key = policy.calibration_key(device.type, backend, DTYPES[dtype_name])
        if override is not None:
            source = "CGX2_CROSSOVER_BYTES"
        elif key in found:
            source = f"the calibration file's {key}"
        elif config.launch().spans_nodes:
            source = "measured on the link at first use, or the built-in table"
        else:
            source = f"the built-in table's for the {regime} regime"
        if earlier:
            source += ", earlier rows " + " or ".join(map(_crossover_said, earlier))
        crossovers.append(f"{dtype_name} {_crossover_said(value)} ({source})")
    text = "; ".join(crossovers) + "."
    if regime == "cpu" and override is None and all(r["auto_crossover_bytes"] == 0 for r in rows):
        text += (
            " On CPU tensors the built-in table compresses every size, since the link between "
            "CPU hosts is not known here; on one host the plain allreduce can be the faster "
            "(auto speedup below 1): python -m cgx2.bench calibrate measures where compression "
            "pays on this machine, and the policy then goes by that."
        )
    return text


def _crossover_said(value: int | None) -> str:
    return "never" if value is None else "every size" if value == 0 else _bytes_said(value)


def _bytes_said(nbytes: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"from {nbytes // div} {unit}"
    return f"from {nbytes} bytes"


EVEN = 0.1
"""Ratios within this fraction of 1 are timing noise here, not a win or a loss."""


def _rows_listed(rows: list[dict[str, Any]], key: str, spec: str = ".2f") -> str:
    return ", ".join(f"{r['dtype']} {r['size']} {r['bits']}-bit {r[key]:{spec}}" for r in rows)


def row_notes(rows: list[dict[str, Any]], backend: str) -> list[str]:
    """What the rows show that the legend alone would contradict: a % of SoL above 100, auto
    slower than the plain allreduce where it quantized, or plain where cgx2 was faster."""
    notes = []
    above = [r for r in rows if r["fraction_of_sol"] > 1]
    if above:
        listed = _rows_listed(above, "fraction_of_sol", ".0%")
        notes.append(
            f"% of SoL above 100% in {len(above)} rows ({listed}): "
            "cgx2's pipeline moved its payload in pieces, overlapping each other and the coding, "
            "faster than the bare collectives moved it at once; within "
            f"{EVEN:.0%} of 100% that is timing noise."
        )
    lost = [r for r in rows if r["auto_path"] == "quantized" and r["auto_vs_plain"] < 1 - EVEN]
    if lost:
        notes.append(
            f"auto quantized and was slower than {backend} in {len(lost)} rows (auto speedup: "
            f"{_rows_listed(lost, 'auto_vs_plain')}): there the crossover is below where "
            "compression pays on this machine; python -m cgx2.bench calibrate measures where "
            "it pays."
        )
    missed = [r for r in rows if r["auto_path"] == "plain" and r["speedup_vs_plain"] > 1 + EVEN]
    if missed:
        notes.append(
            f"auto sent plain in {len(missed)} rows where cgx2 was faster (speedup: "
            f"{_rows_listed(missed, 'speedup_vs_plain')}): there the crossover is above where "
            "compression pays on this machine; python -m cgx2.bench calibrate measures it."
        )
    return notes


def plot(reports: list[dict[str, Any]], path: str | Path) -> Path:
    """A PNG at ``path`` of cgx2's speedup over the plain allreduce against the tensor's size:
    one panel per report (a run: one regime, device and link), one line per dtype and bits,
    solid for cgx2 compressing at every size, dashed for auto. Needs
    matplotlib (:func:`cgx2.bench.report.matplotlib_missing`); imported here only."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file is all that is wanted
    from matplotlib import pyplot as plt

    panels = []
    for report in reports:  # a run is of one regime: a panel each
        env = report["env"]
        link = env.get("link")
        ran_on = f"{env['regime']}" + (f", {link['hosts']} hosts at {link['rate']}" if link else "")
        panels.append((f"{ran_on}: {env['device']} x{env['world_size']}", report["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels, strict=True):
        lines = sorted({(r["dtype"], r["bits"]) for r in rows})
        for index, (dtype_name, bits) in enumerate(lines):
            mine = sorted(
                (r for r in rows if (r["dtype"], r["bits"]) == (dtype_name, bits)),
                key=lambda r: r["bytes"],
            )
            sizes = [r["bytes"] for r in mine]
            color = f"C{index % 10}"
            label = f"{dtype_name} {bits}-bit"
            ax.plot(sizes, [r["speedup_vs_plain"] for r in mine], "o-", color=color, label=label)
            if all(r.get("auto_vs_plain") is not None for r in mine):
                auto = [r["auto_vs_plain"] for r in mine]
                ax.plot(sizes, auto, "x--", color=color, alpha=0.6, label=f"{label} auto")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylim(bottom=0)  # a ratio's axis from 0: its lines are not magnified
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["bytes"] for r in rows}))
        ax.set_xticklabels([size_name(n) for n in sorted({r["bytes"] for r in rows})])
        ax.set_xlabel("tensor size (bytes)")
        ax.set_ylabel("plain ms / cgx2 ms")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("cgx2's quantized allreduce against the plain one (above 1: cgx2 is faster)")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


PLOT_DESCRIPTION = """\
Draws results that python -m cgx2.bench wrote (its JSON under --out) as a PNG: cgx2's speedup
over the plain allreduce against the tensor's size, a panel per run (one regime each), a line
per dtype and bits (solid: compressing at every size; dashed: auto). Needs matplotlib.

  python -m cgx2.bench plot cgx2-results/allreduce_*.json --plot speedup.png
"""


def plot_main(argv: list[str] | None = None) -> int:
    """``python -m cgx2.bench plot RESULT.json... --plot PNG``: :func:`plot` of saved runs."""
    p = parser(f"{PROG} plot", PLOT_DESCRIPTION)
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="allreduce results")
    p.add_argument("--plot", metavar="PNG", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    missing = matplotlib_missing("plot")
    if missing:
        p.error(missing)
    reports = []
    for name in args.results:
        try:
            report = json.loads(Path(name).read_text())
        except (OSError, ValueError) as e:
            p.error(f"{name}: cannot be read as JSON: {e}")
        rows = report.get("rows") if isinstance(report, dict) else None
        if not rows or "speedup_vs_plain" not in rows[0] or "env" not in report:
            p.error(f"{name}: not the results of python -m cgx2.bench (allreduce)")
        reports.append(report)
    print(f"plot: {plot(reports, args.plot)}")
    return 0
