"""Max-min (CGX/QSGD) codec, plain-torch reference: it defines the exact bytes. A
:class:`~cgx2.codecs.base.Codec`, as are its Triton kernels (:mod:`.maxmin_triton`).

Per bucket of B values (computed in fp32): ``min``, ``max``, ``step = (max - min) / L`` with
``L = 2**bits - 1``, and ``scale = L / (max - min)`` rounded toward zero (0 when max == min),
so that ``a = (v - min) * scale`` never exceeds L and needs no clamp (where L / (max - min)
overflows fp32, ``a = (v * 2**64 - min * 2**64) * scale`` with ``scale = L / (max * 2**64 -
min * 2**64)``: products with a power of two are exact, and the levels stay unbiased). A value
v gets level ``floor(a + h * 2**-F)``, exactly (the sum is not rounded), where h is a 16-bit random
integer from :mod:`.philox` and F = 16 (15 for 8 bits, h's top 15 bits: fp32 holds a < 256
to 2**-15 only); it decodes to ``min + step * level``. Each operation is one IEEE fp32
operation (no fused multiply-add), so the Triton kernels reproduce the bytes exactly. A
bucket holding NaN or +-Inf stores min = step = NaN (0x7FC00000) and decodes to NaN:
non-finite input is never clipped into finite numbers. A bucket of finite values whose
max - min overflows fp32 is coded at half scale: it stores min/2 and -(max/2 - min/2) / L, its
levels come from ``a = (v/2 - min/2) * scale``, and it decodes to ``(min/2 + |step| * level)
* 2``. Where the top level would decode past FLT_MAX, the step is an ulp or two smaller:
finite values decode to finite ones. Zeros are stored as +0.0. A reduced chunk's bucket
(:func:`decode_sum_encode`) whose sum overflowed to +-Inf is coded saturated, at half scale:
+-Inf take the end levels, which decode to +-Inf, and finite values the levels between,
which decode to finite ones (``_saturated_params``; docs/wire-format.md).
With ``rotation`` (:class:`~.rotation.Rotation`), every function codes the randomized Hadamard
rotation of the values and decodes through its inverse (docs/wire-format.md, "Rotation").
The byte layout is in :mod:`.layout`. Runs on any device; used on the CPU and in tests. On
CPU tensors the per-bucket loops of encode and decode run as C (:mod:`.native`) where a
compiler builds it; these torch lines stay the definition, which tests hold the C to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import scratch
from . import native
from .layout import ChunkedLayout, MaxMinLayout
from .packing import pack_levels, unpack_levels
from .philox import bucket_halves
from .rotation import Rotation, hadamard_rotate, hadamard_unrotate

__all__ = [
    "chunked_layout",
    "decode",
    "decode_chunks",
    "decode_sum",
    "decode_sum_encode",
    "encode",
    "encode_chunks",
]

_NAN = float("nan")  # stored as 0x7FC00000, the kernels' NaN too


def _new_payload(nbytes: int, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of at least {nbytes} bytes")
    return out


def _bucket_rows(v: torch.Tensor, layout: MaxMinLayout) -> tuple[torch.Tensor, int]:
    """``[nq, B]`` view of the quantized part; an incomplete last bucket is padded with its own
    first value, which leaves its min and max unchanged. Returns rows and the valid count."""
    nq, bsz = layout.num_buckets, layout.bucket_size
    covered = min(layout.numel, nq * bsz)
    if covered == nq * bsz:
        return (v if covered == v.numel() else v[:covered]).view(nq, bsz), covered
    rows = torch.empty(nq * bsz, dtype=v.dtype, device=v.device)
    rows[:covered] = v[:covered]
    rows[covered:] = v[(nq - 1) * bsz]
    return rows.view(nq, bsz), covered


def encode(
    x: torch.Tensor,
    bits: int,
    bucket_size: int,
    key: int,
    stream: int = 0,
    skip_incomplete: bool = False,
    out: torch.Tensor | None = None,
    nearest: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Quantize flat ``x`` (any float dtype) into a uint8 payload (see :mod:`.layout`).

    ``nearest``: round each level to the nearest (``h`` fixed at half of ``2**F``: ties up)
    instead of stochastically; ``key`` and ``stream`` are then unused. Within half a step,
    biased: for values read as they are (weights), not summed (gradients). ``rotation``: the
    payload of the rotated values."""
    rotated = None if rotation is None else _rotated(x, rotation, bucket_size)
    values = x if rotated is None else rotated
    layout = MaxMinLayout.of(values.numel(), bits, bucket_size, skip_incomplete)
    clip = _clip_of(rotation, bits)
    payload, _ = _encode(values, layout, key, stream, out, nearest or clip < 1.0, clip=clip)
    if rotated is not None:
        scratch.give(rotated)
    return payload


