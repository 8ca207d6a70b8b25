"""The rotated max-min codec in the collectives: the name users pass (``rotation="hadamard"``),
checked before any byte moves, and each call's rotation keys, the same on every rank.

A collective's rotation of pipeline piece (or width group) ``i`` takes the signs of
``derive_key(seed, STAGE_ROTATION, i)``: the call's seed and the piece, never the rank, so every
rank rotates a chunk alike and the owners can sum rotated values (docs/wire-format.md,
"Rotation"). A CUDA graph's replay derives the same keys on the device from the seed it reads.
"""

from __future__ import annotations

import functools

import torch

from ..codecs.rotation import DEFAULT_BLOCK, ROTATIONS, Rotation, rotation_for
from ..seeding import derive_key, extend_key

__all__ = [
    "DEFAULT_BLOCK",
    "STAGE_ROTATION",
    "call_rotation",
    "check_rotation",
    "rotation_key",
    "rotation_of",
]

STAGE_ROTATION = 4
"""The key path of the rotations' signs (after :data:`.allreduce.STAGE_SCATTER` = 1,
:data:`.allreduce.STAGE_GATHER` = 2, and 3, the ring's and the reduce-scatter's streams)."""


def check_rotation(
    rotation: str | None,
    block: int,
    bucket_size: int,
    name: str = "rotation",
    block_name: str = "rotation_block",
) -> str | None:
    """``rotation`` normalised (None or ``"none"``: None), or a ``TypeError``/``ValueError``
    naming the argument (``name``, ``block_name``): a name of
    :data:`~cgx2.codecs.rotation.ROTATIONS`, and a block (a power of two, 2 or more) that
    divides ``bucket_size``. Every rank passes the same arguments, so every rank raises the
    same error, before anything is sent."""
    if rotation is not None and not isinstance(rotation, str):
        raise TypeError(f"{name} must be a str or None, got {type(rotation).__name__}")
    if rotation is None or rotation == "none":
        rotation = None
    elif rotation not in ROTATIONS:
        raise ValueError(f"{name} must be None, 'none' or one of {ROTATIONS}, got {rotation!r}")
    try:
        checked = Rotation(key=0, block=block)
        if rotation is not None:
            checked.check(bucket_size)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{block_name}: {e}") from None
    return rotation


def call_rotation(rotation: str | None, block: int, bucket_size: int) -> Rotation | None:
    """The call's rotation that ``rotation`` names, checked as :func:`check_rotation` checks
    it: None, or a :class:`~cgx2.codecs.rotation.Rotation` of ``block`` whose key goes unused
    (each piece's signs are the seed's and the piece's: :func:`rotation_of`). One object a
    name and block, so that two calls' settings rotated alike compare equal."""
    name = check_rotation(rotation, block, bucket_size)
    return None if name is None else _named(name, block)


@functools.lru_cache(maxsize=64)
def _named(name: str, block: int) -> Rotation | None:
    return rotation_for(name, 0, block)


def rotation_key(seed: int) -> int:
    """The key every piece's key extends: ``derive_key(seed, STAGE_ROTATION)``, once a call."""
    return derive_key(seed, STAGE_ROTATION)


def rotation_of(
    rotation: Rotation | None, key: int | torch.Tensor, index: int | None = None
) -> Rotation | None:
    """Piece ``index``'s rotation of the call's ``rotation`` (None: none), its block and the
    piece's signs: ``key`` is :func:`rotation_key`'s, extended here by ``index``; or, with
    ``index`` None, the piece's key itself (an int64 tensor on the device, for a CUDA graph)."""
    if rotation is None:
        return None
    if index is not None:
        key = extend_key(key, index)
    return Rotation(key=key, block=rotation.block, clipped=rotation.clipped)
