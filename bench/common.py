"""What the bench scripts share: the host-cost benches' options, one call timed, a run's JSON
record, and the GPU checks' verdicts (a line a check, the ranks that failed counted on the GPU)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from cgx2.bench import report


def add_host_cost_options(p: argparse.ArgumentParser, *, calls: int, rounds: int) -> None:
    """--numel, --calls (a round: ``calls``), --rounds (``rounds``) and --bits."""
    p.add_argument("--numel", type=int, default=65536)
    p.add_argument("--calls", type=int, default=calls, help="calls a round")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--bits", type=int, default=4)


def timed_ms(call: Callable[[], object], cuda: bool) -> float:
    """Milliseconds of ``call()``, the ranks lined up by a barrier first; with ``cuda``, the
    GPU idle before it and done after."""
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def write_results(
    kind: str,
    device: torch.device,
    rows: list[dict],
    out: str,
    env: dict | None = None,
    **fields: object,
) -> None:
    """Rank 0's record of a run: its environment on ``device`` (and ``env``'s entries), its
    ``rows`` and ``fields``, written as ``kind``'s JSON under ``out``; then the file's path."""
    said = report.environment(device, dist.get_world_size()) | (env or {})
    path = report.write_json(kind, {"env": said, "rows": rows, **fields}, out)
    print(f"-> {path}")


def say(ok: bool, what: str) -> None:
    """A check's line: ``ok`` or ``FAIL``, then what was checked."""
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)


def ranks_failed(ok: bool, op: dist.ReduceOp = dist.ReduceOp.SUM) -> int:
    """How many ranks say not ``ok`` (with ``op`` MAX: 1 if any does), reduced on this GPU."""
    flag = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(flag, op=op)
    return int(flag.item())


def checks_failed(ok: dict[str, bool]) -> bool:
    """Whether any rank failed one of its checks ``ok`` (name: passed); rank 0 says each of
    its own."""
    failed = ranks_failed(all(ok.values()), dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        for name, good in ok.items():
            say(good, name)
    return bool(failed)


def finish_checks(ok: dict[str, bool], summary: Callable[[bool], str]) -> int:
    """:func:`checks_failed`, then rank 0 says ``summary(failed)``; the process group ends.
    The exit status: 1 where any rank failed a check."""
    failed = checks_failed(ok)
    if dist.get_rank() == 0:
        print(summary(failed))
    dist.destroy_process_group()
    return int(failed)
