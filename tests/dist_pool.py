"""A pool of gloo worker processes, started once per test session, that run test functions.

Spawning and joining a process group costs seconds; the pool pays it once per world size.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)  # up to 4 ranks share this machine's 2 cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    import cgx2  # noqa: F401  (registers the ops)

    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` processes in one gloo group; :meth:`run` calls a function on all."""

    def __init__(self, world_size: int, timeout: float = 600.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        # The ranks are CPU processes of one gloo group, on a GPU machine as on CI: seeing a GPU,
        # cgx2's backend and torch's own hooks would take it, every rank the same one.
        with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": ""}):
            for p in self._procs:
                p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(*args)`` on every rank (``fn`` must be importable); return the results by
        rank, or raise ``AssertionError`` with the workers' tracebacks."""
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, Any] = {}
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                raise AssertionError(f"{fn.__name__} timed out after {self.timeout}s") from None
            if ok:
                out[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise AssertionError("\n".join(failures))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
