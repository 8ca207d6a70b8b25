"""Seeds for stochastic rounding: a per-process stream of call seeds and key derivation.

Every quantization draws its random numbers from Philox keyed by a 64-bit key derived here, so
the same seed gives the same bytes on every device, every rank and every run.
"""

from __future__ import annotations

import struct
import threading

import torch

__all__ = [
    "SEEDED_OP_TAGS",
    "call_seed",
    "derive_key",
    "extend_key",
    "get_state",
    "manual_seed",
    "next_seed",
    "set_state",
]

_MASK64 = (1 << 64) - 1
_lock = threading.Lock()

SEEDED_OP_TAGS: tuple[torch.Tag, ...] = (
    torch.Tag.nondeterministic_seeded,
    # A CUDA graph (torch.compile's "reduce-overhead") would replay the seed of its capture at
    # every step; so tagged, Inductor runs the op outside its graphs. Missing in old torch.
    *((torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()),
)
"""``torch.library`` tags of the ops that draw call seeds from this stream."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_key(seed: int, *ids: int) -> int:
    """A 64-bit Philox key for ``seed`` and a path of ids (stage, rank, ...); pure and cheap."""
    return extend_key(_splitmix64(seed & _MASK64), *ids)


def extend_key(key: int, *ids: int) -> int:
    """The key one path further: ``extend_key(derive_key(seed, *a), *b)`` is
    ``derive_key(seed, *a, *b)``, so a common prefix is derived once (per call, not per
    pipeline piece)."""
    for i in ids:
        key = _splitmix64(key ^ (i & _MASK64))
    return key & _MASK64


_GOLDEN = 0x9E3779B97F4A7C15
_stream: list[int] | None = None  # [start, calls drawn]


def _stream_state() -> list[int]:
    global _stream
    if _stream is None:
        _stream = [torch.initial_seed() & _MASK64, 0]
    return _stream


def manual_seed(seed: int) -> None:
    """Restart cgx2's stream of call seeds (used when an op is called without ``seed``)."""
    global _stream
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    with _lock:
        _stream = [seed & _MASK64, 0]


def call_seed(seed: int, k: int) -> int:
    """The seed of call ``k`` (from 0) after ``manual_seed(seed)``: SplitMix64's stream,
    ``splitmix64(seed + k * 0x9E3779B97F4A7C15) >> 1``, 63 bits: pure integer arithmetic,
    far cheaper on the host than drawing from a torch generator."""
    return _splitmix64((seed + k * _GOLDEN) & _MASK64) >> 1


def next_seed() -> int:
    """The next call seed (:func:`call_seed`). The stream starts from ``torch.initial_seed()``
    unless :func:`manual_seed` was called, so ``torch.manual_seed`` makes runs reproducible
    without cgx2 consuming numbers from torch's own generator."""
    with _lock:
        state = _stream_state()
        start, k = state
        state[1] = k + 1
    return call_seed(start, k)


def get_state() -> torch.Tensor:
    """The stream's state (16 bytes as a ``ByteTensor``), for checkpoints: :func:`set_state`
    resumes it."""
    with _lock:
        start, k = _stream_state()
    return torch.frombuffer(bytearray(struct.pack("<QQ", start, k)), dtype=torch.uint8)


def set_state(state: torch.Tensor) -> None:
    """Resume the stream from :func:`get_state`'s value."""
    global _stream
    if state.dtype != torch.uint8 or state.numel() != 16:
        raise ValueError(
            f"expected the 16-byte state from cgx2.seeding.get_state, got {state.numel()} "
            f"values of {state.dtype}"
        )
    start, k = struct.unpack("<QQ", bytes(state.cpu().tolist()))
    with _lock:
        _stream = [start, k]