def _rotated(x: torch.Tensor, rotation: Rotation, bucket_size: int) -> torch.Tensor:
    """``x`` rotated, in fp32, in a buffer of :mod:`cgx2.scratch` (the caller gives it back)."""
    rotation.check(bucket_size)
    out = scratch.take(x.numel(), torch.float32, x.device)
    return hadamard_rotate(x, rotation.key, rotation.block, out=out)


def _unrotate_into(values: torch.Tensor, rotation: Rotation, out: torch.Tensor) -> None:
    """The inverse rotation of fp32 ``values`` (overwritten) written into ``out``, any float
    dtype (cast as :func:`_cast`)."""
    hadamard_unrotate(values, rotation.key, rotation.block, out=values)
    if out.data_ptr() == values.data_ptr() and out.dtype == torch.float32:
        return
    out.copy_(values if out.dtype == torch.float32 else _cast(values, out.dtype))


def _encode(
    x: torch.Tensor,
    layout: MaxMinLayout,
    key: int,
    stream: int,
    out: torch.Tensor | None,
    nearest: bool = False,
    saturate: bool = False,
    clip: float = 1.0,
) -> tuple[torch.Tensor, bool]:
    """:func:`encode` of ``x`` in ``layout`` (its size), and whether a bucket was coded
    saturated; ``saturate``: a bucket of finite values and +-Inf (no NaN) is a sum that
    overflowed, coded saturated (see the module doc) rather than as NaN. ``clip`` below 1:
    each bucket of finite values coded in the middle of its range (:func:`_clipped`)."""
    bits, bucket_size = layout.bits, layout.bucket_size
    # Each of reshape and to is a dispatch even where it returns x: a flat fp32 x needs neither.
    flat32 = x.dtype == torch.float32 and x.dim() == 1
    v = x if flat32 else x.reshape(-1).to(torch.float32)
    payload = _new_payload(layout.nbytes, v.device, out)
    nq, levels_at = layout.num_buckets, layout.levels_offset
    if layout.raw_numel:
        raw = v[nq * bucket_size :]
        payload[layout.raw_offset : layout.raw_offset + 4 * raw.numel()] = raw.view(torch.uint8)
    if nq == 0:
        return payload, False
    rows, covered = _bucket_rows(v, layout)
    nbytes = layout.levels_nbytes
    if not nearest or clip < 1.0:  # the C loops: stochastic, or the clipped rotation's coding
        meta, levels = payload[: 8 * nq], payload[levels_at : levels_at + nbytes]
        count = native.encode_rows(
            rows, bits, key, stream, covered, meta, levels, saturate, fp32_scalar(clip), nearest
        )
        if count is not None:
            return payload, count > 0
    lmax = float((1 << bits) - 1)
    # + 0.0 turns -0.0 into +0.0: which zero min/max pick differs between devices. A NaN
    # counts as -inf in the min, so any non-finite value makes the span non-finite.
    lo = torch.where(torch.isnan(rows), -torch.inf, rows).amin(dim=1) + 0.0
    hi = rows.amax(dim=1) + 0.0
    if clip < 1.0:
        rows, lo, hi = _clipped(rows, lo, hi, clip)
    span = hi - lo
    # Finite ends whose span overflows fp32 are coded at half scale, where it is finite; a
    # negative step marks such a bucket. Any NaN or +-Inf value leaves the span non-finite.
    halved = torch.isfinite(lo) & torch.isfinite(hi) & torch.isinf(span)
    finite = (span < torch.inf) | halved
    # Tensor / tensor: CUDA divides by a Python scalar as a multiply by its reciprocal.
    lmax_t = torch.full_like(span, lmax)
    # A span so small that lmax / span overflows fp32: the differences are scaled by 2**64
    # first (exactly), else the scale would clamp at FLT_MAX and the levels lean to the min.
    positive = finite & (span > 0)
    tiny = positive & ~halved & torch.isinf(lmax_t / span)
    pre = torch.where(halved, 0.5, torch.where(tiny, 2.0**64, 1.0))
    lo_p = lo * pre  # exact, as is every product with pre
    span_p = hi * pre - lo_p
    step = torch.where(halved, -(span_p / lmax_t), torch.where(finite, span / lmax_t, _NAN))
    stored_lo = torch.where(halved, lo_p, torch.where(finite, lo, _NAN))
    step = _finite_top(stored_lo, step, lmax_t)
    scale = torch.where(positive, scale_toward_zero(lmax_t, span_p), 0.0)
    a = torch.where(finite[:, None], (rows * pre[:, None] - lo_p[:, None]) * scale[:, None], 0.0)
    saturated = False
    if saturate:
        # NaN-free (hi not NaN) with an infinite end: +-Inf from a sum, not from the input. One
        # bit cannot tell -Inf, +Inf and finite apart: such a bucket stays NaN.
        sat = ~finite & ~torch.isnan(hi)
        if bits == 1:
            sat &= ~((lo == -torch.inf) & (hi == torch.inf))
        saturated = bool(sat.any())
        if saturated:
            m, s, sat_scale, a_lo, a_hi = _saturated_params(lo, hi, lmax_t, bits)
            stored_lo = torch.where(sat, m, stored_lo)
            step = torch.where(sat, -s, step)
            sat_a = (rows * 0.5 - m[:, None]) * sat_scale[:, None]
            sat_a = sat_a.clamp(a_lo[:, None], a_hi[:, None])
            # +-Inf take the end levels, exactly.
            sat_a = torch.where(rows == -torch.inf, 0.0, sat_a)
            sat_a = torch.where(rows == torch.inf, lmax, sat_a)
            a = torch.where(sat[:, None], sat_a, a)
    # a * 2**F < 2**23 is exact in fp32, and so are its floor and the integer sum.
    frac = random_fraction_bits(bits)
    if nearest:
        h = torch.tensor(1 << (frac - 1), dtype=torch.int64, device=v.device)
    else:
        h = bucket_halves(key, nq, bucket_size, stream, v.device) >> (16 - frac)
    level = (torch.floor(a * 2.0**frac).to(torch.int64) + h) >> frac  # 0 where a is 0: h < 2**F
    if covered < nq * bucket_size:
        level.view(-1)[covered:] = 0
    payload[: 8 * nq] = torch.stack([stored_lo, step], dim=1).reshape(-1).view(torch.uint8)
    payload[levels_at : levels_at + nbytes] = pack_levels(level, bits).reshape(-1)[:nbytes]
    return payload, saturated


