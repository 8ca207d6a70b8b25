"""``cgx::quantize`` and ``cgx::dequantize``: the max-min codec as custom ops."""

from __future__ import annotations

import torch

from ..checks import check_bits, check_bucket_size, check_float_tensor
from ..codecs import MaxMinLayout, maxmin_codec
from ..seeding import SEEDED_OP_TAGS, derive_key, next_seed

__all__ = ["dequantize", "quantize"]


def _check_codec_args(bits: int, bucket_size: int) -> None:
    check_bits(bits)
    if bits > 8:
        raise ValueError(f"bits must be in 1..8 to quantize, got {bits}")
    check_bucket_size(bucket_size)


@torch.library.custom_op("cgx::quantize", mutates_args=(), tags=SEEDED_OP_TAGS)
def quantize(
    x: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    seed: int = -1,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Max-min quantize the values of ``x`` (flattened) into a uint8 payload.

    The payload layout is documented in :mod:`cgx2.codecs.layout`; its size is
    ``MaxMinLayout(x.numel(), bits, bucket_size, skip_incomplete).nbytes``. ``seed`` < 0 draws
    the next seed from :mod:`cgx2.seeding`; the same seed gives the same bytes on any device.
    """
    check_float_tensor(x, "x")
    _check_codec_args(bits, bucket_size)
    seed = next_seed() if seed < 0 else seed
    codec = maxmin_codec(x.device)
    return codec.encode(x, bits, bucket_size, derive_key(seed), 0, skip_incomplete)


@quantize.register_fake
def _(x, bits, bucket_size=512, seed=-1, skip_incomplete=False):
    check_float_tensor(x, "x")
    _check_codec_args(bits, bucket_size)
    nbytes = MaxMinLayout(x.numel(), bits, bucket_size, skip_incomplete).nbytes
    return x.new_empty(nbytes, dtype=torch.uint8)


def _check_payload(payload: torch.Tensor, numel: int, bits: int, bucket_size: int,
                   skip_incomplete: bool) -> int:  # fmt: skip
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise TypeError(
            f"payload must be a 1-D uint8 tensor, got {payload.dtype} {payload.dim()}-D"
        )
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    _check_codec_args(bits, bucket_size)
    nbytes = MaxMinLayout(numel, bits, bucket_size, skip_incomplete).nbytes
    if payload.numel() < nbytes:
        raise ValueError(
            f"payload has {payload.numel()} bytes; {numel} values at {bits} bits with "
            f"bucket_size {bucket_size} need {nbytes}"
        )
    return nbytes


@torch.library.custom_op("cgx::dequantize", mutates_args=())
def dequantize(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    bucket_size: int = 512,
    dtype: torch.dtype = torch.float32,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Decode a payload made by :func:`quantize` into a flat tensor of ``numel`` values."""
    _check_payload(payload, numel, bits, bucket_size, skip_incomplete)
    codec = maxmin_codec(payload.device)
    return codec.decode(payload.contiguous(), numel, bits, bucket_size, dtype, skip_incomplete)


@dequantize.register_fake
def _(payload, numel, bits, bucket_size=512, dtype=torch.float32, skip_incomplete=False):
    _check_payload(payload, numel, bits, bucket_size, skip_incomplete)
    return payload.new_empty(numel, dtype=dtype)
