"""Where compression pays on this machine's links: ``python -m cgx2.bench calibrate`` times the
plain allreduce against cgx2's 4-bit one over a ladder of sizes and writes the crossovers that
the policy reads (``cgx2.config.tuning().calibration_file``).

The file (format ``cgx2.collectives.policy.CALIBRATION_FORMAT``) holds, per
``<device type>/<backend>/<fp32 or 16bit>``, the smallest measured size from which compressing
was faster at every larger measured size (None: never), the same for calls beside the training
step (faster by ``measure.beside_margin``), and the measurements themselves; for a job across
nodes of several ranks (CPU tensors, or CUDA tensors on NCCL: NVLink inside a host), whether the
node mesh beat the flat allreduce, by size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cgx2
from cgx2 import config
from cgx2.collectives import calibration_file, policy
from cgx2.collectives.hierarchical import node_mesh
from cgx2.collectives.measure import (
    BITS,
    BUCKET_SIZE,
    beside_margin,
    crossover,
    mesh_against_flat,
    timed_in_turn,
)

from .report import (
    DTYPES,
    Progress,
    add_dtypes_argument,
    add_repeat_arguments,
    add_sizes_argument,
    dtype_names,
    format_columns,
    parser,
    size_name,
    started,
)

__all__ = [
    "calibrate",
    "crossover",
    "crossovers",
    "default_sizes",
    "main",
    "node_mesh_tables",
    "write_calibration",
]

DTYPE_CLASS = {"fp32": "fp32", "bf16": "16bit", "fp16": "16bit"}
"""The file's crossovers are per element width: the policy reads one for fp32, one for 16-bit."""
BACKEND_NAMES = {"nccl": "NCCL"}

PROG = "python -m cgx2.bench calibrate"
DESCRIPTION = f"""\
Measures where compression pays on this machine's links and this process group's backend.
It times the backend's plain allreduce against cgx2's quantized one ({BITS} bits, bucket
{BUCKET_SIZE}, compressing at every size) over a ladder of tensor sizes, for fp32 and bf16,
and writes the crossovers (the smallest size from which cgx2 was faster at every larger
size) to a small JSON file that cgx2 reads to decide when to compress. Every rank takes the
slowest rank's times, so that all decide alike. Run it with the processes, GPUs and backend
that training will use:

  torchrun --nproc-per-node 4 -m cgx2.bench calibrate
  torchrun --nproc-per-node 2 -m cgx2.bench calibrate --backend gloo   (CUDA tensors on gloo)
  torchrun --nnodes 2 --nproc-per-node 4 ... -m cgx2.bench calibrate    (in each host)

Across hosts it also times the node mesh (NCCL inside a host, quantized between) against the
flat allreduce; with the file, the policy measures neither at the job's first call.

Rank 0 prints a table and writes the file.
"""


def default_sizes(device_type: str) -> list[int]:
    """64 KiB to 256 MiB (64 MiB on the CPU, where the codec is slower), by factors of 4."""
    top = (256 if device_type == "cuda" else 64) << 20
    sizes, size = [], 64 << 10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def crossovers(
    measurements: Sequence[dict[str, Any]], device_type: str, backend: str, margin: float = 1.0
) -> dict[str, int | None]:
    """``{"<device_type>/<backend>/fp32": bytes or None, ".../16bit": ...}``, a key per element
    width measured: where compressing was faster by ``margin`` times."""
    widths = dict.fromkeys(DTYPE_CLASS[m["dtype"]] for m in measurements)
    return {
        f"{device_type}/{backend}/{width}": crossover(
            [m for m in measurements if DTYPE_CLASS[m["dtype"]] == width], margin
        )
        for width in widths
    }