def clip_fraction(bits: int) -> float:
    """The fraction of a bucket's range that ``rotation="hadamard-clipped"`` codes at ``bits``:
    ``max(1/2, 1 - 2**(1 - bits))``. Rotated values are near Gaussian, their bucket's range
    some six standard deviations wide: fewer levels over its middle err less in all, tails
    clipped included (docs/wire-format.md, "Clipped rotation")."""
    return max(0.5, 1.0 - 2.0 ** (1 - bits))


def _clip_of(rotation: Rotation | None, bits: int) -> float:
    """The fraction of each bucket's range that ``rotation`` codes (1: all of it)."""
    return clip_fraction(bits) if rotation is not None and rotation.clipped else 1.0


def _clipped(
    rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each bucket of finite ends narrowed to ``[max(lo, mid - r), min(hi, mid + r)]``, ``mid =
    lo/2 + hi/2``, ``r = (hi/2 - lo/2) * fp32(clip)`` (halves first: no overflow), its values
    clamped into it; a bucket holding NaN or +-Inf as it was."""
    ends = torch.isfinite(lo) & torch.isfinite(hi)
    mid = lo * 0.5 + hi * 0.5
    reach = (hi * 0.5 - lo * 0.5) * fp32_scalar(clip)
    lo = torch.where(ends, torch.maximum(lo, mid - reach), lo)
    hi = torch.where(ends, torch.minimum(hi, mid + reach), hi)
    inside = torch.minimum(torch.maximum(rows, lo[:, None]), hi[:, None])
    return torch.where(ends[:, None], inside, rows), lo, hi


# Powers of two of the saturated coding (module doc): its decoded range ends at +-2**128.
_TWO_127, _TWO_126, _TWO_106 = 2.0**127, 2.0**126, 2.0**106
# Steps moved by an ulp at most this many times to meet an end's condition: two were always
# enough in tests of millions of ranges; the rest is margin.
_NUDGES = 4


def _finite_top(stored_lo: torch.Tensor, step: torch.Tensor, lmax: torch.Tensor) -> torch.Tensor:
    """``step`` made smaller by an ulp, ``_NUDGES`` times at most, where the top level would
    decode past FLT_MAX (a range ending near it): finite values decode to finite ones."""
    for _ in range(_NUDGES):
        top = (stored_lo + step.abs() * lmax) * torch.where(step < 0, 2.0, 1.0)
        step = torch.where(torch.isinf(top), torch.nextafter(step, torch.zeros_like(step)), step)
    return step


def _saturated_params(
    lo: torch.Tensor, hi: torch.Tensor, lmax: torch.Tensor, bits: int
) -> tuple[torch.Tensor, ...]:
    """A saturated bucket's stored min ``m`` and step ``s`` (decoded at half scale, ``(m + s *
    level) * 2``), the scale of its levels and the bounds ``[a_lo, a_hi]`` of its finite values'
    (see the module doc), from its min and max (one of them infinite)."""
    top, bottom = hi == torch.inf, lo == -torch.inf
    m = torch.minimum(lo * 0.5, torch.full_like(lo, _TWO_127 - ((1 << bits) - 1) * _TWO_106))
    if bits == 1:
        m = torch.maximum(m, torch.full_like(m, -_TWO_126))
    m = torch.where(bottom, -_TWO_127, m)
    s_up = ((_TWO_126 - m * 0.5) / lmax) * 2.0
    s_down = torch.maximum(((hi * 0.25 + _TWO_126) / lmax) * 2.0, torch.full_like(hi, _TWO_106))
    s = torch.where(top, s_up, s_down)
    for _ in range(_NUDGES):
        end = (m + s * lmax) * 2.0
        up = torch.nextafter(s, torch.full_like(s, torch.inf))
        down = torch.nextafter(s, torch.zeros_like(s))
        s = torch.where(~top & torch.isinf(end), down, s)
        s = torch.where(top & torch.isfinite(end), up, s)
    span_q = torch.where(top, _TWO_126, hi * 0.25) - m * 0.5
    sat_scale = torch.where(span_q > 0, scale_toward_zero(lmax * 0.5, span_q), 0.0)
    a_lo = torch.where(bottom, 1.0, 0.0)
    a_hi = torch.where(top, lmax - 1.0, lmax)
    return m, s, sat_scale, a_lo, a_hi


def scale_toward_zero(lmax: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """``lmax / span`` (fp32, span > 0) rounded toward zero: FLT_MAX where it overflows, and
    never so large that ``span * scale`` rounds above lmax. The round-to-nearest quotient is
    at most one step too large; fp64 holds the product of two fp32 numbers exactly."""
    q = lmax / span
    too_big = q.double() * span.double() > lmax.double()
    return torch.where(too_big, torch.nextafter(q, torch.zeros_like(q)), q)


def random_fraction_bits(bits: int) -> int:
    """How many bits of the random fraction a level is rounded with (see module doc)."""
    return 16 if bits <= 7 else 15


def _decode_values(
    payload: torch.Tensor,
    layout: MaxMinLayout,
    out: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
    factor: float | None = None,
) -> torch.Tensor:
    """The payload's values: a new fp32 tensor, or written into ``out`` (any float dtype,
    cast by :func:`_cast`); with ``base`` (fp32, which may be ``out``, itself fp32),
    ``base + value`` each: one row of a sum, in one pass. ``factor`` (an fp32 value, with
    ``base``) multiplies each value first, folded into its bucket's ``post`` (exactly: a power
    of two times it), so ``(min + |step| * level) * (post * factor)``."""
    nq, bsz = layout.num_buckets, layout.bucket_size
    if out is None:
        out = torch.empty(layout.numel, dtype=torch.float32, device=payload.device)
    covered = min(layout.numel, nq * bsz)

    def put(region: slice, values: torch.Tensor) -> None:
        if base is not None:
            torch.add(base[region], values, out=out[region])
        elif out.dtype == torch.float32:
            out[region] = values
        else:
            out[region] = _cast(values, out.dtype)

    if layout.raw_numel:
        raw = payload[layout.raw_offset : layout.raw_offset + 4 * layout.raw_numel]
        raw = raw.view(torch.float32)
        put(slice(covered, None), raw if factor is None else raw * factor)
    if nq == 0:
        return out
    meta = payload[: 8 * nq].view(torch.float32).view(nq, 2)
    levels_at = layout.levels_offset
    levels = payload[levels_at : levels_at + layout.levels_nbytes]
    if native.decode_rows(
        meta,
        levels,
        nq,
        bsz,
        layout.bits,
        out if covered == out.numel() else out[:covered],
        base if base is None or covered == base.numel() else base[:covered],
        1.0 if factor is None else factor,
    ):
        return out
    packed = torch.zeros(nq * layout.bucket_stride, dtype=torch.uint8, device=payload.device)
    packed[: layout.levels_nbytes] = levels
    level = unpack_levels(packed.view(nq, -1), layout.bits, bsz).to(torch.float32)
    step = meta[:, 1:]
    post = torch.where(step < 0, 2.0, 1.0)  # a half-scale bucket (see encode)
    if factor is not None:
        post = post * factor
    values = (meta[:, :1] + step.abs() * level) * post
    put(slice(None, covered), values.reshape(-1)[:covered])
    return out


def decode(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    bucket_size: int,
    dtype: torch.dtype = torch.float32,
    skip_incomplete: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode`: a flat tensor of ``numel`` values in ``dtype``."""
    layout = MaxMinLayout.of(numel, bits, bucket_size, skip_incomplete)
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    if rotation is None:
        return _decode_values(payload, layout, out)
    rotation.check(bucket_size)
    values = out if dtype == torch.float32 else scratch.take(numel, torch.float32, out.device)
    _unrotate_into(_decode_values(payload, layout, values), rotation, out)
    if values is not out:
        scratch.give(values)
    return out


