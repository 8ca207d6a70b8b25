"""Error bounds that tests check quantized results against, computed from the inputs alone."""

from __future__ import annotations

import torch

FP32_EPS = 2.0**-23
# Half an ulp, relative, of the output dtype (rounding the fp32 result to it).
OUTPUT_ROUNDING = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def bucket_ranges(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Per element: max - min over its bucket (in fp64), buckets of ``bucket_size`` from 0."""
    v = x.reshape(-1).double()
    n = v.numel()
    if n == 0:
        return v
    nb = -(-n // bucket_size)
    pad = nb * bucket_size - n
    hi = torch.cat([v, v[-1:].expand(pad)]).view(nb, bucket_size).amax(1)
    lo = torch.cat([v, v[-1:].expand(pad)]).view(nb, bucket_size).amin(1)
    return (hi - lo).repeat_interleave(bucket_size)[:n]


def bucket_absmax(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Per element: the largest magnitude in its bucket."""
    v = x.reshape(-1).double().abs()
    n = v.numel()
    if n == 0:
        return v
    nb = -(-n // bucket_size)
    padded = torch.cat([v, v.new_zeros(nb * bucket_size - n)]).view(nb, bucket_size)
    return padded.amax(1).repeat_interleave(bucket_size)[:n]


def quantize_bound(x: torch.Tensor, bits: int, bucket_size: int) -> torch.Tensor:
    """One quantization step of each element's bucket, plus fp32 rounding slack."""
    step = bucket_ranges(x, bucket_size) / ((1 << bits) - 1)
    return step * (1 + 1e-5) + 8 * FP32_EPS * bucket_absmax(x, bucket_size)


def allreduce_bound(
    inputs: list[torch.Tensor], bits: int, bucket_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Per element bound on |quantized allreduce - exact sum| for ranks' ``inputs``.

    Stage 1 costs at most one step of each sender's bucket; stage 2 one step of the reduced
    bucket, whose range is at most the exact sum's range widened by the stage-1 errors.
    """
    lmax = (1 << bits) - 1
    exact = torch.stack([x.reshape(-1).double() for x in inputs]).sum(0)
    stage1 = sum(bucket_ranges(x, bucket_size) / lmax for x in inputs)
    stage2 = (bucket_ranges(exact, bucket_size) + 2 * stage1) / lmax
    absmax = bucket_absmax(exact, bucket_size) + stage1
    slack = 8 * len(inputs) * FP32_EPS * sum(bucket_absmax(x, bucket_size) for x in inputs)
    rounding = OUTPUT_ROUNDING[dtype] * (absmax + stage1 + stage2)
    return (stage1 + stage2) * (1 + 1e-5) + slack + 2 * FP32_EPS * absmax + rounding
