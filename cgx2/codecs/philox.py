"""Philox4x32-10 in plain torch: the random stream that stochastic rounding uses.

Values 8g..8g+7 of bucket q in stream s, under a 64-bit key, share one call of
Philox4x32-10(counter = (g, q_lo, q_hi, s), key = (key_lo, key_hi)): value 8g + 4i + 2k + h
takes the 16-bit half h (0 = low) of word 2k + i (the max-min codec adds it, as 16 fraction
bits, to a level before flooring). The Triton kernels compute the same words with the same
counters, so both produce the same bytes.
"""

from __future__ import annotations

import torch

__all__ = ["bucket_halves", "philox4x32"]

_M32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85


def _mulhilo(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * const`` for int64 tensors holding uint32 values,
    without overflowing int64 (the constant is split in 16-bit halves)."""
    p_lo = a * (const & 0xFFFF)  # < 2**48
    p_hi = a * (const >> 16)  # < 2**48
    low_sum = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (low_sum >> 32), low_sum & _M32


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, key: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ten Philox rounds on int64 tensors holding uint32 counters; returns the four words."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    for _ in range(10):
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def bucket_halves(
    key: int, num_buckets: int, bucket_size: int, stream: int = 0, device: torch.device = None
) -> torch.Tensor:
    """Uniform 16-bit integers (int64, in [0, 2**16)) of shape ``[num_buckets, bucket_size]``
    (see module doc)."""
    groups = -(-bucket_size // 8)
    q = torch.arange(num_buckets, dtype=torch.int64, device=device)[:, None]
    c0 = torch.arange(groups, dtype=torch.int64, device=device)[None, :].expand(num_buckets, -1)
    c1 = (q & _M32).expand(-1, groups)
    c2 = (q >> 32).expand(-1, groups)
    c3 = torch.full_like(c0, stream & _M32)
    r0, r1, r2, r3 = philox4x32(c0, c1, c2, c3, key)
    # The kernels' tl.join order: value 4i + 2k + h takes half h of word 2k + i.
    words = torch.stack([torch.stack([r0, r1], -1), torch.stack([r2, r3], -1)], -1)
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # [nq, groups, 2, 2, 2]
    return halves.reshape(num_buckets, groups * 8)[:, :bucket_size]
