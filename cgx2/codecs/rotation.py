"""The randomized Hadamard rotation of the rotated max-min codec, in plain torch: it defines the
rotated values bit for bit (docs/wire-format.md, "Rotation"), which the C loops and kernels repeat.

A payload's values are cut into blocks of ``block`` (a power of two) from index 0; each whole
block is multiplied by random signs, transformed by a fast Walsh-Hadamard transform and scaled
by ``fp32(1/sqrt(block))``: an orthogonal map, its own inverse up to the order of the signs.
The trailing ``n % block`` values are left as they are (the payload's size does not change).

Signs: value i takes bit ``i & 31`` of word ``(i >> 5) & 3`` of Philox4x32-10 at counter
``(g_lo, g_hi, 0x48414441, 0x524F5441)``, ``g = i >> 7``, under the rotation's own 64-bit key
(:mod:`.philox`); a set bit is -1. Every operation is one IEEE fp32 operation, in the order
written (no fused multiply-add), and every NaN out is 0x7FC00000, so implementations agree.
On CPU tensors the loops run as C (:mod:`.native`) where the extension is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import native
from .philox import philox4x32

__all__ = [
    "DEFAULT_BLOCK",
    "ROTATIONS",
    "Rotation",
    "hadamard_rotate",
    "hadamard_unrotate",
    "rotation_for",
    "rotation_scale",
    "rotation_signs",
]

DEFAULT_BLOCK = 128
"""Values a block: divides every power-of-two bucket size from 128 up (the default is 512)."""

ROTATIONS = ("hadamard", "hadamard-clipped")
"""The rotations a caller may name (``rotation=`` on the entry points); None is none.
``"hadamard-clipped"``: the same rotation, each bucket's range clipped to its middle and the
levels rounded to the nearest (:attr:`Rotation.clipped`)."""

SIGN_GROUP = 128
"""Values whose signs one Philox call gives (its 128 bits), whatever the block."""

# Counter words 2 and 3 of the signs' Philox calls ("HADA", "ROTA"): stochastic rounding's
# counters hold a bucket index's high half and a stream there, so the two never share a
# counter even under one key.
_SIGN_C2, _SIGN_C3 = 0x48414441, 0x524F5441
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


@dataclass(frozen=True, eq=False)
class Rotation:
    """A randomized Hadamard rotation: blocks of ``block`` values (a power of two, 2 or more,
    dividing the bucket size), signs from ``key`` (a 64-bit int, or a one-element int64 tensor
    on the data's device where the kernels read it). Every rank of a collective must pass the
    same key: unlike stochastic rounding's, it does not depend on the rank.

    ``clipped``: the rotated values are coded in the middle of each bucket's range
    (:func:`cgx2.codecs.maxmin.clip_fraction` of it), values beyond it taking its ends, and
    rounded to the nearest level, not stochastically (``rotation="hadamard-clipped"``)."""

    key: int | torch.Tensor
    block: int = DEFAULT_BLOCK
    clipped: bool = False

    def __post_init__(self) -> None:
        block = self.block
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"rotation block must be an int, got {type(block).__name__}")
        if block < 2 or block & (block - 1):
            raise ValueError(f"rotation block must be a power of two, 2 or more, got {block}")
        key = self.key
        if isinstance(key, torch.Tensor):
            if key.dtype != torch.int64 or key.numel() != 1:
                raise ValueError("a rotation key tensor must hold one int64")
        elif isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"rotation key must be an int, got {type(key).__name__}")

    def check(self, bucket_size: int) -> None:
        """Raise ValueError unless the blocks tile every bucket (none straddles two)."""
        if bucket_size % self.block:
            raise ValueError(
                f"rotation block {self.block} must divide bucket_size {bucket_size}: "
                "a block may not straddle buckets"
            )

    @property
    def name(self) -> str:
        """The name a caller gives this rotation (``rotation=``; :func:`rotation_for`)."""
        return "hadamard-clipped" if self.clipped else "hadamard"

    def key_int(self) -> int:
        """The key as a Python int (a tensor's is read: a device synchronization on CUDA)."""
        key = self.key
        return (int(key.item()) if isinstance(key, torch.Tensor) else key) & _M64


def rotation_for(
    name: str | None, key: int | torch.Tensor, block: int = DEFAULT_BLOCK
) -> Rotation | None:
    """The rotation an entry point's ``rotation=`` names (None: none), with its signs' key."""
    if name is None:
        return None
    if name not in ROTATIONS:
        raise ValueError(f"rotation must be None or one of {ROTATIONS}, got {name!r}")
    return Rotation(key=key, block=block, clipped=name == "hadamard-clipped")


def rotation_scale(block: int) -> float:
    """``fp32(1/sqrt(block))``, computed in float64 and rounded once, as a Python float."""
    return torch.tensor(1.0 / math.sqrt(block), dtype=torch.float64).float().item()


def rotation_signs(key: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """The signs of values 0..n-1 (fp32, +-1) under ``key`` (see the module doc)."""
    groups = -(-n // SIGN_GROUP)
    g = torch.arange(groups, dtype=torch.int64, device=device)
    c2 = torch.full_like(g, _SIGN_C2)
    c3 = torch.full_like(g, _SIGN_C3)
    words = torch.stack(philox4x32(g & _M32, g >> 32, c2, c3, key & _M64), dim=1)  # [groups, 4]
    shifts = torch.arange(32, dtype=torch.int64, device=device)
    bits = (words[:, :, None] >> shifts) & 1  # value 32 w + b of a group: bit b of word w
    return (1 - 2 * bits).reshape(-1)[:n].to(torch.float32)


def _butterflies(t: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform of each row of ``[nb, B]``: stages h = 1, 2,
    ..., B/2, each pairing j (with j & h == 0) and j + h into (a + b, a - b)."""
    nb, block = t.shape
    h = 1
    while h < block:
        v = t.view(nb, block // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        t = torch.stack([a + b, a - b], dim=2).view(nb, block)
        h *= 2
    return t


def _rotation(
    x: torch.Tensor, key: int, block: int, inverse: bool, out: torch.Tensor | None
) -> torch.Tensor:
    v = x.reshape(-1).to(torch.float32)
    n = v.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=v.device)
    elif out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 tensor of {n} values")
    out = out.view(-1)
    scale = rotation_scale(block)
    if native.rotate(v, out, block, key & _M64, scale, inverse):
        return out
    whole = n - n % block
    nb = whole // block
    rotated = v.new_empty(0)
    if nb:
        rows = v[:whole].view(nb, block)
        signs = rotation_signs(key, whole, v.device).view(nb, block)
        if inverse:
            rotated = (_butterflies(rows) * scale) * signs
        else:
            rotated = _butterflies(rows * signs) * scale
    tail = v[whole:].clone()  # before out is written: out may be x itself
    if nb:
        out[:whole] = rotated.view(-1)
    out[whole:] = tail
    return out.masked_fill_(out.isnan(), math.nan)  # 0x7FC00000: the same NaN everywhere


def hadamard_rotate(
    x: torch.Tensor,
    key: int | torch.Tensor,
    block: int = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flat ``x`` (any float dtype, computed in fp32) rotated: fp32, a new tensor or ``out``
    (contiguous fp32 of ``x.numel()`` values; it may be ``x`` itself)."""
    rotation = Rotation(key=key, block=block)
    return _rotation(x, rotation.key_int(), block, False, out)


def hadamard_unrotate(
    y: torch.Tensor,
    key: int | torch.Tensor,
    block: int = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`hadamard_rotate` (up to fp32 rounding): per whole block the same
    butterflies on ``y``, times the scale, times the signs. fp32, new or into ``out``."""
    rotation = Rotation(key=key, block=block)
    return _rotation(y, rotation.key_int(), block, True, out)
