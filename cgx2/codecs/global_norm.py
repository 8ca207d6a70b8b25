"""Global-norm linear codecs (Global-QSGD's standard dithering, THC, QSGD): a value g becomes
the integer level ``floor(g * L / norm + u)``, u uniform in [0, 1), and decodes to
``level * norm / L``; torch reference, runs on any device.

With one ``norm`` shared by every rank (the maximum of ``|g|`` over the group), the levels of
W ranks add up exactly in one integer all-reduce: :func:`level_dtype` is the narrowest integer
that holds the sum, and :func:`pack_offset_levels` packs levels offset by L into 4-bit fields
(with :mod:`.packing`) whose byte-wise sums never carry, halving an int8 wire. Stochastic
rounding makes the codes unbiased: E[level] = g L / norm. Exponential dithering, the other
global-norm codec, is in :mod:`.exponential`.
"""

from __future__ import annotations

import torch

from .packing import pack_stream, unpack_stream

__all__ = [
    "average_rows",
    "dequantize",
    "level_dtype",
    "levels_per_side",
    "offset_levels",
    "pack_offset_levels",
    "quantize",
    "rounding_uniforms",
    "unpack_offset_sums",
]

INT_DTYPES = (torch.int8, torch.int32)  # neither NCCL nor gloo reduces int16
OFFSET_BITS = 4  # the packed wire's field width


def level_dtype(levels: int, world: int) -> torch.dtype:
    """The narrowest signed integer dtype holding any sum of ``world`` values in
    [-levels, levels]."""
    for dtype in INT_DTYPES:
        if world * levels <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"{world} ranks x {levels} levels overflow int32")


def levels_per_side(bits: int | None, world: int) -> int:
    """L for ``bits``-bit signed levels, 2**(bits-1) - 1; ``bits`` None keeps Global-QSGD's
    int8 wire: floor(127 / W), so that the sum of W ranks' levels fits int8."""
    if bits is None:
        levels = 127 // world
        if levels < 1:
            raise ValueError(f"int8 levels cannot be shared by {world} ranks: pass bits")
        return levels
    return 2 ** (bits - 1) - 1


def offset_levels(world: int, bits: int = OFFSET_BITS) -> int:
    """L for the packed wire: W fields of level + L (each 0..2L) add up to at most
    2LW <= 2**bits - 1, so a byte-wise sum never carries from one field into the next.
    ``ValueError`` (raised before any collective, so every rank raises alike) for too many
    ranks."""
    top = (1 << bits) - 1
    levels = top // (2 * world)
    if levels < 1:
        raise ValueError(
            f"packed {bits}-bit levels cannot be summed over W={world} ranks: the field sum "
            f"2LW must stay within {top}, so W <= {top // 2}; use int8 or wider levels"
        )
    return levels


def rounding_uniforms(like: torch.Tensor, key: int) -> torch.Tensor:
    """Uniform [0, 1) fp32 of ``like``'s shape and device, from torch's generator seeded with
    ``key >> 1`` (a 64-bit key; the generator takes 63 bits)."""
    g = torch.Generator(device=like.device)
    g.manual_seed(key >> 1)
    return torch.rand(like.shape, generator=g, device=like.device, dtype=torch.float32)


def quantize(
    g: torch.Tensor, norm: torch.Tensor, levels: int, key: int, dtype: torch.dtype
) -> torch.Tensor:
    """``floor(g * fp32(L / norm) + u)`` in ``dtype``, clamped to [-L, L] (``g * L / norm`` can
    round a hair past L); 0 everywhere when ``norm`` is 0. ``u`` is
    :func:`rounding_uniforms` of ``key``. ``norm`` is a one-element fp32 tensor."""
    scale = torch.where(norm > 0, levels / norm, torch.zeros_like(norm))
    x = g.float() * scale
    return torch.floor(x + rounding_uniforms(x, key)).clamp_(-levels, levels).to(dtype)


def dequantize(q: torch.Tensor, norm: torch.Tensor, levels: int, ranks: int = 1) -> torch.Tensor:
    """fp32 ``q * norm / (L * ranks)``: one rank's values (``ranks`` 1), or the average of
    ``ranks`` ranks' values from the sum of their levels."""
    return q.float() * (norm / (levels * ranks))


def average_rows(rows: torch.Tensor, norms: torch.Tensor, levels: int) -> torch.Tensor:
    """The average over the rows of ``[W, n]`` levels, row w quantized against ``norms[w]``
    (QSGD's own norms): fp32, summed in row order."""
    return (rows.float() * (norms / levels).unsqueeze(1)).sum(0) / rows.shape[0]


def pack_offset_levels(q: torch.Tensor, levels: int, bits: int = OFFSET_BITS) -> torch.Tensor:
    """Levels in [-L, L] (any shape, read flat) as fields level + L of ``bits`` bits in
    :mod:`.packing`'s stream (at 4 bits: two a byte, the even position in the low nibble);
    an odd count ends with a zero field. ``uint8`` SUM all-reduces add them field by field."""
    return pack_stream(q.reshape(-1).to(torch.int32) + levels, bits)


def unpack_offset_sums(
    packed: torch.Tensor, numel: int, levels: int, world: int, bits: int = OFFSET_BITS
) -> torch.Tensor:
    """The sums of ``world`` ranks' levels from their summed :func:`pack_offset_levels`
    fields, as int32: each field minus ``world * L``."""
    return unpack_stream(packed, bits, numel).to(torch.int32) - world * levels
