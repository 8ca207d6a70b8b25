"""The bit packer: b-bit levels into bytes, the one wire format of every codec's levels.

Level j of a row occupies bits ``[j*b, (j+1)*b)`` of a little-endian bit stream: group g of
eight levels l[0..7] forms w = sum(l[k] << (b*k)), stored as the b low bytes of w, least
significant first, so every b in 1..8 packs with no waste. :func:`pack_levels` pads a row to
whole groups (max-min buckets, see ``layout``); :func:`pack_stream` keeps only the bytes that
hold levels (Global-QSGD's nibbles). The Triton kernels (``maxmin_triton._pack_store``) and
the C++ loops (``csrc/maxmin_codec.cc``) write this format too; tests hold their bytes to these
functions.
"""

from __future__ import annotations

import torch

__all__ = ["pack_levels", "pack_stream", "stream_nbytes", "unpack_levels", "unpack_stream"]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, m]`` integer levels in [0, 2**bits) -> ``[rows, ceil(m/8)*bits]`` uint8."""
    _check_bits(bits)
    rows, m = levels.shape
    groups = -(-m // 8)
    if 8 % bits == 0:  # whole fields per byte: pack in uint8, no 64-bit words
        per_byte = 8 // bits
        padded = levels.new_zeros(rows, groups * 8, dtype=torch.uint8)
        padded[:, :m] = levels
        fields = padded.view(rows, groups * bits, per_byte)
        packed = fields[..., 0].clone()
        for k in range(1, per_byte):
            packed |= fields[..., k] << (bits * k)
        return packed
    padded = levels.new_zeros(rows, groups * 8, dtype=torch.int64)
    padded[:, :m] = levels
    shifts = torch.arange(8, device=levels.device, dtype=torch.int64) * bits
    words = (padded.view(rows, groups, 8) << shifts).sum(dim=-1)  # disjoint bits: sum == or
    byte_shifts = torch.arange(bits, device=levels.device, dtype=torch.int64) * 8
    packed = (words[..., None] >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(rows, groups * bits)


def unpack_levels(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_levels`: ``[rows, ceil(m/8)*bits]`` uint8 -> ``[rows, m]`` int64."""
    _check_bits(bits)
    rows = packed.shape[0]
    groups = -(-m // 8)
    if 8 % bits == 0:
        mask = (1 << bits) - 1
        fields = [(packed >> (bits * k)) & mask for k in range(8 // bits)]
        levels = torch.stack(fields, dim=-1).reshape(rows, groups * 8)
        return levels[:, :m].to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(rows, groups, bits).to(torch.int64) << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    levels = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return levels.reshape(rows, groups * 8)[:, :m]


def stream_nbytes(numel: int, bits: int) -> int:
    """Bytes of :func:`pack_stream`'s output: ``ceil(numel * bits / 8)``."""
    return -(-numel * bits // 8)


def pack_stream(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels in [0, 2**bits) (any shape, read flat) -> 1-D uint8 of
    :func:`stream_nbytes` bytes: :func:`pack_levels`'s bytes of one row, cut after the last
    byte that holds a level (the bits past the last level are zero)."""
    flat = levels.reshape(1, -1)
    return pack_levels(flat, bits).view(-1)[: stream_nbytes(flat.shape[1], bits)]


def unpack_stream(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_stream`: the first ``numel`` levels of 1-D uint8 ``packed``
    (of at least :func:`stream_nbytes` bytes) as int64."""
    nbytes = stream_nbytes(numel, bits)
    if packed.dim() != 1 or packed.numel() < nbytes:
        raise ValueError(f"packed must be 1-D uint8 of at least {nbytes} bytes for {numel} levels")
    whole = -(-numel // 8) * bits
    row = packed.new_zeros(whole)
    row[:nbytes] = packed[:nbytes]
    return unpack_levels(row.view(1, whole), bits, numel).view(-1)
