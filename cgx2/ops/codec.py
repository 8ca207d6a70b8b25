"""``cgx::quantize`` and ``cgx::dequantize``: the max-min codec as custom ops, and the public
functions that call them.

The ops are defined with ``torch.library.Library`` and one kernel for every device (the
dispatcher calls it with a fraction of ``torch.library.custom_op``'s per-call host time: the
codec's kernels are short, so that time counted). The public functions run the kernels
eagerly and call the ops when compiled.
"""

from __future__ import annotations

import torch

from ..checks import (
    MAX_BUCKET_SIZE,
    MAX_SEED,
    check_bits,
    check_bool,
    check_bucket_size,
    check_float_dtype,
    check_float_tensor,
    check_numel,
    check_seed,
)
from ..codecs import MaxMinLayout, maxmin, maxmin_codec
from ..seeding import derive_key, next_seed

__all__ = ["dequantize", "quantize"]


def _layout(numel: int, bits: int, bucket_size: int, skip_incomplete: bool) -> MaxMinLayout:
    """The payload's layout: the shared one for concrete sizes; symbolic ones (a fake
    implementation under dynamic shapes) cannot key a cache."""
    if type(numel) is int and type(bits) is int and type(bucket_size) is int:
        return MaxMinLayout.of(numel, bits, bucket_size, skip_incomplete)
    return MaxMinLayout(
        numel=numel, bits=bits, bucket_size=bucket_size, skip_incomplete=skip_incomplete
    )


def _check_codec_args(bits: int, bucket_size: int, skip_incomplete: bool) -> None:
    # Valid arguments pass on plain comparisons; the checks below raise (their messages) on the
    # rest: every call of the ops comes here.
    if (
        type(bits) is int
        and 1 <= bits <= 8
        and type(bucket_size) is int
        and 0 < bucket_size <= MAX_BUCKET_SIZE
        and type(skip_incomplete) is bool
    ):
        return
    check_bits(bits)
    if bits > 8:
        raise ValueError(f"bits must be in 1..8 to quantize, got {bits}")
    check_bucket_size(bucket_size)
    check_bool(skip_incomplete, "skip_incomplete")


_LIB = torch.library.Library("cgx", "FRAGMENT")
# Not cudagraph_unsafe, unlike the other seeded ops: captured into a CUDA graph (torch.compile's
# "reduce-overhead"), an unseeded call draws its key on the device at every replay (_quantize).
_LIB.define(
    "quantize(Tensor x, SymInt bits, SymInt bucket_size=512, SymInt seed=-1, "
    "bool skip_incomplete=False) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded, torch.Tag.pt2_compliant_tag),
)
_LIB.define(
    "dequantize(Tensor payload, SymInt numel, SymInt bits, SymInt bucket_size=512, "
    "ScalarType dtype=6, bool skip_incomplete=False) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _quantize(x, bits, bucket_size=512, seed=-1, skip_incomplete=False):
    """The kernel of ``torch.ops.cgx.quantize`` (:func:`quantize`)."""
    check_float_tensor(x, "x")
    _check_codec_args(bits, bucket_size, skip_incomplete)
    if type(seed) is not int or not -MAX_SEED - 1 <= seed <= MAX_SEED:
        check_seed(seed, negative_draws=True)
    if x.is_neg():  # a negative view's bit is torch's to apply: the codecs read storage
        x = x.resolve_neg()
    codec = maxmin_codec(x.device)
    if seed < 0 and x.is_cuda and torch.cuda.is_current_stream_capturing():
        if codec is maxmin:
            raise RuntimeError(
                "cgx2: an unseeded quantize inside a CUDA graph needs Triton (whose kernels "
                "read their key from the device); pass a seed"
            )
        key = torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=x.device)
        return codec.encode(x, bits, bucket_size, key, 0, skip_incomplete)
    seed = next_seed() if seed < 0 else seed
    return codec.encode(x, bits, bucket_size, derive_key(seed), 0, skip_incomplete)


