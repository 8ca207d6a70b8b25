"""Argument checks shared by the ops, collectives and config: fail fast, name the argument."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "SUPPORTED_DTYPES",
    "UNCOMPRESSED_BITS",
    "check_bits",
    "check_bucket_size",
    "check_float_tensor",
    "check_reduce_op",
]

UNCOMPRESSED_BITS = 32
"""``bits`` value that means "no compression": the plain collective, exactly."""

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
REDUCE_OPS = ("sum", "avg")


def check_bits(bits: object, name: str = "bits") -> int:
    """Return ``bits`` if it is 1..8 or 32, else raise ``TypeError``/``ValueError`` naming it."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in 1..8 or 32, got {type(bits).__name__}")
    if not (1 <= bits <= 8 or bits == UNCOMPRESSED_BITS):
        raise ValueError(f"{name} must be in 1..8 (or 32 for no compression), got {bits}")
    return bits


MAX_BUCKET_SIZE = 1 << 20
"""The largest quantization bucket: tensors are padded to whole buckets, so memory follows the
bucket size; past a million values a bucket saves no metadata worth having."""


def check_bucket_size(bucket_size: object, name: str = "bucket_size") -> int:
    """Return ``bucket_size`` if it is an int in 1..:data:`MAX_BUCKET_SIZE`, else raise naming
    it."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"{name} must be a positive int, got {type(bucket_size).__name__}")
    if not 0 < bucket_size <= MAX_BUCKET_SIZE:
        raise ValueError(
            f"{name} must be in 1..{MAX_BUCKET_SIZE} (values a bucket; tensors are padded to "
            f"whole buckets), got {bucket_size}"
        )
    return bucket_size


def check_float_tensor(t: object, name: str = "tensor") -> torch.Tensor:
    """Return ``t`` if it is a tensor of a float dtype cgx2 can quantize, else ``TypeError``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} must have dtype {allowed}; got {t.dtype}")
    return t


def reduce_op_name(op: object) -> str | None:
    """``"sum"``/``"avg"`` for the ``dist.ReduceOp`` a quantized allreduce computes, else None
    (compared, not looked up: an options object's ReduceOp hashes as its type's but a dict
    lookup never matches the two)."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


def check_reduce_op(reduce_op: object, name: str = "reduce_op") -> str:
    """Normalise ``reduce_op`` ("sum"/"avg", any case, or ``dist.ReduceOp.SUM``/``AVG``)."""
    if reduce_op is dist.ReduceOp.SUM:  # the common case, without pybind's slow comparisons
        return "sum"
    if isinstance(reduce_op, str):
        op = reduce_op.lower()
    elif reduce_op == dist.ReduceOp.SUM:
        op = "sum"
    elif reduce_op == dist.ReduceOp.AVG:
        op = "avg"
    else:
        op = str(reduce_op)
    if op not in REDUCE_OPS:
        raise ValueError(f"{name} must be SUM or AVG for a quantized allreduce, got {reduce_op}")
    return op
