"""The quantized reduce-scatter behind FSDP2's gradient reduction: each rank encodes the W−1
shards it does not own once, one ``all_to_all`` (an all-gather between two ranks:
:func:`.allreduce.exchange`), and each owner decodes and sums its shard in fp32 onto its own
(kept in full precision) — one quantization per value.

With per-segment widths (:mod:`.adaptive`), the compressed segments are grouped by width:
each group is encoded as its own chunked payload, the groups' payloads travel side by side in
one ``all_to_all``, and each group is decoded and summed on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checks import check_bits
from ..codecs import ChunkedLayout, maxmin_codec
from ..comm import group_size_and_rank
from ..seeding import derive_key, next_seed
from . import agreement, policy
from .allreduce import exchange
from .call_settings import CallSettings
from .fusion import fuse_padded, padded_numel
from .rotations import rotation_key, rotation_of

__all__ = ["Segment", "reduce_scatter", "width_groups"]

_STAGE_REDUCE_SCATTER = 3
Segment = tuple[int, int, bool]
"""(offset, numel, compressed) of one parameter's slice in every row of the input."""


def _split(segments: Sequence[Segment] | None, n: int) -> tuple[list[Segment], list[Segment]]:
    segments = list(segments) if segments else [(0, n, True)]
    if sum(k for _, k, _ in segments) != n:
        raise ValueError(f"segments cover {sum(k for _, k, _ in segments)} values of a row of {n}")
    return [s for s in segments if s[2]], [s for s in segments if not s[2]]


Group = tuple[int, tuple[Segment, ...]]
"""(bits, compressed segments) of one width group: its segments are fused and coded together."""


def width_groups(
    compressed: Sequence[Segment], bits: int, widths: Sequence[int] | None = None
) -> tuple[Group, ...]:
    """The compressed segments grouped by width, narrowest first (one group of ``bits`` when
    ``widths``, one per compressed segment in order, is None)."""
    if widths is None:
        return ((bits, tuple(compressed)),) if compressed else ()
    widths = [check_bits(b, "widths") for b in widths]
    if len(widths) != len(compressed):
        raise ValueError(f"{len(widths)} widths for {len(compressed)} compressed segments")
    if any(b > 8 for b in widths):
        raise ValueError(f"widths must be in 1..8, got {widths}")
    return tuple(
        (b, tuple(s for s, w in zip(compressed, widths, strict=True) if w == b))
        for b in sorted(set(widths))
    )


def _group_key(seed: int, rank: int, group: int) -> int:
    """Philox key of a rank's width group: the first (or only) group keeps the key of the
    uniform reduce-scatter, so one width gives the same bytes with or without ``widths``; the
    others get keys of their own, so their rounding is independent of the first's."""
    if group == 0:
        return derive_key(seed, _STAGE_REDUCE_SCATTER, rank)
    return derive_key(seed, _STAGE_REDUCE_SCATTER, rank, group)


class _FusedRows(NamedTuple):
    """Every row's compressed segments, each padded to whole buckets, rows one after another:
    chunk j of ``flat`` is row j."""

    flat: torch.Tensor
    starts: list[int]  # where each segment starts in a row
    width: int  # values in a row


