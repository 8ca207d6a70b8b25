"""``cgx::quantized_allreduce`` (functional) and ``cgx::quantized_allreduce_`` (in place): the
quantized allreduce as custom ops.

The process group is named by ``group_name`` as in ``torch.distributed``'s functional
collectives ("" is the default group), so compiled graphs carry it as a constant.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..checks import (
    UNCOMPRESSED_BITS,
    check_bits,
    check_bucket_size,
    check_float_tensor,
    check_reduce_op,
)
from ..collectives import (
    allreduce_plain,
    allreduce_plain_,
    allreduce_quantized,
    allreduce_quantized_,
    compression_pays,
    quantized_copy,
    quantized_inplace,
)
from ..seeding import SEEDED_OP_TAGS

__all__ = ["quantized_allreduce", "quantized_allreduce_"]


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group called ``group_name`` ("" for the default group)."""
    if not dist.is_initialized():
        raise RuntimeError("cgx.quantized_allreduce needs torch.distributed.init_process_group")
    if group_name == "":
        return dist.group.WORLD
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _no_grad_for(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.no_grad()`` where autograd would see the call (as it does not see the op's
    body), a free null context elsewhere: entering no_grad costs microseconds."""
    if t.requires_grad and torch.is_grad_enabled():
        return torch.no_grad()
    return contextlib.nullcontext()


def _check_args(t: torch.Tensor, bits: int, bucket_size: int) -> None:
    check_float_tensor(t, "input")
    check_bits(bits)
    check_bucket_size(bucket_size)


def _check(t: torch.Tensor, bits: int, bucket_size: int, reduce_op: str) -> None:
    _check_args(t, bits, bucket_size)
    check_reduce_op(reduce_op)


@torch.library.custom_op("cgx::quantized_allreduce", mutates_args=(), tags=SEEDED_OP_TAGS)
def _quantized_allreduce_op(
    input: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    _check(input, bits, bucket_size, reduce_op)
    group = resolve_group(group_name)
    return allreduce_quantized(
        input, bits, bucket_size, group, reduce_op, None if seed < 0 else seed, skip_incomplete
    )


@_quantized_allreduce_op.register_fake
def _(input, bits, bucket_size=512, group_name="", reduce_op="sum", seed=-1,
      skip_incomplete=False):  # fmt: skip
    _check(input, bits, bucket_size, reduce_op)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def quantized_allreduce(
    tensor: torch.Tensor,
    bits: int = 4,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    seed: int | None = None,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """Allreduce ``tensor`` across ``group`` (default: the world) with ``bits``-bit max-min
    quantization, summing (``op=SUM``) or averaging (``op=AVG``).

    Returns a new tensor of the same shape and dtype, bit-identical on every rank; ``tensor``
    is not modified. ``bits=32`` is the plain allreduce. Under ``torch.compile`` this is the
    op ``torch.ops.cgx.quantized_allreduce``; eagerly, the op's body.
    """
    reduce_op = check_reduce_op(op, "op")
    if not torch.compiler.is_compiling():
        # Eagerly, the op's body without its dispatch (20-30 us of host time per call); below
        # the crossover straight to the plain allreduce, where each microsecond counts.
        _check_args(tensor, bits, bucket_size)
        group = dist.group.WORLD if group is None else group
        if bits == UNCOMPRESSED_BITS or not compression_pays(tensor):
            return allreduce_plain(tensor, group, reduce_op)
        with _no_grad_for(tensor):
            return quantized_copy(tensor, bits, bucket_size, group, reduce_op, seed,
                                  skip_incomplete)  # fmt: skip
    return torch.ops.cgx.quantized_allreduce(
        tensor, bits, bucket_size, "" if group is None else group.group_name, reduce_op,
        -1 if seed is None else seed, skip_incomplete,
    )  # fmt: skip


@torch.library.custom_op(
    "cgx::quantized_allreduce_", mutates_args=("input",),
    tags=SEEDED_OP_TAGS,
)  # fmt: skip
def _quantized_allreduce_inplace_op(
    input: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    skip_incomplete: bool = False,
) -> None:
    _check(input, bits, bucket_size, reduce_op)
    group = resolve_group(group_name)
    _inplace(input, bits, bucket_size, group, reduce_op, None if seed < 0 else seed,
             skip_incomplete)  # fmt: skip


def _inplace(t: torch.Tensor, bits: int, bucket_size: int, group: dist.ProcessGroup,
             reduce_op: str, seed: int | None, skip_incomplete: bool) -> None:  # fmt: skip
    args = (bits, bucket_size, group, reduce_op, seed, skip_incomplete)
    if t.is_contiguous():
        allreduce_quantized_(t, *args)
    else:
        t.copy_(allreduce_quantized(t, *args))


@_quantized_allreduce_inplace_op.register_fake
def _(input, bits, bucket_size=512, group_name="", reduce_op="sum", seed=-1,
      skip_incomplete=False):  # fmt: skip
    _check(input, bits, bucket_size, reduce_op)


def quantized_allreduce_(
    tensor: torch.Tensor,
    bits: int = 4,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    seed: int | None = None,
    skip_incomplete: bool = False,
) -> torch.Tensor:
    """:func:`quantized_allreduce` in place, like ``dist.all_reduce``: ``tensor`` receives the
    result (the same bytes on every rank) and is returned. Below the crossover
    (:mod:`cgx2.crossover`) this is ``dist.all_reduce`` itself, with no copy. Under
    ``torch.compile`` this is the op ``torch.ops.cgx.quantized_allreduce_``; eagerly, the op's
    body.
    """
    reduce_op = check_reduce_op(op, "op")
    if not torch.compiler.is_compiling():
        # Eagerly, the op's body without its dispatch (20-30 us of host time per call); below
        # the crossover straight to the plain allreduce, where each microsecond counts.
        _check_args(tensor, bits, bucket_size)
        group = dist.group.WORLD if group is None else group
        if tensor.is_contiguous():
            if bits == UNCOMPRESSED_BITS or not compression_pays(tensor):
                return allreduce_plain_(tensor, group, reduce_op)
            with _no_grad_for(tensor):
                return quantized_inplace(tensor, bits, bucket_size, group, reduce_op, seed,
                                         skip_incomplete)  # fmt: skip
        with _no_grad_for(tensor):
            _inplace(tensor, bits, bucket_size, group, reduce_op, seed, skip_incomplete)
        return tensor
    torch.ops.cgx.quantized_allreduce_(
        tensor, bits, bucket_size, "" if group is None else group.group_name, reduce_op,
        -1 if seed is None else seed, skip_incomplete,
    )  # fmt: skip
    return tensor
