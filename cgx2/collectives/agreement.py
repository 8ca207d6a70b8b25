"""That the ranks of a collective agree on what it is: before any of its bytes move, each rank
shares a few integers (size, dtype, bits, bucket, op, route) and every rank raises if any differ.

Ranks that disagree would otherwise hang in different collectives until the group's timeout, or
worse, exchange payloads of equal size and return wrong values without an error (gloo aborts
the process on payloads of different sizes). The exchange cannot itself hang on a
disagreement: values compared on the host go to every peer over the group's peer sockets
(:mod:`cgx2.comm.peers`: one message a peer), or where those cannot be made through the
group's c10d store (each rank's values pushed to its peers' queues, or in larger groups a key a
rank and call); values compared on a GPU by an all-gather of a few dozen bytes, the same
whatever the arguments (BENCHMARKS.md, "The agreement check"). Whether it runs, and how, is the
policy's choice (:class:`.policy.Route`'s ``check``); the entry points users call run it (the
ops, the ``cgx`` backend). Each call also compares the fingerprint of the settings its route was
decided under (every variable that changes the bytes); only where those differ do the ranks
exchange the settings themselves, to name them. DDP's and FSDP's hooks, whose wrappers make
every rank's buckets alike, compare their settings once, at their first call
(:func:`check_settings`).

Read at once (``check``), the answer costs the caller a wait for the GPU's queue where the
all-gather runs on it (NCCL). Deferred (``check(..., deferred=True)``), the ranks' values are
compared on the device in stream order: the caller gets a flag to poison its result with
(:func:`settle`: NaN on every rank), and :class:`DisagreementError` is raised as soon as the
answer reaches the host, at the latest by the next checked call on the group.
"""

from __future__ import annotations

import json
import struct
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import config
from ..codecs.rotation import ROTATIONS
from ..comm import all_gather_single, group_info, group_state, group_store, peers
from ..comm import store as stored

if TYPE_CHECKING:
    from .policy import Route

