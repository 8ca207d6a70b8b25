"""Bit packing of b-bit levels, 8 levels into b bytes (the reference; see ``layout``).

Levels of a bucket are padded to a multiple of 8 with zeros; group g's levels l[0..7] form
w = sum(l[k] << (b*k)), stored as the b low bytes of w, least significant first.
"""

from __future__ import annotations

import torch

__all__ = ["pack_levels", "unpack_levels"]


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, m]`` integer levels in [0, 2**bits) -> ``[rows, ceil(m/8)*bits]`` uint8."""
    rows, m = levels.shape
    groups = -(-m // 8)
    padded = levels.new_zeros(rows, groups * 8, dtype=torch.int64)
    padded[:, :m] = levels
    shifts = torch.arange(8, device=levels.device, dtype=torch.int64) * bits
    words = (padded.view(rows, groups, 8) << shifts).sum(dim=-1)  # disjoint bits: sum == or
    byte_shifts = torch.arange(bits, device=levels.device, dtype=torch.int64) * 8
    packed = (words[..., None] >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(rows, groups * bits)


def unpack_levels(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_levels`: ``[rows, ceil(m/8)*bits]`` uint8 -> ``[rows, m]`` int64."""
    rows = packed.shape[0]
    groups = -(-m // 8)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(rows, groups, bits).to(torch.int64) << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    levels = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return levels.reshape(rows, groups * 8)[:, :m]