def _fused_rows(rows: torch.Tensor, compressed: list[Segment], bucket_size: int) -> _FusedRows:
    fused = [fuse_padded([row[o : o + k] for o, k, _ in compressed], bucket_size) for row in rows]
    return _FusedRows(
        flat=torch.cat([f.buffer for f in fused]),
        starts=fused[0].starts,
        width=fused[0].buffer.numel(),
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    settings: CallSettings,
    scale: float | None = None,
    segments: Sequence[Segment] | None = None,
    widths: Sequence[int] | None = None,
    *,
    check_agreement: bool = False,
    error: torch.Tensor | None = None,
) -> int:
    """Reduce-scatter ``input`` (W rows of ``output.numel()``) into ``output``: the sum times
    ``scale`` (None: ``settings.reduce_op``'s, 1/W to average). ``widths`` gives one width
    (1..8) per compressed segment, in order (None: ``settings.bits`` for all). Segments marked
    uncompressed, and everything when compression does not pay (:mod:`.policy`), go through
    the plain reduce-scatter. Returns the bytes this rank sent. ``settings.skip_incomplete``
    is the allreduce's: here every bucket is coded.

    ``check_agreement``: where the route says so, first make sure every rank called alike
    (:mod:`.agreement`): for the op users call; FSDP's hook leaves it off.

    ``settings.rotation``: width group g is coded rotated, by the signs of (seed, rotation,
    g), the same on every rank (:mod:`.rotations`); each owner sums in the rotated domain and
    rotates its sum back.

    ``error`` (a contiguous tensor of ``input``'s shape and dtype), when given, receives
    ``input`` minus what the owners decode of this rank's rows, in the values' own domain
    (rotated back where rotated): zero on this rank's own row (kept exact), on the exact
    segments, and everywhere when nothing is quantized. Error feedback adds it to the next
    step's input."""
    if error is not None and (
        error.shape != input.shape or error.dtype != input.dtype or not error.is_contiguous()
    ):
        raise ValueError("error must be a contiguous tensor of the input's shape and dtype")
    bits, bucket_size = settings.bits, settings.bucket_size
    (world, rank), n = group_size_and_rank(group), output.numel()
    if scale is None and settings.reduce_op == "avg":
        scale = 1.0 / world
    rows = input.view(world, n)
    compressed, exact = _split(segments, n)
    groups = width_groups(compressed, bits, widths)
    padded = sum(padded_numel(k, bucket_size) for _, k, _ in compressed)
    route = policy.route(input, group, bits, bucket_size, world * padded)
    if compressed and not route.compress:
        compressed, exact, groups = [], [(0, n, False)], ()
    agreed = None
    if check_agreement and route.check:
        fields = {
            "bits": bits,
            "bucket_size": bucket_size,
            "scale": scale,
            "segments": segments,
            "widths": widths,
            "rotation": settings.rotation_name,
            "rotation_block": settings.rotation_block,
            "compressed": bool(compressed),
        }
        agreed = agreement.check(
            group,
            "quantized_reduce_scatter",
            input,
            fields,
            deferred=route.check == "deferred",
            route=route,
        )
    sent = 0
    if error is not None:
        error.zero_()
    plan = _plan(n, world, tuple(s for _, s in groups), tuple(exact), bucket_size, input.device)
    if compressed:
        seed = next_seed() if settings.seed is None else settings.seed
        # One gather builds every group's rows of padded segments, group after group: chunk
        # j of a group is row j.
        flat = input.index_select(0, plan.gather)
        codec = maxmin_codec(input.device)
        rotations = [
            rotation_of(settings.rotation, rotation_key(seed), g) for g in range(len(groups))
        ]
        parts, layouts, sends, at = [], [], [], 0
        for g, ((b, _), width) in enumerate(zip(groups, plan.widths, strict=True)):
            parts.append(flat[at : at + world * width])
            layouts.append(
                ChunkedLayout(
                    numel=world * width,
                    num_chunks=world,
                    chunk_numel=width,
                    bits=b,
                    bucket_size=bucket_size,
                )
            )
            key = _group_key(seed, rank, g)
            sends.append(
                codec.encode_chunks(
                    parts[-1], layouts[-1], key, skip_chunk=rank, rotation=rotations[g]
                )
            )
            at += world * width
        # The groups' payloads side by side, so one all_to_all carries them: row j of the
        # whole buffer goes to rank j.
        send = sends[0] if len(sends) == 1 else torch.cat(sends, dim=1)
        recv = torch.empty_like(send)
        # On the caller's stream: nothing runs beside the exchange, so an asynchronous one
        # would only add NCCL's stream switch and events (tens of microseconds a call).
        transport = route.transport
        try:
            transport.wait(
                exchange(recv, send, group, world, rank, route.pair_gather, False, transport)
            )
        except RuntimeError as e:  # a transport's error (a peer died or stalled): say where
            raise RuntimeError(
                f"cgx2: the quantized reduce-scatter of {input.numel()} values over {world} "
                f"ranks (this is rank {rank}) failed exchanging its chunks: {e}"
            ) from e
        if error is not None:
            _first_stage_error(error, flat, sends, layouts, rotations, plan, codec, rank)
        reduced, col = [], 0
        for (b, _), width, part, layout, rotated in zip(
            groups, plan.widths, parts, layouts, rotations, strict=True
        ):
            payloads = recv[:, col : col + layout.payload_nbytes]
            col += layout.payload_nbytes
            own = part[rank * width : (rank + 1) * width]
            reduced.append(
                codec.decode_sum(
                    payloads, width, own, rank, scale, b, bucket_size, rotation=rotated
                )
            )
        reduced = reduced[0] if len(reduced) == 1 else torch.cat(reduced)
        output.index_copy_(0, plan.out, reduced.index_select(0, plan.src).to(output.dtype))
        sent += (world - 1) * send.shape[1]
    if exact:
        part = rows.index_select(1, plan.exact)
        reduced = torch.empty(part.shape[1], dtype=output.dtype, device=output.device)
        route.transport.reduce_scatter_plain(reduced, part.reshape(-1), group)
        if scale is not None:
            reduced.mul_(scale)
        output.index_copy_(0, plan.exact, reduced)
        sent += (world - 1) * part.shape[1] * part.element_size()
    agreement.settle(agreed, output, group)
    return sent


