"""What pays on this job's link, measured: the plain allreduce against the 4-bit one (``python -m
cgx2.bench calibrate`` writes what it finds to a file; the policy measures groups across hosts
itself, at first use, where no file says), and the node mesh against the flat allreduce.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm import group_info, process_group
from .allreduce import allreduce
from .call_settings import CallSettings
from .hierarchical import hierarchical_allreduce

__all__ = [
    "BITS",
    "BUCKET_SIZE",
    "CPU_MARGIN",
    "beside_margin",
    "crossover",
    "crossover_on_link",
    "first_use_sizes",
    "mesh_against_flat",
    "timed_in_turn",
]

logger = logging.getLogger("cgx2")

BITS = 4
BUCKET_SIZE = 512

FIRST_USE_SIZES = (1 << 20, 4 << 20, 16 << 20)
"""The sizes measured at first use: where, over Ethernet, the crossover lay when calibrated
(BENCHMARKS.md, "CPU hosts over Ethernet"); at larger sizes the largest one's answer holds."""

CUDA_FIRST_USE_SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""The sizes measured at first use for CUDA tensors on NCCL across hosts: the GPU's codec is
fast, so over Ethernet compression may pay below a MiB (DDP's first bucket is 1 MiB)."""


def first_use_sizes(device_type: str) -> tuple[int, ...]:
    """The sizes measured at first use for ``device_type``'s tensors."""
    return CUDA_FIRST_USE_SIZES if device_type == "cuda" else FIRST_USE_SIZES


LARGER_SIZE = 64 << 20
"""Measured at first use too where compression had not won, by :data:`CPU_MARGIN`, at the
largest of :data:`FIRST_USE_SIZES`: on fast links it may win only beyond (cheap to measure
there, the link being fast)."""

MESH_SIZES = FIRST_USE_SIZES
"""The sizes at which the node mesh is timed against the flat allreduce at first use: they span
DDP's buckets (its first of 1 MiB, the others of 25 MiB by default)."""


CPU_MARGIN = 1.5
"""How much faster than plain a measured compressed allreduce of CPU tensors must be to be
chosen for calls beside the training step (DDP's hooks on their worker thread): there its
codec takes cores from the step's own computation, which timing the collective alone does not
see (BENCHMARKS.md, "Training across the hosts")."""


def beside_margin(device_type: str) -> float:
    """The margin compression must win by for calls beside the training step on
    ``device_type``: :data:`CPU_MARGIN` on CPUs, none on GPUs, whose codec has cores of its own."""
    return CPU_MARGIN if device_type == "cpu" else 1.0


def crossover(measurements: Sequence[dict[str, Any]], margin: float = 1.0) -> int | None:
    """The smallest measured size at which compressed was faster than plain (by ``margin``
    times) there and at every larger measured size (every measurement of a size must agree);
    None if at none."""
    faster: dict[int, bool] = {}
    for m in measurements:
        wins = m["compressed_s"] * margin < m["plain_s"]
        faster[m["bytes"]] = faster.get(m["bytes"], True) and wins
    found = None
    for size in sorted(faster, reverse=True):
        if not faster[size]:
            break
        found = size
    return found


def timed_in_turn(
    fns: Sequence[Callable[[], Any]],
    warmup: int,
    iters: int,
    device: torch.device,
    control: dist.ProcessGroup | None,
) -> list[float]:
    """Each function's median time in seconds over ``iters`` calls after ``warmup``, the calls
    taken in turn (so that drift favours none), each started together on all ranks; each call's
    time is the slowest rank's, so every rank returns the same medians."""
    times = torch.zeros(len(fns), iters, dtype=torch.float64)
    # A control group whose collectives are NCCL's (the policy's measurement at first use,
    # which cannot make a gloo group: every rank of the job would have to) takes CUDA tensors.
    on_device = device.type == "cuda" and _cuda_on_nccl(control)
    for i in range(-warmup, iters):
        for j, fn in enumerate(fns):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if on_device:  # integers: never quantized, on the cgx backend either
                dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=device), group=control)
                torch.cuda.synchronize(device)
            else:
                dist.barrier(group=control)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 0:
                times[j, i] = time.perf_counter() - start
    slowest = times.to(device) if on_device else times
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
    return [statistics.median(row) for row in slowest.cpu().tolist()]


def _cuda_on_nccl(group: dist.ProcessGroup | None) -> bool:
    """Whether NCCL carries ``group``'s CUDA tensors (None: the default group)."""
    return group_info(dist.group.WORLD if group is None else group).cuda_on_nccl


