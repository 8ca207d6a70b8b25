"""Byte layout of a max-min payload: where metadata, raw values and packed levels lie.

The reference codec, the Triton kernels and the ops' fake implementations all size and slice
payloads through :class:`MaxMinLayout`, so there is one definition of the wire format.

A tensor of ``n`` elements, ``bits`` b and ``bucket_size`` B encodes to::

    [ meta  : nq x (min: f32, step: f32) ]   8*nq bytes, little-endian
    [ raw   : t x f32 ]                       4*t bytes   (only with skip_incomplete)
    [ pad to 16 bytes ]
    [ levels: nq x S bytes ]                  S = ceil(B/8)*b bytes per bucket; an incomplete
                                              last bucket of m values takes ceil(m/8)*b
    [ pad to 16 bytes ]

``nq`` is the number of quantized buckets: ceil(n/B), or floor(n/B) when the incomplete last
bucket is skipped, whose ``t = n - nq*B`` values are then sent raw (exactly, as fp32). Inside a
bucket, element j belongs to group j//8 at slot j%8; a group's eight b-bit levels form the
integer sum(level[k] << (b*k)), stored as b little-endian bytes, so every b in 1..8 packs with
no waste. Slots past the end of a bucket hold level 0. At 4 bits and B = 512 a bucket costs
8 + 256 bytes against 2048 raw fp32 bytes (7.76x smaller).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["ChunkedLayout", "MaxMinLayout", "round_up"]

ALIGN = 16


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class MaxMinLayout:
    """Layout of one payload. All sizes in bytes unless named ``*_numel``. Immutable: each
    size is computed once (the collectives ask for them per pipeline piece)."""

    numel: int
    bits: int
    bucket_size: int
    skip_incomplete: bool = False

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def of(cls, numel: int, bits: int, bucket_size: int, skip_incomplete: bool) -> MaxMinLayout:
        """The shared layout of these parameters, its sizes already computed once asked."""
        return cls(numel=numel, bits=bits, bucket_size=bucket_size, skip_incomplete=skip_incomplete)

    @functools.cached_property
    def num_buckets(self) -> int:
        """Quantized buckets (each with one min and one step)."""
        if self.skip_incomplete:
            return self.numel // self.bucket_size
        return -(-self.numel // self.bucket_size)

    @functools.cached_property
    def raw_numel(self) -> int:
        """Trailing elements sent raw as fp32 (only with ``skip_incomplete``)."""
        return self.numel - self.num_buckets * self.bucket_size if self.skip_incomplete else 0

    @functools.cached_property
    def bucket_stride(self) -> int:
        """Bytes of packed levels per bucket."""
        return -(-self.bucket_size // 8) * self.bits

    @functools.cached_property
    def raw_offset(self) -> int:
        return 8 * self.num_buckets

    @functools.cached_property
    def levels_offset(self) -> int:
        return round_up(self.raw_offset + 4 * self.raw_numel, ALIGN)

    @functools.cached_property
    def levels_nbytes(self) -> int:
        nq = self.num_buckets
        if nq == 0:
            return 0
        last = min(self.bucket_size, self.numel - (nq - 1) * self.bucket_size)
        return (nq - 1) * self.bucket_stride + -(-last // 8) * self.bits

    @functools.cached_property
    def nbytes(self) -> int:
        return round_up(self.levels_offset + self.levels_nbytes, ALIGN)


@dataclass(frozen=True)
class ChunkedLayout:
    """A flat tensor cut into ``num_chunks`` consecutive chunks of ``chunk_numel`` elements
    (the last ones shorter or empty), each encoded as its own payload in one row of a
    ``[num_chunks, payload_nbytes]`` buffer. ``chunk_numel`` is a multiple of the bucket size
    whenever there is more than one chunk, so chunks never split a bucket."""

    numel: int
    num_chunks: int
    chunk_numel: int
    bits: int
    bucket_size: int
    skip_incomplete: bool = False

    @classmethod
    @functools.lru_cache(maxsize=256)  # once per shape: every pipeline piece asks for it
    def split(
        cls, numel: int, num_chunks: int, bits: int, bucket_size: int, skip_incomplete: bool
    ) -> ChunkedLayout:
        """Even split at bucket boundaries: chunk j owns buckets [j*k, (j+1)*k). Layouts are
        immutable, so one object (with its computed sizes) serves every call."""
        buckets = -(-numel // bucket_size)
        return cls(
            numel=numel,
            num_chunks=num_chunks,
            chunk_numel=-(-buckets // num_chunks) * bucket_size if num_chunks > 1 else numel,
            bits=bits,
            bucket_size=bucket_size,
            skip_incomplete=skip_incomplete,
        )

    def chunk_start(self, j: int) -> int:
        return min(j * self.chunk_numel, self.numel)

    def chunk_size(self, j: int) -> int:
        return max(0, min(self.chunk_numel, self.numel - j * self.chunk_numel))

    def chunk(self, j: int) -> MaxMinLayout:
        size = self.chunk_size(j)
        return MaxMinLayout.of(size, self.bits, self.bucket_size, self.skip_incomplete)

    @functools.cached_property
    def payload_nbytes(self) -> int:
        """Row size: the largest chunk payload (a shorter chunk with a raw tail can be larger)."""
        return max((self.chunk(j).nbytes for j in range(self.num_chunks)), default=0)