def _first_stage_error(
    error: torch.Tensor,
    flat: torch.Tensor,
    sends: list[torch.Tensor],
    layouts: list[ChunkedLayout],
    rotations: list,
    plan: _Plan,
    codec: object,
    rank: int,
) -> None:
    """Write into ``error`` (zeroed) ``input`` minus the rows this rank sent as their owners
    decode them (rotated back: the values' own domain), at the compressed values' places in
    the input; this rank's own row (not sent) stays zero. Decoded while the rows travel."""
    decoded = torch.cat(
        [
            codec.decode_chunks(send, layout, torch.float32, rotation=rotated)
            for send, layout, rotated in zip(sends, layouts, rotations, strict=True)
        ]
    )
    fused_error = flat.float() - decoded  # in fp32, stored in the input's dtype
    for r, (fused_at, input_at) in enumerate(plan.real):
        if r != rank:
            error.view(-1).index_copy_(
                0, input_at, fused_error.index_select(0, fused_at).to(error.dtype)
            )


@dataclass(frozen=True)
class _Plan:
    """Index tensors that move a reduction's segments with one op each, made once per shape:
    ``gather`` builds every width group's fused rows from the flat input (group after group,
    each ``world * widths[g]`` values), ``src``/``out`` place the reduced compressed values
    (the groups' reduced rows concatenated), ``exact`` lists the uncompressed positions;
    ``real``, per row r, the fused positions of its compressed values (no padding) and their
    positions in the flat input (for the first stage's error)."""

    widths: tuple[int, ...]
    gather: torch.Tensor
    src: torch.Tensor
    out: torch.Tensor
    exact: torch.Tensor
    real: tuple[tuple[torch.Tensor, torch.Tensor], ...]


# A pure function's memo (the widths' segments), bounded: the same layers recur every step.
@functools.lru_cache(maxsize=256)
def _plan(
    n: int,
    world: int,
    groups: tuple[tuple[Segment, ...], ...],
    exact: tuple[Segment, ...],
    bucket_size: int,
    device: torch.device,
) -> _Plan:
    empty = torch.empty(0, dtype=torch.int64)
    gathers, src, out, widths, base = [], [], [], [], 0
    real_fused: list[list[torch.Tensor]] = [[] for _ in range(world)]
    real_input: list[list[torch.Tensor]] = [[] for _ in range(world)]
    fused_base = 0  # where the group's rows start in the fused input
    for compressed in groups:
        row, at = [], 0
        for o, k, _ in compressed:
            pad = -k % bucket_size
            row.append(torch.cat([torch.arange(o, o + k), torch.full((pad,), o + k - 1)]))
            src.append(torch.arange(base + at, base + at + k))
            out.append(torch.arange(o, o + k))
            at += k + pad
        row_index = torch.cat(row) if row else empty
        gathers.extend(row_index + r * n for r in range(world))
        real = torch.cat(src[len(src) - len(compressed) :]) - base if compressed else empty
        for r in range(world):
            real_fused[r].append(real + fused_base + r * at)
            real_input[r].append(torch.cat(out[len(out) - len(compressed) :]) + r * n)
        widths.append(at)
        base += at
        fused_base += world * at
    exact_index = torch.cat([torch.arange(o, o + k) for o, k, _ in exact]) if exact else empty
    cat = lambda parts: torch.cat(parts) if parts else empty
    return _Plan(
        widths=tuple(widths),
        gather=cat(gathers).to(device),
        src=cat(src).to(device),
        out=cat(out).to(device),
        exact=exact_index.to(device),
        real=tuple(
            (cat(fused).to(device), cat(inputs).to(device))
            for fused, inputs in zip(real_fused, real_input, strict=True)
        ),
    )