__all__ = ["DisagreementError", "check", "check_settings", "raise_pending", "settle"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_WORDS = {"sum": 0, "avg": 1}  # reduce ops: shown by name in the message


class DisagreementError(RuntimeError):
    """The ranks of one collective were called with different arguments."""


@dataclass
class _Pending:
    """A deferred check whose answer is on its way to the host."""

    rows: torch.Tensor  # [world, fields] int64 on the host (pinned where copied from a GPU)
    ready: torch.cuda.Event  # recorded after the copy
    names: list[str]
    shown: dict[str, object]
    operation: str
    rank: int


# Guards each group's sequence of checks and deferred answers (its GroupState's agreement_*):
# a hook's worker and the caller may check on one group. Held for no wait.
_LOCK = threading.Lock()


def check(
    group: dist.ProcessGroup,
    operation: str,
    t: torch.Tensor,
    fields: dict[str, int | str | bool | float | Sequence | None],
    *,
    deferred: bool = False,
    route: Route | None = None,
) -> torch.Tensor | None:
    """Raise :class:`DisagreementError` on every rank of ``group`` unless all called
    ``operation`` with the same ``t.numel()``, ``t.dtype`` and ``fields`` (named values; the
    message names those that differ, rank by rank).

    ``route`` (the call's, :func:`.policy.route`): the settings it was decided under are
    compared too, by their fingerprint and ``CGX2_CROSSOVER_BYTES``; where the fingerprints
    differ, a second exchange names the variables that differ.

    ``deferred`` (CUDA float tensors; others are checked at once): don't wait for the answer.
    Returns a 0-dim bool tensor on ``t``'s GPU, True where every rank agreed: pass it to
    :func:`settle` with the call's result. The error is raised by :func:`raise_pending`
    (``settle`` and every later check on the group call it) once the answer has reached the
    host. Returns None when checked at once, or not at all (inside a CUDA graph's capture)."""
    raise_pending(group)
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # a captured graph replays its collectives without the host: none to compare
    if route is not None:
        crossover = config.crossover_override()
        fields = {
            **fields,
            CROSSOVER: -1 if crossover is None else crossover,
            SETTINGS: route.fingerprint,
        }
    # Only an answer that lands on a GPU is worth not waiting for; only floats take NaN.
    deferred = deferred and t.is_cuda and t.is_floating_point()
    names = ["numel", "dtype", *fields]
    values = [t.numel(), _DTYPES.get(t.dtype, 99)]
    values += [v if type(v) is int else _as_int64(v) for v in fields.values()]
    on_gpu = t.is_cuda and (deferred or dist.get_backend(group) == "nccl")
    device = t.device if on_gpu else torch.device("cpu")
    info = group_info(group)
    world, rank = info.size, info.rank
    shown = {"numel": t.numel(), "dtype": t.dtype, **fields}
    if route is not None:
        shown[SETTINGS] = route.settings
    store = None if on_gpu or world > STORE_MAX_RANKS else group_store(group)
    found = _share(group, operation, values, store, device, world, rank)
    if isinstance(found, list):  # exchanged on the host
        rows: list = found
    elif not deferred:
        rows = found.tolist()
    else:
        agreed = (found == found[0]).all()
        copied = found.to("cpu", non_blocking=True)  # the host's copy arrives in stream order
        ready = torch.cuda.Event()
        ready.record()
        pending = _Pending(
            rows=copied, ready=ready, names=names, shown=shown, operation=operation, rank=rank
        )
        with _LOCK:
            group_state(group).agreement_pending.append(pending)
        return agreed
    if route is not None and _differ_in(rows, names.index(SETTINGS)):
        # Every rank sees the same rows, so all make this second exchange: each rank's settings.
        blob = route.settings.encode()[:_SETTINGS_BYTES].ljust(_SETTINGS_BYTES, b" ")
        packed = list(struct.unpack(f"<{_SETTINGS_BYTES // 8}q", blob))
        theirs = _share(group, operation + "'s settings", packed, store, device, world, rank)
        theirs = theirs if isinstance(theirs, list) else theirs.tolist()
        shown[SETTINGS] = [_settings_of(row) for row in theirs]
    _raise_if_different(rows, names, shown, operation, rank)
    return None


def check_settings(
    group: dist.ProcessGroup, operation: str, settings: Mapping[str, object], device: torch.device
) -> None:
    """Raise :class:`DisagreementError` on every rank of ``group`` unless all hold the same
    ``settings`` (named values: what changes the bytes of ``operation``) and the same
    variables that change them (:func:`cgx2.config.wire_settings`, ``CGX2_CROSSOVER_BYTES``);
    the message names each that differs, rank by rank. One exchange of a few KiB, on the host
    as :func:`check`'s (on ``device`` where it is a GPU of an NCCL group): for entry points
    whose calls are alike once their settings are (DDP's hooks, FSDP's collectives), at their
    first call, which every rank makes."""
    found = {**settings, **config.wire_settings(), CROSSOVER: config.crossover_override()}
    text = json.dumps({k: _compact(v) for k, v in found.items()}, separators=(",", ":"))
    blob = text.encode()[:_HOOK_SETTINGS_BYTES].ljust(_HOOK_SETTINGS_BYTES, b" ")
    values = list(struct.unpack(f"<{_HOOK_SETTINGS_BYTES // 8}q", blob))
    info = group_info(group)
    world, rank = info.size, info.rank
    on_gpu = device.type == "cuda" and dist.get_backend(group) == "nccl"
    store = None if on_gpu or world > STORE_MAX_RANKS else group_store(group)
    rows = _share(
        group, operation, values, store, device if on_gpu else torch.device("cpu"), world, rank
    )
    if isinstance(rows, list):
        called = [name for name, _ in rows]
        if len(set(called)) > 1:
            _raise_if_different(rows, [], {}, operation, rank)  # names the collectives
    else:
        rows = rows.tolist()
    everyone = [_settings_of(row) for row in rows]
    if all(found == everyone[0] for found in everyone):
        return
    described, mine = _settings_differing(everyone, rank)
    raise DisagreementError(
        f"cgx2: the ranks of {operation} disagree on {described} (this rank {rank}: {mine}); "
        "every rank must use the same settings"
    )


def _compact(value: object) -> object:
    """``value`` as JSON holds it (others by their text); a long one by its CRC, so that the
    settings fit :data:`_HOOK_SETTINGS_BYTES`."""
    if isinstance(value, torch.dtype | torch.device):
        value = str(value)
    elif isinstance(value, tuple):
        value = list(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = json.dumps(repr(value))
    if len(text) > 64:
        return f"crc32 {zlib.crc32(text.encode()):08x}"
    return json.loads(text)


_HOOK_SETTINGS_BYTES = 4096  # check_settings' message: a fixed size, for all-gathers too


CROSSOVER = "CGX2_CROSSOVER_BYTES"
"""The field of :func:`check` for the crossover in force (-1: ``auto``), read at every call."""
SETTINGS = "settings"
"""The field of :func:`check` for the fingerprint of a route's settings (:class:`.policy.Route`)."""
_SETTINGS_BYTES = 2048  # each rank's settings in the second exchange: a fixed size for GPUs too


def _share(
    group: dist.ProcessGroup,
    operation: str,
    values: list[int],
    store: dist.Store | None,
    device: torch.device,
    world: int,
    rank: int,
) -> list[tuple[str, list[int]]] | torch.Tensor:
    """Every rank's ``values``: on the host (``store`` given: :func:`_exchange_on_host`), or
    by an all-gather on ``device`` (a ``[world, len(values)]`` tensor there)."""
    try:
        if store is not None:
            return _exchange_on_host(store, group, operation, values, world, rank)
        gathered = torch.empty(world * len(values), dtype=torch.int64, device=device)
        all_gather_single(gathered, _int64_on(device, values, group), group=group)
        return gathered.view(world, -1)
    except DisagreementError:
        raise
    except RuntimeError as e:  # a peer died or stalled before the call
        raise RuntimeError(
            f"cgx2: the ranks of {operation} could not compare their arguments (this is rank "
            f"{rank}): {e}"
        ) from e


def _differ_in(rows: list, column: int) -> bool:
    """Whether the ranks' ``rows`` (as :func:`_share` gives them, on the host) differ in
    ``column``, where they called the same collective with as many values."""
    if rows and isinstance(rows[0], tuple):
        if len({name for name, _ in rows}) > 1 or len({len(row) for _, row in rows}) > 1:
            return False  # different collectives: named as such
        rows = [row for _, row in rows]
    return len({row[column] for row in rows}) > 1


def _settings_of(row: list[int] | tuple[str, list[int]]) -> dict[str, object]:
    """A rank's settings from the second exchange's values."""
    values = row[1] if isinstance(row, tuple) else row
    text = struct.pack(f"<{len(values)}q", *values).decode(errors="replace").rstrip()
    try:
        found = json.loads(text)
    except ValueError:
        return {"settings": text}
    return found if isinstance(found, dict) else {"settings": text}


def settle(
    agreed: torch.Tensor | None, result: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """``result`` of a call checked with ``deferred=True`` (``agreed``, its answer), made NaN
    in place where the ranks disagreed (on every rank alike: they all hold the same answer),
    then :func:`raise_pending`. Returns ``result``; nothing to do where ``agreed`` is None."""
    if agreed is None:
        return result
    result.masked_fill_(agreed.logical_not(), float("nan"))
    raise_pending(group)
    return result


def raise_pending(group: dist.ProcessGroup) -> None:
    """Raise :class:`DisagreementError` for the oldest deferred check on ``group`` whose answer
    has reached the host and shows ranks that disagree; forget those that agreed. Never waits."""
    pending = group_state(group).agreement_pending
    with _LOCK:
        done = []
        while pending and pending[0].ready.query():
            done.append(pending.popleft())
    for p in done:
        _raise_if_different(p.rows.tolist(), p.names, p.shown, p.operation, p.rank)


def _int64_on(device: torch.device, values: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``values`` as int64 on ``device``; to a GPU through pinned memory, so that the host does
    not wait for the GPU's queue (a copy from pageable memory would). A GPU's copy is kept with
    ``group``'s state, by the stream it was made on, and read again by the calls that check the
    same values on that stream (nothing writes it), rather than copied again by every call."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    kept = group_state(group).agreement_values
    key = (device, torch.cuda.current_stream(device).cuda_stream, *values)
    found = kept.get(key)
    if found is None:
        if len(kept) >= _KEPT_VALUES:
            kept.clear()
        found = kept[key] = (
            torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        )
    return found


_KEPT_VALUES = 64
"""The most values :func:`_int64_on` keeps for a group (a group's calls check a few)."""


STORE_MAX_RANKS = 16
"""Groups up to this size compare on the host, over peer sockets (a connection between every two
ranks) or through the store (whose load grows as the square of the ranks: each reads every
rank's values); larger groups all-gather instead."""

QUEUE_MAX_RANKS = 4
"""Groups up to this size exchange through the store's queues, one pop a peer; larger ones
through keys, whose three round trips (delete, wait, read) do not grow with the ranks."""


def _exchange_on_host(
    store: dist.Store,
    group: dist.ProcessGroup,
    operation: str,
    values: list[int],
    world: int,
    rank: int,
) -> list[tuple[str, list[int]]]:
    """Every rank's ``(operation, values)`` of this call on ``group``, by rank: through the
    group's peer sockets where its ranks could make them, else its store; waiting up to the
    group's timeout."""
    state = group_state(group)
    with _LOCK:
        n = next(state.agreement_calls)
    mine = operation.encode() + b"\0" + struct.pack(f"<{len(values)}q", *values)
    sockets = peers.connected(group)
    if sockets is not None:
        found = _values_by_rank(sockets.exchange(_with_call_number(n, rank, mine)), n, rank)
    else:
        # Asked, never waited for in the store: its client is the process's one, which other
        # threads' calls on other groups may need meanwhile (:mod:`cgx2.comm.store`).
        wait_s = group_info(group).timeout_s
        if world <= QUEUE_MAX_RANKS and hasattr(store, "queue_push"):
            early = state.agreement_early  # a peer's entries of a later call, popped early
            found = _through_queues(store, n, mine, world, rank, wait_s, early)
        else:
            found = _through_keys(store, n, mine, world, rank, wait_s)
    exchanged = []
    for raw in found:
        name, _, packed = raw.partition(b"\0")
        exchanged.append((name.decode(), list(struct.unpack(f"<{len(packed) // 8}q", packed))))
    return exchanged


def _with_call_number(n: int, rank: int, mine: bytes) -> bytes:
    return struct.pack("<qq", n, rank) + mine


def _values_by_rank(entries: list[bytes], n: int, rank: int) -> list[bytes]:
    """The ranks' values from ``entries`` made by :func:`_with_call_number` (any order), by
    rank; every rank raises where some peer's call number is not ``n``, as each sees the same
    entries."""
    found: list[bytes] = [b""] * len(entries)
    behind = []
    for raw in entries:
        their_n, peer = struct.unpack_from("<qq", raw)
        found[peer] = raw[16:]
        if their_n != n:
            behind.append(f"rank {peer} at call {their_n}")
    if behind:
        raise DisagreementError(
            f"cgx2: the ranks have made different numbers of checked collectives on one group "
            f"({', '.join(behind)}; this rank {rank} at call {n}); every rank must make the "
            "same calls in the same order"
        )
    return found


def _through_queues(
    store: dist.Store,
    n: int,
    mine: bytes,
    world: int,
    rank: int,
    wait_s: float | None,
    early: dict[int, bytes] | None = None,
) -> list[bytes]:
    """Each rank pushes ``mine`` (with its rank and call number) to every peer's queue and pops
    one entry a peer from its own: a round trip a peer, and nothing left behind. A peer is a
    call ahead only where call n ended in a disagreement (every rank raises, no collective
    waits for the slowest): its entry for n + 1 can come before a slower peer's for n, and
    waits in ``early`` (kept by the caller, a group's) for this rank's next call."""
    early = {} if early is None else early
    entry = _with_call_number(n, rank, mine)
    for peer in range(world):
        if peer != rank:
            store.queue_push(f"cgx2/agree/to/{peer}", entry)
    key = f"cgx2/agree/to/{rank}"
    found = {rank: entry, **early}
    early.clear()
    while len(found) < world:
        raw = stored.pop(store, key, wait_s) if wait_s is not None else store.queue_pop(key)
        peer = struct.unpack_from("<qq", raw)[1]
        if peer in found:  # its next call's: each pusher's entries come in order
            early[peer] = raw
        else:
            found[peer] = raw
    return _values_by_rank(list(found.values()), n, rank)


def _through_keys(
    store: dist.Store, n: int, mine: bytes, world: int, rank: int, wait_s: float | None
) -> list[bytes]:
    """Each rank sets its key of call n, then reads all ranks' keys of call n. Before that it
    deletes its key of call n - 2: every peer has read it, since each has set its key of call
    n - 1, read at call n - 1 here."""
    if n >= 2:
        store.delete_key(f"cgx2/agree/{n - 2}/{rank}")
    store.set(f"cgx2/agree/{n}/{rank}", mine)
    keys = [f"cgx2/agree/{n}/{r}" for r in range(world)]
    if wait_s is not None:
        stored.wait(store, keys, wait_s)
    return store.multi_get(keys)


def _raise_if_different(
    rows: list[list[int]] | list[tuple[str, list[int]]],
    names: list[str],
    shown: dict[str, object],
    operation: str,
    rank: int,
) -> None:
    if all(row == rows[0] for row in rows):
        return
    if isinstance(rows[0], tuple):  # through the store: which collective each rank called
        called = [name for name, _ in rows]
        if len(set(called)) > 1 or len({len(row) for _, row in rows}) > 1:
            ranks = ", ".join(f"rank {r}: {name}" for r, name in enumerate(called))
            raise DisagreementError(
                f"cgx2: the ranks call different collectives on one group ({ranks}; this "
                f"rank {rank}: {operation}); every rank must make the same calls in the same "
                "order"
            )
        rows = [row for _, row in rows]
    differing = [i for i, name in enumerate(names) if len({row[i] for row in rows}) > 1]
    described = [f"{names[i]}={_describe(names[i], rows, i)}" for i in differing]
    mine = [f"{names[i]}={_as_shown(names[i], shown[names[i]])}" for i in differing]
    tail = "tensor size, dtype and arguments"
    if SETTINGS in names and names.index(SETTINGS) in differing:
        at = [names[i] for i in differing].index(SETTINGS)
        described[at], mine[at] = _settings_differing(shown[SETTINGS], rank)
        tail += " under the same settings (cgx2.config.WIRE_SETTINGS' variables)"
    if CROSSOVER in names and names.index(CROSSOVER) in differing:
        tail += " under the same settings"
    raise DisagreementError(
        f"cgx2: the ranks of {operation} disagree on {', '.join(described)} (this rank {rank}: "
        f"{', '.join(mine)}); every rank must call it with the same {tail}"
    )


def _settings_differing(settings: str | list[dict[str, object]], rank: int) -> tuple[str, str]:
    """The settings that differ, rank by rank, and this rank's, from every rank's (a list), or
    where only this rank's are known (a deferred check: its JSON), what can be said."""
    if isinstance(settings, str):  # each rank's message shows its own: compare them
        return "the settings their routes were decided under", f"settings={settings}"
    keys = list(dict.fromkeys(k for found in settings for k in found))
    differ = [k for k in keys if len({json.dumps(found.get(k)) for found in settings}) > 1]
    described = ", ".join(
        f"{k}=["
        + ", ".join(f"rank {r}: {_as_shown(k, found.get(k))}" for r, found in enumerate(settings))
        + "]"
        for k in differ
    )
    return described, ", ".join(f"{k}={_as_shown(k, settings[rank].get(k))}" for k in differ)


def _as_shown(name: str, value: object) -> object:
    """``value`` of field ``name`` as the message shows it: ``auto`` for a variable left to
    cgx2 (None, or -1 for the crossover)."""
    if name.startswith("CGX2_") and (value is None or (name == CROSSOVER and value == -1)):
        return "auto"
    return value


def _as_int64(value: object) -> int:
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
    elif name == CROSSOVER:
        codes = [_as_shown(name, c) for c in codes]
    elif name == "rotation":  # a name or None, compared by its CRC: shown by name
        by_code = {_as_int64(v): v for v in (None, *ROTATIONS)}
        codes = [by_code.get(c, c) for c in codes]
    return "[" + ", ".join(f"rank {r}: {c}" for r, c in enumerate(codes)) + "]"
