"""Host buffers kept from one call for the next: the CPU path's payloads and sums.

A large CPU tensor freshly allocated is fresh pages from the OS, each faulted in on first touch
(BENCHMARKS.md, "CPU"); a buffer kept is touched already. GPU memory has torch's caching
allocator, so there :func:`take` is ``torch.empty`` and :func:`give` does nothing.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

__all__ = ["MAX_BYTES", "MIN_BYTES", "cached_bytes", "clear", "give", "take"]

MAX_BYTES = 1 << 30
"""Bytes kept at most; beyond, the buffers given back longest ago go back to the allocator."""

MIN_BYTES = 1 << 20
"""Buffers below this size are not kept: small allocations come from the allocator's own
arenas, already touched."""

_lock = threading.Lock()
_free: OrderedDict[tuple[torch.dtype, int], list[torch.Tensor]] = OrderedDict()
_bytes = 0


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``numel`` values: on the CPU one given back
    earlier where one of this size and dtype is kept, else a new one. It is the caller's alone
    until given back."""
    global _bytes
    if device.type == "cpu" and numel * dtype.itemsize >= MIN_BYTES:
        with _lock:
            kept = _free.get((dtype, numel))
            if kept:
                _bytes -= numel * dtype.itemsize
                t = kept.pop()
                if not kept:
                    del _free[dtype, numel]
                return t
    return torch.empty(numel, dtype=dtype, device=device)


def give(*tensors: torch.Tensor | None) -> None:
    """Keep ``tensors`` (from :func:`take`, or any whole contiguous CPU tensor) for a later
    :func:`take`: the caller must not use them again, nor may any collective still in flight."""
    global _bytes
    for t in tensors:
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or nbytes > MAX_BYTES or t.storage_offset() != 0:
            continue
        if t.untyped_storage().nbytes() != nbytes:  # a view of a larger buffer
            continue
        with _lock:
            _free.setdefault((t.dtype, t.numel()), []).append(t.view(-1))
            _free.move_to_end((t.dtype, t.numel()))
            _bytes += nbytes
            while _bytes > MAX_BYTES:
                key, kept = next(iter(_free.items()))
                _bytes -= kept.pop(0).numel() * key[0].itemsize
                if not kept:
                    del _free[key]


def cached_bytes() -> int:
    """Bytes kept now."""
    return _bytes


def clear() -> None:
    """Drop every kept buffer."""
    global _bytes
    with _lock:
        _free.clear()
        _bytes = 0


def _after_fork() -> None:
    # The parent's lock may have been held by one of its threads, which the child lacks.
    global _lock, _bytes
    _lock = threading.Lock()
    _free.clear()
    _bytes = 0


os.register_at_fork(after_in_child=_after_fork)