def _cast(f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``f32`` in ``dtype``; a NaN becomes bf16's 0x7FC0, the NaN the kernels write, on every
    platform (torch's own cast varies: 2.13's CPU cast gives 0xFFFF)."""
    out = f32.to(dtype)
    if dtype == torch.bfloat16:
        out.view(torch.int16).masked_fill_(f32.isnan(), 0x7FC0)
    return out


def fp32_scalar(x: float) -> float:
    """``x`` rounded to fp32, as a Python float: an fp32 tensor times it gives the same bits as
    times an fp32 tensor, with no host-to-device copy (which would block on CUDA)."""
    return torch.tensor(x, dtype=torch.float32).item()


def sum_rows(
    payloads: torch.Tensor,
    numel: int,
    own: torch.Tensor | None,
    own_index: int,
    scale: float | None,
    add_row: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object],
) -> torch.Tensor:
    """``(own + sum of the other rows decoded) * scale`` in fp32, in row order: the one
    definition of the sum both codecs use. ``add_row(out, base, row)`` writes ``base`` plus
    the row decoded into ``out`` (``base`` may be ``out``)."""
    rows = [w for w in range(payloads.shape[0]) if w != own_index]
    if own is None:
        acc = scratch.take(numel, torch.float32, payloads.device).zero_()
    elif rows:  # own + the first row straight into acc: no copy of own first
        acc = scratch.take(numel, torch.float32, payloads.device)
        add_row(acc, own.reshape(-1).to(torch.float32), payloads[rows.pop(0)])
    else:
        acc = own.reshape(-1).to(torch.float32).clone()
    for w in rows:
        add_row(acc, acc, payloads[w])
    if scale is not None:
        acc *= fp32_scalar(scale)
    return acc


def decode_sum(
    payloads: torch.Tensor,
    numel: int,
    own: torch.Tensor | None,
    own_index: int,
    scale: float | None,
    bits: int,
    bucket_size: int,
    skip_incomplete: bool = False,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """``(own + sum of the other rows' decodings) * scale`` in fp32, summed in row order.

    ``payloads`` is ``[K, P]``; row ``own_index`` is not decoded (``own`` stands for it in full
    precision). ``scale`` None means 1 (SUM); AVG passes fp32(1/W). ``rotation``: the sum of
    ``own`` rotated and the rows, times ``scale``, rotated back.
    """
    layout = MaxMinLayout.of(numel, bits, bucket_size, skip_incomplete)
    own_r = own if rotation is None or own is None else _rotated(own, rotation, bucket_size)
    if rotation is not None:
        rotation.check(bucket_size)
    acc = sum_rows(
        payloads,
        numel,
        own_r,
        own_index,
        scale,
        lambda out, base, row: _decode_values(row, layout, out, base),
    )
    if rotation is not None:
        hadamard_unrotate(acc, rotation.key, rotation.block, out=acc)
        if own_r is not None:
            scratch.give(own_r)
    return acc


def decode_sum_encode(
    payloads: torch.Tensor,
    numel: int,
    own: torch.Tensor | None,
    own_index: int,
    scale: float | None,
    bits: int,
    bucket_size: int,
    key: int,
    stream: int = 0,
    skip_incomplete: bool = False,
    out: torch.Tensor | None = None,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Encode :func:`decode_sum` of the rows once more (the reduced chunk of the allreduce);
    with ``scale`` (AVG), each row's values times ``scale`` (own's too) summed instead, as the
    plain allreduce divides before it sums: a sum past FLT_MAX whose mean is not stays finite.
    A bucket of the sum that overflowed to +-Inf is coded saturated (see the module doc),
    unless ``own`` holds a non-finite value there: +-Inf of the input, which stays NaN.
    ``rotation``: ``own`` rotated stands for ``own``, and the sum, in the rotated domain, is
    encoded with no further rotation (the final decode rotates back)."""
    layout = MaxMinLayout.of(numel, bits, bucket_size, skip_incomplete)
    rotated = None
    if rotation is not None and own is not None:
        own = rotated = _rotated(own, rotation, bucket_size)
    elif rotation is not None:
        rotation.check(bucket_size)
    if scale is None:
        acc = decode_sum(payloads, numel, own, own_index, None, bits, bucket_size, skip_incomplete)
    else:
        acc = _scaled_sum(payloads, layout, own, own_index, fp32_scalar(scale))
    clip = _clip_of(rotation, bits)
    encoded, saturated = _encode(
        acc, layout, key, stream, out, nearest=clip < 1.0, saturate=True, clip=clip
    )
    scratch.give(acc)  # encoded: this sum is done with
    if own is not None and saturated:  # rare (an overflow): no check of the payload otherwise
        unsaturate_input(encoded, own, layout)
    if rotated is not None:
        scratch.give(rotated)
    return encoded


def _scaled_sum(
    payloads: torch.Tensor,
    layout: MaxMinLayout,
    own: torch.Tensor | None,
    own_index: int,
    factor: float,
) -> torch.Tensor:
    """``own * factor`` plus each other row's values times ``factor``, in fp32 in row order:
    as many passes as :func:`decode_sum` takes with its scale."""
    acc = scratch.take(layout.numel, torch.float32, payloads.device)
    if own is None:
        acc.zero_()
    else:
        torch.mul(own.reshape(-1).to(torch.float32), factor, out=acc)
    for w in range(payloads.shape[0]):
        if w != own_index:
            _decode_values(payloads[w], layout, acc, acc, factor)
    return acc


def saturated_buckets(payload: torch.Tensor, layout: MaxMinLayout) -> list[int]:
    """The buckets of ``payload`` coded saturated: an end level decodes to +-Inf, which no
    bucket of finite values does. A few reads of the (lo, step) pairs, no pass over values."""
    nq = layout.num_buckets
    if nq == 0:
        return []
    meta = payload[: 8 * nq].clone().view(torch.float32).view(nq, 2)  # clone: 4-byte aligned
    lo, step = meta[:, 0], meta[:, 1]
    negative = step < 0  # every saturated bucket is decoded at half scale
    if not bool(negative.any()):
        return []
    lmax = float((1 << layout.bits) - 1)
    ends = torch.isinf(lo * 2.0) | torch.isinf((lo + step.abs() * lmax) * 2.0)
    return (negative & ends).nonzero().flatten().tolist()


def unsaturate_input(payload: torch.Tensor, own: torch.Tensor, layout: MaxMinLayout) -> None:
    """Code as NaN (as :func:`encode` codes non-finite input) each saturated bucket of
    ``payload`` where ``own``, the values its sum started from, is not all finite."""
    flat, bsz, covered = own.reshape(-1), layout.bucket_size, layout.numel
    covered = min(covered, layout.num_buckets * bsz)
    stride, levels_at, end = layout.bucket_stride, layout.levels_offset, layout.levels_nbytes
    for q in saturated_buckets(payload, layout):
        if bool(torch.isfinite(flat[q * bsz : min((q + 1) * bsz, covered)]).all()):
            continue
        payload[8 * q : 8 * q + 8] = _NAN_PAIR.to(payload.device)
        payload[levels_at + q * stride : levels_at + min((q + 1) * stride, end)] = 0


_NAN_PAIR = torch.tensor([_NAN, _NAN], dtype=torch.float32).view(torch.uint8)


def chunked_layout(
    numel: int, num_chunks: int, bits: int, bucket_size: int, skip_incomplete: bool = False
) -> ChunkedLayout:
    """The payload layout of the chunked functions: :meth:`ChunkedLayout.split`."""
    return ChunkedLayout.split(numel, num_chunks, bits, bucket_size, skip_incomplete)


def encode_chunks(
    x: torch.Tensor,
    layout: ChunkedLayout,
    key: int,
    skip_chunk: int = -1,
    out: torch.Tensor | None = None,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Encode each chunk of flat ``x`` into row j of ``[K, P]`` with stream j; row
    ``skip_chunk`` is left zero (its owner keeps that chunk in full precision). Given ``out``
    (uint8 ``[K, P]``), the rows are written there and row ``skip_chunk`` is not touched.
    ``rotation``: each chunk rotated as a payload of its own (its values counted from 0)."""
    flat = x.reshape(-1)
    shape = (layout.num_chunks, layout.payload_nbytes)
    rows = torch.zeros(shape, dtype=torch.uint8, device=x.device) if out is None else out
    for j in range(layout.num_chunks):
        if j != skip_chunk and layout.chunk_size(j):
            start = layout.chunk_start(j)
            chunk = flat[start : start + layout.chunk_size(j)]
            encode(
                chunk,
                layout.bits,
                layout.bucket_size,
                key,
                j,
                layout.skip_incomplete,
                rows[j],
                rotation=rotation,
            )
    return rows


def decode_chunks(
    payloads: torch.Tensor,
    layout: ChunkedLayout,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    rotation: Rotation | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_chunks`: the flat tensor of ``layout.numel`` values (written
    into ``out``, a contiguous tensor of that size and ``dtype``, when given)."""
    if out is None:
        out = torch.empty(layout.numel, dtype=dtype, device=payloads.device)
    if rotation is not None:
        rotation.check(layout.bucket_size)
    for j in range(layout.num_chunks):
        size = layout.chunk_size(j)
        if not size:
            continue
        start = layout.chunk_start(j)
        target = out[start : start + size]
        if rotation is None:
            _decode_values(payloads[j], layout.chunk(j), target)
            continue
        values = target if out.dtype == torch.float32 else None
        if values is None:
            values = scratch.take(size, torch.float32, out.device)
        _unrotate_into(_decode_values(payloads[j], layout.chunk(j), values), rotation, target)
        if values is not target:
            scratch.give(values)
    return out
