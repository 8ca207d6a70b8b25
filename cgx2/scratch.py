"""Host buffers kept from one call for the next: the CPU path's payloads and sums, by size class,
never more than the buffers the program has had in use at once.

A large CPU tensor freshly allocated is fresh pages from the OS, each faulted in on first touch
(BENCHMARKS.md, "CPU"); a buffer kept is touched already. Sizes are rounded up to a class (four
an octave, a quarter at most unused), so that calls of sizes that vary still reuse what earlier
ones gave back; and what is kept never exceeds the peak of bytes taken and not yet given back,
the working set a reuse can serve: a program whose calls vary in size keeps no more than its
largest call needs. GPU memory has torch's caching allocator, so there :func:`take` is
``torch.empty`` and :func:`give` does nothing.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

__all__ = [
    "MAX_BYTES",
    "MIN_BYTES",
    "cached_bytes",
    "class_bytes",
    "clear",
    "give",
    "peak_bytes",
    "take",
]

MAX_BYTES = 1 << 30
"""Bytes kept at most, whatever the working set."""

MIN_BYTES = 1 << 20
"""Buffers below this size are not kept: small allocations come from the allocator's own
arenas, already touched."""

_lock = threading.Lock()
# Kept buffers (whole uint8 storages) by class, the class given back to longest ago first.
_free: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
_bytes = 0  # kept
_in_use = 0  # taken by size class and not given back yet
_peak = 0  # the most _in_use has been: what is kept never exceeds it


def class_bytes(nbytes: int) -> int:
    """The size class of ``nbytes``: the least ``m * 2**k`` (``m`` of 5 to 8) not below it."""
    if nbytes <= 8:
        return max(nbytes, 1)
    shift = (nbytes - 1).bit_length() - 3
    return -(-nbytes // (1 << shift)) << shift


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``numel`` values: on the CPU at the start of a
    buffer of its size class, one given back earlier where one is kept, else a new one. It is
    the caller's alone until given back."""
    global _bytes, _in_use, _peak
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    size = class_bytes(nbytes)
    with _lock:
        kept = _free.get(size)
        buffer = None
        if kept:
            buffer = kept.pop()
            _bytes -= size
            if not kept:
                del _free[size]
        _in_use += size
        _peak = max(_peak, _in_use)
    if buffer is None:
        buffer = torch.empty(size, dtype=torch.uint8)
    return buffer[:nbytes].view(dtype)


def give(*tensors: torch.Tensor | None) -> None:
    """Keep the buffers of ``tensors`` (each as :func:`take` returned it, reshaped at most) for
    a later :func:`take`: the caller must not use them again, nor may any collective still in
    flight. Others are left alone: GPU tensors, views into a buffer, and any tensor whose
    storage is not the size class of its bytes (it was not taken here)."""
    global _bytes, _in_use
    for t in tensors:
        if t is None or t.device.type != "cpu" or not t.is_contiguous():
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes < MIN_BYTES or t.storage_offset() != 0:
            continue
        storage = t.untyped_storage()
        size = storage.nbytes()
        if size != class_bytes(nbytes):
            continue
        with _lock:
            _in_use = max(0, _in_use - size)
            # The working set bounds what can be reused: beyond it, a buffer is never taken
            # again before the oldest are; the oldest go first.
            limit = min(MAX_BYTES, _peak)
            if size > limit:
                continue
            while _bytes + size > limit:
                oldest, kept = next(iter(_free.items()))
                kept.pop(0)
                _bytes -= oldest
                if not kept:
                    del _free[oldest]
            _free.setdefault(size, []).append(torch.empty(0, dtype=torch.uint8).set_(storage))
            _free.move_to_end(size)
            _bytes += size


def cached_bytes() -> int:
    """Bytes kept now."""
    return _bytes


def peak_bytes() -> int:
    """The most bytes that have been taken and not yet given back at once: the bound on
    :func:`cached_bytes`."""
    return _peak


def clear() -> None:
    """Drop every kept buffer and forget the working set."""
    global _bytes, _in_use, _peak
    with _lock:
        _free.clear()
        _bytes = _in_use = _peak = 0


def _after_fork() -> None:
    # The parent's lock may have been held by one of its threads, which the child lacks.
    global _lock, _bytes, _in_use, _peak
    _lock = threading.Lock()
    _free.clear()
    _bytes = _in_use = _peak = 0


os.register_at_fork(after_in_child=_after_fork)