def quantize(
    x: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    seed: int = -1,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Max-min quantize the values of ``x`` (flattened) into a uint8 payload: the op
    ``torch.ops.cgx.quantize``, whose kernel runs eagerly (compiled, the op).

    The payload layout is documented in :mod:`cgx2.codecs.layout`; its size is
    ``MaxMinLayout(x.numel(), bits, bucket_size, skip_incomplete).nbytes``. ``seed`` < 0 draws
    the next seed from :mod:`cgx2.seeding`; the same seed gives the same bytes on any device.
    Inside a CUDA graph's capture an unseeded call takes its key from torch's CUDA generator
    instead, on the device, so that every replay rounds afresh.
    """
    if torch.compiler.is_compiling():
        return torch.ops.cgx.quantize(x, bits, bucket_size, seed, skip_incomplete)
    return _quantize(x, bits, bucket_size, seed, skip_incomplete)


@torch.library.register_fake("cgx::quantize")
def _(x, bits, bucket_size=512, seed=-1, skip_incomplete=False):
    check_float_tensor(x, "x")
    _check_codec_args(bits, bucket_size, skip_incomplete)
    nbytes = _layout(x.numel(), bits, bucket_size, skip_incomplete).nbytes
    return x.new_empty(nbytes, dtype=torch.uint8)


def _check_payload(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    bucket_size: int,
    dtype: torch.dtype,
    skip_incomplete: bool,
) -> int:
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.layout is not torch.strided or payload.is_nested:
        raise TypeError(f"payload must be a dense (torch.strided) tensor, got {payload.layout}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError(
            f"payload must be a 1-D uint8 tensor, got {payload.dtype} {payload.dim()}-D"
        )
    if type(numel) is not int or numel < 0:
        check_numel(numel)
    if dtype is not torch.float32:
        check_float_dtype(dtype)
    _check_codec_args(bits, bucket_size, skip_incomplete)
    nbytes = _layout(numel, bits, bucket_size, skip_incomplete).nbytes
    if payload.numel() < nbytes:
        raise ValueError(
            f"payload has {payload.numel()} bytes; {numel} values at {bits} bits with "
            f"bucket_size {bucket_size} need {nbytes}"
        )
    return nbytes


def _dequantize(payload, numel, bits, bucket_size=512, dtype=torch.float32, skip_incomplete=False):
    """The kernel of ``torch.ops.cgx.dequantize`` (:func:`dequantize`)."""
    _check_payload(payload, numel, bits, bucket_size, dtype, skip_incomplete)
    codec = maxmin_codec(payload.device)
    return codec.decode(payload.contiguous(), numel, bits, bucket_size, dtype, skip_incomplete)


def dequantize(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    bucket_size: int = 512,
    dtype: torch.dtype = torch.float32,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Decode a payload made by :func:`quantize` into a flat tensor of ``numel`` values: the
    op ``torch.ops.cgx.dequantize``, whose kernel runs eagerly (compiled, the op)."""
    if torch.compiler.is_compiling():
        return torch.ops.cgx.dequantize(payload, numel, bits, bucket_size, dtype, skip_incomplete)
    return _dequantize(payload, numel, bits, bucket_size, dtype, skip_incomplete)


@torch.library.register_fake("cgx::dequantize")
def _(payload, numel, bits, bucket_size=512, dtype=torch.float32, skip_incomplete=False):
    _check_payload(payload, numel, bits, bucket_size, dtype, skip_incomplete)
    return payload.new_empty(numel, dtype=dtype)


# The kernels, not the public functions: the dispatcher calls a kernel only to run it (traced,
# the fake implementations answer), so asking is_compiling() there would be time spent for
# nothing at every call of the op.
_LIB.impl("quantize", _quantize, "CompositeExplicitAutograd")
_LIB.impl("dequantize", _dequantize, "CompositeExplicitAutograd")