def crossover_on_link(
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    sizes: Sequence[int] | None = None,
    warmup: int = 1,
    iters: int = 3,
    larger: int | None = LARGER_SIZE,
    device: torch.device | None = None,
) -> tuple[int | None, int | None]:
    """The crossovers of ``device``'s tensors (None: the CPU's) of ``dtype`` over ``group``
    (gloo's or the cgx backend's for CPU tensors, NCCL's or the cgx backend's over it for CUDA
    tensors; every rank calls this, alike), measured now: a few seconds at most, once per
    group and dtype. ``sizes`` None: :func:`first_use_sizes`. The first for calls alone, the
    second for calls beside the training step's computation, which must win by
    :func:`beside_margin` (CPUs'). ``larger`` is measured too where the largest of ``sizes``
    did not win by that margin (all ranks hold the same times, so decide alike). The plain
    side is the group's own allreduce. The caller (:mod:`.policy`) makes the quantized calls
    compress meanwhile."""
    device = torch.device("cpu") if device is None else device
    margin = beside_margin(device.type)
    settings = CallSettings(bits=BITS, bucket_size=BUCKET_SIZE)

    def measured(nbytes: int) -> dict[str, Any]:
        x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
        buf = x.clone()
        plain_s, compressed_s = timed_in_turn(
            (
                lambda: process_group.allreduce_plain_(buf, group, "sum"),  # exact on cgx too
                lambda: allreduce(x, group, settings),
            ),
            warmup,
            iters,
            x.device,
            group,
        )
        return {"bytes": nbytes, "plain_s": plain_s, "compressed_s": compressed_s}

    # The caller routes these calls through compression.
    sizes = first_use_sizes(device.type) if sizes is None else sizes
    measurements = [measured(nbytes) for nbytes in sizes]
    last = measurements[-1]
    if larger is not None and last["compressed_s"] * margin >= last["plain_s"]:
        measurements.append(measured(larger))
    alone, beside_step = crossover(measurements), crossover(measurements, margin)
    in_words = ["never" if n is None else f"{n} bytes" for n in (alone, beside_step)]
    logger.info(
        "cgx2: measured on this job's link (group %r, %s %s, %d-bit): %s; quantized from %s "
        "(beside the training step: from %s)",
        group.group_name,
        device.type,
        dtype,
        BITS,
        ", ".join(
            f"{m['bytes'] / (1 << 20):g} MiB plain {1e3 * m['plain_s']:.2f} ms, "
            f"quantized {1e3 * m['compressed_s']:.2f} ms"
            for m in measurements
        ),
        *in_words,
    )
    return alone, beside_step


def mesh_against_flat(
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    mesh: DeviceMesh,
    bits: int,
    bucket_size: int,
    intra_broadcast: bool,
    sizes: Sequence[int] | None = None,
    warmup: int = 1,
    iters: int = 3,
    device: torch.device | None = None,
) -> dict[int, bool]:
    """For each of ``sizes`` (bytes; None: :data:`MESH_SIZES`), whether the node ``mesh``'s
    allreduce (:func:`.hierarchical.hierarchical_allreduce`: plain inside a host, NVLink's
    on GPUs, quantized between hosts) of ``device``'s tensors (None: the CPU's) of ``dtype``
    was faster than the flat quantized one over ``group``, timed now in turn on every rank
    (so all get the same answer): a few seconds at most, once per group and settings. Every
    rank calls this, alike."""
    device = torch.device("cpu") if device is None else device
    flat = CallSettings(bits=bits, bucket_size=bucket_size)
    faster, shown = {}, []
    for nbytes in MESH_SIZES if sizes is None else sizes:
        x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
        flat_s, mesh_s = timed_in_turn(
            (
                lambda x=x: allreduce(x, group, flat),
                lambda x=x: hierarchical_allreduce(
                    x, bits, mesh, "sum", bucket_size, intra_broadcast
                ),
            ),
            warmup,
            iters,
            x.device,
            group,
        )
        faster[nbytes] = mesh_s < flat_s
        shown.append(f"{nbytes >> 20} MiB flat {1e3 * flat_s:.1f} ms, mesh {1e3 * mesh_s:.1f} ms")
    won = ", ".join(f"{n >> 20} MiB" for n, mesh_won in faster.items() if mesh_won)
    logger.info(
        "cgx2: the node mesh against the flat allreduce on this job's link (group %r, "
        "%s %s, %d-bit): %s; the mesh at %s",
        group.group_name,
        device.type,
        dtype,
        bits,
        ", ".join(shown),
        won or "no size",
    )
    return faster
