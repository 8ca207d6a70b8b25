"""Seeds for stochastic rounding: a per-process stream of call seeds and key derivation.

Every quantization draws its random numbers from Philox keyed by a 64-bit key derived here, so
the same seed gives the same bytes on every device, every rank and every run.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["derive_key", "extend_key", "get_state", "manual_seed", "next_seed", "set_state"]

_MASK64 = (1 << 64) - 1
_lock = threading.Lock()
_generator: torch.Generator | None = None


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


def manual_seed(seed: int) -> None:
    """Restart cgx2's stream of call seeds (used when an op is called without ``seed``)."""
    global _generator
    with _lock:
        _generator = torch.Generator().manual_seed(seed)


def next_seed() -> int:
    """The next 63-bit call seed. The stream starts from ``torch.initial_seed()`` unless
    :func:`manual_seed` was called, so ``torch.manual_seed`` makes runs reproducible without
    cgx2 consuming numbers from torch's own generator."""
    global _generator
    with _lock:
        if _generator is None:
            _generator = torch.Generator().manual_seed(torch.initial_seed())
        return int(torch.randint(0, 2**63 - 1, (), generator=_generator, dtype=torch.int64))


def get_state() -> torch.Tensor:
    """The stream's state (a ``ByteTensor``), for checkpoints: :func:`set_state` resumes it."""
    global _generator
    with _lock:
        if _generator is None:
            _generator = torch.Generator().manual_seed(torch.initial_seed())
        return _generator.get_state()


def set_state(state: torch.Tensor) -> None:
    """Resume the stream from :func:`get_state`'s value."""
    global _generator
    with _lock:
        generator = torch.Generator()
        generator.set_state(state)
        _generator = generator
