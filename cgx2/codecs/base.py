"""What the collectives need from a codec: :class:`Codec` (chunked payloads, max-min) and
:class:`GlobalNormCodec` (codes against one global norm, exponential dithering).

An implementation is a module of plain functions (the torch reference, its Triton kernels)
whose names and parameters are the protocol's: :func:`cgx2.codecs.maxmin_codec` hands the
collectives one for a device, and :func:`mismatches` is what tests hold every one to.
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import torch

from .layout import ChunkedLayout
from .rotation import Rotation

__all__ = ["Codec", "GlobalNormCodec", "mismatches"]


@runtime_checkable
class Codec(Protocol):
    """A chunked codec: a flat float tensor cut into chunks, each one payload row of a
    ``[num_chunks, layout.payload_nbytes]`` uint8 buffer, in the byte format of the payload
    layout (:class:`~cgx2.codecs.layout.ChunkedLayout`, whose chunks are
    :class:`~cgx2.codecs.layout.MaxMinLayout` payloads). Every implementation writes the
    reference's bytes (:mod:`cgx2.codecs.maxmin`) given the same key and stream; chunk ``j``
    is coded with stream ``j``. ``key`` is a 64-bit int (an implementation may take more).
    A ``[K, P]`` buffer of rows may be a view with a longer row pitch, each row contiguous.

    ``rotation`` (keyword, default None: no rotation) codes the values' randomized Hadamard
    rotation (:class:`~cgx2.codecs.rotation.Rotation`, docs/wire-format.md "Rotation"):
    encoders code the rotated values, decoders rotate back, and the decode-sum-encode of an
    allreduce's reduced chunk sums in the rotated domain and stays there. Every rank passes
    the same rotation."""

    def chunked_layout(
        self,
        numel: int,
        num_chunks: int,
        bits: int,
        bucket_size: int,
        skip_incomplete: bool = False,
    ) -> ChunkedLayout:
        """The payload layout of ``numel`` values cut into ``num_chunks`` chunks at bucket
        boundaries: the size of every buffer below."""
        ...

    def encode(
        self,
        x: torch.Tensor,
        bits: int,
        bucket_size: int,
        key: int,
        stream: int = 0,
        skip_incomplete: bool = False,
        out: torch.Tensor | None = None,
        nearest: bool = False,
        *,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """Flat ``x`` (any float dtype) as one payload (written into ``out`` when given);
        ``nearest``: levels rounded to the nearest, not stochastically (``key`` unused)."""
        ...

    def decode(
        self,
        payload: torch.Tensor,
        numel: int,
        bits: int,
        bucket_size: int,
        dtype: torch.dtype = torch.float32,
        skip_incomplete: bool = False,
        *,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``numel`` values in ``dtype``."""
        ...

    def encode_chunks(
        self,
        x: torch.Tensor,
        layout: ChunkedLayout,
        key: int,
        skip_chunk: int = -1,
        *,
        out: torch.Tensor | None = None,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """Each chunk of flat ``x`` into its row; row ``skip_chunk`` (the caller's own chunk,
        kept in full precision) is not written."""
        ...

    def decode_chunks(
        self,
        payloads: torch.Tensor,
        layout: ChunkedLayout,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
        *,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """Inverse of :meth:`encode_chunks`: the flat tensor of ``layout.numel`` values."""
        ...

    def decode_sum(
        self,
        payloads: torch.Tensor,
        numel: int,
        own: torch.Tensor | None,
        own_index: int,
        scale: float | None,
        bits: int,
        bucket_size: int,
        skip_incomplete: bool = False,
        *,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """``(own + the other rows decoded) * scale`` in fp32, summed in row order; row
        ``own_index`` is not read (``own`` stands for it); ``scale`` None means 1. With
        ``rotation``: own rotated plus the rows, times scale, rotated back."""
        ...

    def decode_sum_encode(
        self,
        payloads: torch.Tensor,
        numel: int,
        own: torch.Tensor | None,
        own_index: int,
        scale: float | None,
        bits: int,
        bucket_size: int,
        key: int,
        stream: int = 0,
        skip_incomplete: bool = False,
        out: torch.Tensor | None = None,
        *,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """:meth:`decode_sum` encoded once more (the reduced chunk of an allreduce), fused
        where the implementation can; with ``scale``, own and each row times ``scale`` summed
        (the plain allreduce's AVG divides first), and a bucket whose sum overflowed coded
        saturated (:mod:`.maxmin`). With ``rotation``: own rotated plus the rows, encoded
        with no further rotation (the final :meth:`decode_chunks` rotates back)."""
        ...


@runtime_checkable
class GlobalNormCodec(Protocol):
    """Codes of ``g / norm``, ``norm`` one value shared by every rank, that an all-gather
    carries and every rank decodes and sums alike (:mod:`cgx2.codecs.exponential` defines
    the codes). The linear global-norm codecs, whose integer levels add up in an all-reduce
    instead, are :mod:`cgx2.codecs.global_norm`'s functions."""

    def encode(
        self, g: torch.Tensor, norm: torch.Tensor | None, bits: int, key: int, stream: int = 0
    ) -> torch.Tensor:
        """Flat integer codes of ``g / norm`` (``norm`` None: of ``g``)."""
        ...

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``codes`` (any shape)."""
        ...

    def decode_sum(self, codes: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``(values of row 0 + row 1 + ...) * scale`` over ``[W, n]`` codes, in row order."""
        ...


def _members(protocol: type) -> list[str]:
    return sorted(
        name
        for name in protocol.__dict__
        if callable(protocol.__dict__[name]) and not name.startswith("_")
    )


def mismatches(implementation: object, protocol: type) -> list[str]:
    """How ``implementation`` (a module or object) falls short of ``protocol``: missing
    functions, and parameters a caller of the protocol could not pass it (positional ones
    by position and name, keyword-only ones by name, defaults alike; parameters of its own
    need defaults). Empty when it conforms."""
    problems = []
    for name in _members(protocol):
        found = getattr(implementation, name, None)
        if not callable(found):
            problems.append(f"{name}: missing")
            continue
        wanted = list(inspect.signature(getattr(protocol, name)).parameters.values())[1:]
        have = inspect.signature(found).parameters
        positional = [
            p for p in have.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        taken = set()
        for i, want in enumerate(wanted):
            if want.kind == want.POSITIONAL_OR_KEYWORD:
                got = positional[i] if i < len(positional) else None
                if got is None or got.name != want.name or got.kind != got.POSITIONAL_OR_KEYWORD:
                    problems.append(f"{name}: parameter {i} must be {want.name!r}")
                    taken.update([] if got is None else [got.name])  # reported once
                    continue
            else:
                got = have.get(want.name)
                if got is None or got.kind not in (got.POSITIONAL_OR_KEYWORD, got.KEYWORD_ONLY):
                    problems.append(f"{name}: no keyword parameter {want.name!r}")
                    continue
            taken.add(got.name)
            if want.default is not want.empty and got.default != want.default:
                problems.append(
                    f"{name}: {want.name}'s default must be {want.default!r}, got {got.default!r}"
                )
        for extra in have.values():
            if extra.name in taken or extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
                continue
            if extra.default is extra.empty:
                problems.append(f"{name}: its own parameter {extra.name!r} needs a default")
    return problems
