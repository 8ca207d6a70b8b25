"""One collective call's settings as one value, :class:`CallSettings`: what the ops and entry
points check once and every layer below them (allreduce, pieces, ring, reduce-scatter) takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..codecs import Rotation
from .rotations import DEFAULT_BLOCK, call_rotation

__all__ = ["CallSettings"]


@dataclass(frozen=True, slots=True)
class CallSettings:
    """How one quantized collective codes what it sends; every rank passes the same.

    - ``bits``: 1..8, or 32 (sent plain); ``bucket_size``: values a bucket.
    - ``reduce_op``: ``"sum"`` or ``"avg"`` (the reduce-scatter's scale where none is given).
    - ``seed``: the call's random stream (None: the next of :mod:`cgx2.seeding`'s, drawn only
      by a call that compresses).
    - ``skip_incomplete``: a last incomplete bucket stays exact (the allreduce's, as CGX's).
    - ``rotation``: the randomized Hadamard rotation of each piece, in blocks of its
      ``block`` (None: none); its key goes unused, each piece's signs are the seed's and the
      piece's (:func:`.rotations.rotation_of`).

    The entry points check the values (:meth:`of` checks the rotation against the buckets).
    """

    bits: int
    bucket_size: int
    reduce_op: str = "sum"
    seed: int | None = None
    skip_incomplete: bool = False
    rotation: Rotation | None = None

    @classmethod
    def of(
        cls,
        bits: int,
        bucket_size: int,
        reduce_op: str = "sum",
        seed: int | None = None,
        skip_incomplete: bool = False,
        rotation: str | None = None,
        rotation_block: int = DEFAULT_BLOCK,
    ) -> CallSettings:
        """The settings of the arguments users pass: the rotation by name (``"hadamard"``;
        None or ``"none"``: none) and block, checked against ``bucket_size`` before anything
        is sent (:func:`.rotations.check_rotation`'s errors, naming the arguments). The same
        arguments give the same (immutable) settings: every eager call builds them, and a
        frozen dataclass's construction costs more than the rest of the call's checks."""
        args = (bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block)
        try:
            return _kept(*args)
        except TypeError:  # a traced seed (SymInt) does not hash
            return _build(*args)

    @property
    def rotation_name(self) -> str | None:
        """The rotation as users name it (``"hadamard"``, ``"hadamard-clipped"``), or None."""
        return None if self.rotation is None else self.rotation.name

    @property
    def rotation_block(self) -> int:
        """The rotation's block (:data:`DEFAULT_BLOCK` without one)."""
        return DEFAULT_BLOCK if self.rotation is None else self.rotation.block


def _build(
    bits: int,
    bucket_size: int,
    reduce_op: str,
    seed: int | None,
    skip_incomplete: bool,
    rotation: str | None,
    rotation_block: int,
) -> CallSettings:
    return CallSettings(
        bits=bits,
        bucket_size=bucket_size,
        reduce_op=reduce_op,
        seed=seed,
        skip_incomplete=skip_incomplete,
        rotation=call_rotation(rotation, rotation_block, bucket_size),
    )


KEPT_SETTINGS = 256
"""How many settings :meth:`CallSettings.of` keeps, the most recently asked for: the few a
program calls with (one that passes a fresh seed each call builds the rest)."""

# The process's, not a group's: settings are the values of a call's arguments alone.
_kept = functools.lru_cache(maxsize=KEPT_SETTINGS)(_build)