def calibrate(
    sizes: Sequence[int],
    dtypes: Sequence[str] = ("fp32", "bf16"),
    warmup: int = 2,
    iters: int = 5,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time plain against compressed allreduces of ``sizes`` bytes of each dtype on ``group``
    (every rank calls it) and return the calibration file's contents, the same on every rank.

    ``device``: where the tensors live (default: this rank's GPU if CUDA is available).
    """
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = dist.get_backend(group)
    # Barriers and the times' maximum go over gloo, on the host: no stream to wait for.
    control = group if backend == "gloo" else dist.new_group(backend="gloo")
    measurements = []
    with config.tuned(crossover_bytes=0):  # compress at every size
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for nbytes in sizes:
                if progress is not None:
                    progress(f"{dtype_name} {size_name(nbytes)}")
                x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
                buf = x.clone()

                def plain(buf: torch.Tensor = buf) -> None:
                    dist.all_reduce(buf, group=group)

                def compressed(x: torch.Tensor = x) -> None:
                    cgx2.quantized_allreduce(x, BITS, bucket_size=BUCKET_SIZE, group=group)

                plain_s, compressed_s = timed_in_turn(
                    (plain, compressed), warmup, iters, device, control
                )
                measurements.append(
                    {
                        "dtype": dtype_name,
                        "bytes": nbytes,
                        "plain_s": plain_s,
                        "compressed_s": compressed_s,
                    }
                )
                del x, buf
    node_mesh_faster = node_mesh_tables(
        sizes, dtypes, warmup, iters, device, group or dist.group.WORLD, backend, progress
    )
    if control is not group:
        dist.destroy_process_group(control)
    return {
        "format": policy.CALIBRATION_FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": dist.get_world_size(group),
        "backend": backend,
        "device_type": device.type,
        "crossover_bytes": crossovers(measurements, device.type, backend),
        # DDP's hooks reduce CPU tensors beside the backward pass, whose computation the codec
        # takes cores from: there compressing must win by a margin (policy._pick).
        "beside_crossover_bytes": crossovers(
            measurements, device.type, backend, beside_margin(device.type)
        ),
        "measurements": measurements,
        # Jobs across nodes of several ranks: whether the node mesh beat the flat allreduce.
        "node_mesh_faster": node_mesh_faster,
    }


def node_mesh_tables(
    sizes: Sequence[int],
    dtypes: Sequence[str],
    warmup: int,
    iters: int,
    device: torch.device,
    group: dist.ProcessGroup,
    backend: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, bool]]:
    """Where the job spans nodes of several ranks (:func:`cgx2.collectives.policy.hierarchical`),
    whether the node mesh beat the flat quantized allreduce, by size, a key per device,
    ``backend`` and width: ``{"cuda/nccl/fp32": {"1048576": True, ...}}``; else empty. On GPUs
    the mesh's steps inside a host are NCCL's own (NVLink's), on CPUs gloo's or shared
    memory's. Every rank calls it alike."""
    if not policy.hierarchical(group, BITS):
        return {}
    # DDP's hook and the cgx backend choose between the node mesh and the flat allreduce
    # (policy.by_node_mesh): timed here, the choice is not timed again at first use.
    mesh = node_mesh(device.type)
    intra_broadcast = config.CGXConfig.from_env().intra_broadcast
    tables = {}
    with config.tuned(crossover_bytes=0):
        for dtype_name in dtypes:
            if progress is not None:
                progress(f"{dtype_name}: the node mesh against the flat allreduce")
            faster = mesh_against_flat(
                DTYPES[dtype_name],
                group,
                mesh,
                BITS,
                BUCKET_SIZE,
                intra_broadcast,
                sizes,
                warmup,
                iters,
                device=device,
            )
            key = policy.calibration_key(device.type, backend, DTYPES[dtype_name])
            tables[key] = {str(n): won for n, won in faster.items()}
    return tables


def keep_other_crossovers(data: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """``data`` with the crossovers of an earlier calibration file at ``path`` that this run
    did not measure (another backend, device or width): calibrating NCCL and then gloo leaves
    both in the file. An absent file adds nothing, nor does one the policy would not read
    (:func:`cgx2.collectives.calibration_file.load`; logged)."""
    try:
        earlier = calibration_file.load(os.fspath(path))
    except calibration_file.CalibrationFileError as e:
        logging.getLogger("cgx2").warning(
            "cgx2: not keeping the crossovers of the calibration file %s: it %s", path, e
        )
        return data
    if earlier is None:
        return data
    merged = dict(data)
    for table in ("crossover_bytes", "beside_crossover_bytes", "node_mesh_faster"):
        kept = earlier.get(table)
        if isinstance(kept, dict) and table in data:
            merged[table] = {**kept, **data[table]}
    return merged


def write_calibration(data: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``data`` to ``path`` atomically (a temporary file beside it, then renamed), so that
    a reader sees the old file or the new one, never half of one; only its owner may write it,
    as the policy requires. Data larger than the policy reads
    (:data:`cgx2.collectives.calibration_file.MAX_BYTES`) raises ``ValueError``."""
    text = json.dumps(data, indent=1) + "\n"
    if len(text.encode()) > calibration_file.MAX_BYTES:
        raise ValueError(
            f"write_calibration: data of {len(text.encode())} bytes, more than the "
            f"{calibration_file.MAX_BYTES} a calibration file may hold (fewer --sizes)"
        )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def format_report(data: dict[str, Any]) -> str:
    """The table of the measurements, its legend, and the crossovers found."""
    name = BACKEND_NAMES.get(data["backend"], data["backend"])
    rows = [
        {
            "size": size_name(m["bytes"]),
            "dtype": m["dtype"],
            "plain_ms": 1e3 * m["plain_s"],
            "cgx2_ms": 1e3 * m["compressed_s"],
            "speedup": m["plain_s"] / m["compressed_s"],
        }
        for m in data["measurements"]
    ]
    columns = [
        ("size", "size", "", "the tensor's size in bytes (K, M, G: KiB, MiB, GiB)"),
        ("dtype", "dtype", "", "the tensor's element type"),
        ("plain_ms", "plain ms", ".3f", f"{name}'s own allreduce of the tensor"),
        (
            "cgx2_ms",
            "cgx2 ms",
            ".3f",
            f"cgx2.quantized_allreduce at {BITS} bits, bucket {BUCKET_SIZE}, always compressing",
        ),
        ("speedup", f"speedup vs {name}", ".2f", "plain ms / cgx2 ms: above 1, cgx2 is faster"),
    ]
    table, legend = format_columns(rows, columns)
    lines = [
        table,
        "",
        "Columns (each time: the median over iterations of the slowest rank's):",
        legend,
        "",
        f"{data['device_name']} x{data['world_size']}, {name}, torch {data['torch']}.",
        "cgx2 compresses from (the smallest size from which it was faster at every larger one):",
    ]
    beside_crossovers = data.get("beside_crossover_bytes", {})
    for key, value in data["crossover_bytes"].items():
        line = f"  {key}: " + ("never" if value is None else size_name(value))
        beside = beside_crossovers.get(key, value)
        if beside != value:
            line += ", beside a training step (DDP's hooks, CPU tensors) " + (
                "never" if beside is None else "from " + size_name(beside)
            )
        lines.append(line)
    for key, table in data.get("node_mesh_faster", {}).items():
        won = [size_name(int(n)) for n, mesh_won in table.items() if mesh_won]
        lines.append(
            f"  {key} across nodes: the node mesh at "
            + (", ".join(won) or "no size")
            + ", the flat allreduce elsewhere"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(PROG, DESCRIPTION)
    add_sizes_argument(
        p, None, " (default: 64K, 256K, 1M, ... 256M by factors of 4; up to 64M on the CPU)"
    )
    add_dtypes_argument(p, " (bf16 and fp16 give the 16-bit crossover)")
    add_repeat_arguments(p, warmup=2, iters=5, what="calls of each")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where the tensors live (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo", "cgx"),
        default=None,
        help="the process group's backend (default: nccl on cuda, gloo on cpu)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        default=config.tuning().calibration_file,
        help="the calibration file, written by rank 0 (the default is where cgx2 "
        "reads it: CGX2_CALIBRATION_FILE)",
    )
    args = p.parse_args(argv)
    args.dtypes = dtype_names(p, args.dtypes)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device == "cpu":
        p.error("--backend nccl needs --device cuda")
    if args.sizes is None:
        args.sizes = default_sizes(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = started(PROG, parse_args, argv)
    if args is None:
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":  # ranks may share GPUs (over gloo): more ranks than GPUs
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    try:
        rank0 = dist.get_rank() == 0
        progress = Progress()
        data = calibrate(
            args.sizes,
            args.dtypes,
            args.warmup,
            args.iters,
            device,
            progress=progress if rank0 else None,
        )
        progress.close()
        if rank0:
            print(format_report(data))
            data = keep_other_crossovers(data, args.out)
            print(f"\nwrote {write_calibration(data, args.out)}")
    finally:
        dist.destroy_process_group()
    return 0
