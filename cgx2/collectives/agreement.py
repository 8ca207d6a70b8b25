"""That the ranks of a collective agree on what it is: before any of its bytes move, each rank
shares a few integers (size, dtype, bits, bucket, op, route) and every rank raises if any differ.

Ranks that disagree would otherwise hang in different collectives until the group's timeout, or
worse, exchange payloads of equal size and return wrong values without an error. The exchange is
one all-gather of a few dozen bytes, the same whatever the arguments, so it cannot itself hang
on a disagreement. Whether it runs is the policy's choice (:class:`.policy.Route`'s ``check``);
the entry points users call run it (the ops, the ``cgx`` backend), not DDP's and FSDP's hooks,
whose wrappers make every rank's buckets alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather_single

__all__ = ["DisagreementError", "check"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_WORDS = {"sum": 0, "avg": 1}  # reduce ops: shown by name in the message


class DisagreementError(RuntimeError):
    """The ranks of one collective were called with different arguments."""


def check(group: dist.ProcessGroup, operation: str, t: torch.Tensor,
          fields: dict[str, int | str | bool | float | Sequence | None]) -> None:  # fmt: skip
    """Raise :class:`DisagreementError` on every rank of ``group`` unless all called
    ``operation`` with the same ``t.numel()``, ``t.dtype`` and ``fields`` (named values; the
    message names those that differ, rank by rank)."""
    names = ["numel", "dtype", *fields]
    values = [t.numel(), _DTYPES.get(t.dtype, 99), *(_code(v) for v in fields.values())]
    mine = torch.tensor(values, dtype=torch.int64)
    device = t.device if t.is_cuda and dist.get_backend(group) == "nccl" else torch.device("cpu")
    world = dist.get_world_size(group)
    gathered = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    try:
        all_gather_single(gathered, mine.to(device), group=group)
    except RuntimeError as e:  # a peer died or stalled before the call
        raise RuntimeError(
            f"cgx2: the ranks of {operation} could not compare their arguments (this is rank "
            f"{dist.get_rank(group)}): {e}"
        ) from e
    rows = gathered.view(world, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    differing = [i for i, name in enumerate(names) if len({row[i] for row in rows}) > 1]
    shown = {**{"numel": t.numel(), "dtype": t.dtype}, **fields}
    described = ", ".join(f"{names[i]}={_describe(names[i], rows, i)}" for i in differing)
    raise DisagreementError(
        f"cgx2: the ranks of {operation} disagree on {described} (this rank "
        f"{dist.get_rank(group)}: " + ", ".join(f"{names[i]}={shown[names[i]]}" for i in differing)
        + "); every rank must call it with the same tensor size, dtype and arguments"
    )  # fmt: skip


def _code(value: object) -> int:
    """A value as one int64: ints as themselves, anything else by a CRC of its text."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value in _WORDS:
        return _WORDS[value]
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return value
    return zlib.crc32(repr(value).encode())


def _describe(name: str, rows: list[list[int]], i: int) -> str:
    """``name``'s value on each rank, as the ranks' codes show it (dtypes and texts by code)."""
    codes = [row[i] for row in rows]
    if name == "dtype":
        by_code = {code: str(dtype).removeprefix("torch.") for dtype, code in _DTYPES.items()}
        codes = [by_code.get(c, "other") for c in codes]
    elif name == "reduce_op":
        codes = [{code: word for word, code in _WORDS.items()}.get(c, c) for c in codes]
    return "[" + ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes)) + "]"
