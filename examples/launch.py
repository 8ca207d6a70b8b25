"""How the examples start: under ``torchrun``/``mpirun`` (``RANK`` set) in the launcher's
processes, otherwise as ``--world-size`` gloo processes spawned on this machine."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_default(args: argparse.Namespace, **kwargs: int) -> None:
    """NCCL for ``--device cuda``, gloo otherwise."""
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **kwargs)


def launch(
    run: Callable[[argparse.Namespace], dict],
    args: argparse.Namespace,
    init: Callable[..., None] = init_default,
) -> dict | None:
    """Call ``run(args)`` on every rank; return rank 0's result there (None elsewhere)."""
    if "RANK" in os.environ:
        if args.device == "cuda":  # more ranks than GPUs share them (a gloo group only)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        init(args)
        try:
            result = run(args)
        finally:
            dist.destroy_process_group()
        return result if int(os.environ["RANK"]) == 0 else None
    if args.device == "cuda":
        raise SystemExit("with --device cuda, launch with torchrun (one process per GPU)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker,
        (args.world_size, port, args, queue, run, init, sys.orig_argv),
        args.world_size,
        start_method="spawn",
    )
    return queue.get()


def _worker(
    rank: int,
    world: int,
    port: int,
    args: argparse.Namespace,
    queue: Any,
    run: Callable[[argparse.Namespace], dict],
    init: Callable[..., None],
    argv: list[str],
) -> None:
    # The command a result records (cgx2.bench.report.environment) is this one, not spawn's.
    sys.orig_argv = argv
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init(args, rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        result = run(args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()
