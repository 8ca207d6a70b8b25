"""The max-min codec's loops for CPU tensors, from cgx2's compiled extension
(``csrc/maxmin_codec.cc`` in ``cgx2._C``); the torch code runs where it is absent or turned off.

``native_codec`` false (``CGX2_NATIVE=0``, or ``cgx2.config.tuned(native_codec=False)``) turns
the loops off.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from .. import extension
from ..config import tuning
from ..cpu_threads import split

__all__ = ["decode_rows", "encode_rows", "library", "rotate"]


def library() -> ModuleType | None:
    """The extension whose loops run, or None: turned off (asked at every call, so that
    ``cgx2.config.tuned(native_codec=False)`` takes effect at once) or not built (logged
    once by :func:`cgx2.extension.load`)."""
    return extension.load() if tuning().native_codec else None


# Buckets per thread at least: below, a thread's start costs more than it saves.
_MIN_BUCKETS_PER_THREAD = 256


def _usable(*tensors: torch.Tensor) -> bool:
    # is_cpu, not device.type: that builds a device and its name at every call of the codec.
    return all(t.is_cpu and t.is_contiguous() for t in tensors) and sys.byteorder == "little"


def encode_rows(
    rows: torch.Tensor,
    bits: int,
    key: int,
    stream: int,
    covered: int,
    meta: torch.Tensor,
    levels: torch.Tensor,
    saturate: bool = False,
    clip: float = 1.0,
    nearest: bool = False,
) -> int | None:
    """Encode fp32 ``rows`` ``[nq, B]`` into ``meta`` (the payload's ``8 nq`` bytes of
    (lo, step) fp32 pairs) and ``levels`` (its levels region), both uint8, as
    :func:`cgx2.codecs.maxmin.encode` does (``saturate``: a sum's overflow coded saturated,
    ``clip`` below 1: each bucket over the middle of its range, ``nearest``: levels rounded to
    the nearest, as ``maxmin._encode``): how many buckets it coded saturated, or None (nothing
    written) where the C loops are unavailable or the tensors do not suit them."""
    lib = library()
    if lib is None or not _usable(rows, meta, levels) or rows.dtype != torch.float32:
        return None
    nq, bucket = rows.shape
    args = (
        bucket,
        bits,
        key & (2**64 - 1),
        stream & (2**64 - 1),
        covered,
        meta.data_ptr(),
        levels.data_ptr(),
        levels.numel(),
        saturate,
        clip,
        nearest,
    )
    saturated: list[int] = []  # a count per range of buckets (list.append is thread-safe)
    split(
        lambda a, b: saturated.append(lib.maxmin_encode(rows.data_ptr(), a, b, *args)),
        nq,
        _MIN_BUCKETS_PER_THREAD,
    )
    return sum(saturated)


def decode_rows(
    meta: torch.Tensor,
    levels: torch.Tensor,
    nq: int,
    bucket: int,
    bits: int,
    out: torch.Tensor,
    base: torch.Tensor | None = None,
    factor: float = 1.0,
) -> bool:
    """Decode ``nq`` buckets into ``out`` (its ``numel`` values; fp32, or bf16 rounded as
    :func:`cgx2.codecs.maxmin._cast` does) as the reference does, each times ``factor`` (an
    fp32 value, folded into its bucket's post) and added to ``base``'s value where given
    (fp32 ``base`` and ``out`` of one size; ``out`` itself accumulates); False (nothing
    written) where the C loops are unavailable."""
    lib = library()
    if base is None:
        suits = out.dtype in (torch.float32, torch.bfloat16)
    else:
        suits = out.dtype == base.dtype == torch.float32
    tensors = (meta, levels, out) if base is None else (meta, levels, out, base)
    if lib is None or not suits or not _usable(*tensors):
        return False
    head = (meta.data_ptr(), levels.data_ptr(), levels.numel())
    tail = (
        bucket,
        bits,
        out.numel(),
        0 if base is None else base.data_ptr(),
        out.data_ptr(),
        out.dtype == torch.bfloat16,
        factor,
    )
    split(lambda a, b: lib.maxmin_decode(*head, a, b, *tail), nq, _MIN_BUCKETS_PER_THREAD)
    return True


# Blocks of the rotation per thread at least (a block is 128 values by default).
_MIN_BLOCKS_PER_THREAD = 2048


def rotate(
    src: torch.Tensor, out: torch.Tensor, block: int, key: int, scale: float, inverse: bool
) -> bool:
    """The Hadamard rotation (or with ``inverse`` its inverse) of fp32 ``src`` into ``out``
    (fp32 of the same size; it may be ``src``), as :mod:`cgx2.codecs.rotation` defines it
    (``scale`` its fp32(1/sqrt(block))); False (nothing written) where the C loops are
    unavailable."""
    lib = library()
    if lib is None or not hasattr(lib, "hadamard_rotate") or not _usable(src, out):
        return False
    if src.dtype != torch.float32 or out.dtype != torch.float32:
        return False
    n = src.numel()
    args = (n, block, key & (2**64 - 1), scale, inverse)
    blocks = -(-n // block)
    split(
        lambda a, b: lib.hadamard_rotate(src.data_ptr(), out.data_ptr(), a, b, *args),
        blocks,
        _MIN_BLOCKS_PER_THREAD,
    )
    return True
