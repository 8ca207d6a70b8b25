"""``cgx::quantized_allreduce`` (functional) and ``cgx::quantized_allreduce_`` (in place): the
quantized allreduce as custom ops, and the public functions that call them.

As in ``torch.distributed._functional_collectives``: the public function checks its arguments
and resolves the group; compiled, it calls the op, whose body calls
:func:`cgx2.collectives.allreduce`; eagerly it calls that function itself (the op's dispatch
would add host time to every call). The group is named as in the functional collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from ..checks import (
    check_bits,
    check_bool,
    check_bucket_size,
    check_collective_tensor,
    check_group,
    check_reduce_op,
    check_seed,
    check_writable,
    warn_if_not_member,
)
from ..collectives import CallSettings
from ..collectives.rotations import DEFAULT_BLOCK
from ..seeding import SEEDED_OP_TAGS

__all__ = ["quantized_allreduce", "quantized_allreduce_", "resolve_group"]


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group called ``group_name`` ("" for the default group)."""
    if not dist.is_initialized():
        raise ValueError("cgx2's collectives need torch.distributed.init_process_group first")
    if group_name == "":
        return dist.group.WORLD
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _settings(
    t: torch.Tensor,
    bits: int,
    bucket_size: int,
    reduce_op: object,
    seed: int | None = None,
    skip_incomplete: bool = False,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
    *,
    public: bool = False,
) -> CallSettings:
    """The call's settings, every argument checked, once per call. The ops' schemas type the
    seed (negative: none) and ``skip_incomplete``; the public functions' (``public``: the
    tensor and reduce op named ``tensor`` and ``op``) are checked here. The rotation's block
    is checked against the bucket size here, before anything is sent: every rank passes the
    same arguments, so every rank raises the same ``ValueError``."""
    check_collective_tensor(t, "tensor" if public else "input")
    check_bits(bits)
    check_bucket_size(bucket_size)
    reduce_op = check_reduce_op(reduce_op, "op" if public else "reduce_op")
    if public:
        check_seed(seed)
        check_bool(skip_incomplete, "skip_incomplete")
    elif isinstance(seed, int) and seed < 0:  # a traced seed (SymInt) is the fake's, unread
        seed = None
    return CallSettings.of(
        bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block
    )


@torch.library.custom_op("cgx::quantized_allreduce", mutates_args=(), tags=SEEDED_OP_TAGS)
def _quantized_allreduce_op(
    input: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    skip_incomplete: bool = False,
    rotation: str = "none",
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    settings = _settings(
        input, bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block
    )
    return collectives.allreduce(input, resolve_group(group_name), settings, check_agreement=True)


@_quantized_allreduce_op.register_fake
def _(
    input,
    bits,
    bucket_size=512,
    group_name="",
    reduce_op="sum",
    seed=-1,
    skip_incomplete=False,
    rotation="none",
    rotation_block=DEFAULT_BLOCK,
):
    _settings(input, bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    _, bits, bucket_size, group_name, reduce_op, _, skip_incomplete, *rotated = inputs
    ctx.allreduce_args = (bits, bucket_size, group_name, reduce_op)
    ctx.skip_incomplete = skip_incomplete
    ctx.rotated = tuple(rotated)  # (rotation, block) where given


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # Every rank's input reaches every rank's output once (a W-th of it when averaging), so
    # the gradient is the same allreduce of the outputs' gradients: quantized alike, unbiased
    # (rotated alike, with fresh signs: the call's own seed).
    grad_input = torch.ops.cgx.quantized_allreduce(
        grad.contiguous(), *ctx.allreduce_args, -1, ctx.skip_incomplete, *ctx.rotated
    )
    return grad_input, None, None, None, None, None, None, None, None


_quantized_allreduce_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cgx::quantized_allreduce_", mutates_args=("input",), tags=SEEDED_OP_TAGS)
def _quantized_allreduce_inplace_op(
    input: torch.Tensor,
    bits: int,
    bucket_size: int = 512,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    skip_incomplete: bool = False,
    check_agreement: bool = True,
    rotation: str = "none",
    rotation_block: int = DEFAULT_BLOCK,
) -> None:
    # check_agreement False: for callers whose ranks agree by construction (DDP's per-parameter
    # reducer under compiled autograd), one round trip a parameter fewer.
    settings = _settings(
        input, bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block
    )
    check_writable(input, "input")
    group = resolve_group(group_name)
    collectives.allreduce_(input, group, settings, check_agreement=check_agreement)


@_quantized_allreduce_inplace_op.register_fake
def _(
    input,
    bits,
    bucket_size=512,
    group_name="",
    reduce_op="sum",
    seed=-1,
    skip_incomplete=False,
    check_agreement=True,
    rotation="none",
    rotation_block=DEFAULT_BLOCK,
):
    _settings(input, bits, bucket_size, reduce_op, seed, skip_incomplete, rotation, rotation_block)


def quantized_allreduce(
    tensor: torch.Tensor,
    bits: int = 4,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    seed: int | None = None,
    skip_incomplete: bool = False,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Allreduce ``tensor`` across ``group`` (default: the world) with ``bits``-bit max-min
    quantization, summing (``op=SUM``) or averaging (``op=AVG``).

    Returns a new tensor of the same shape and dtype, bit-identical on every rank; ``tensor``
    is not modified. ``bits=32``, and a tensor the routing policy does not compress
    (:mod:`cgx2.collectives.policy`), take the plain allreduce. Under ``torch.compile`` this
    is the op ``torch.ops.cgx.quantized_allreduce``. Differentiable: the gradient of the
    input is the same quantized allreduce of the output's gradient.

    As torch's functional collectives: any dense layout (transposed, sliced, expanded, a
    negative view) is reduced as its contiguous copy and the result is contiguous; a rank
    outside ``group`` gets a ``ValueError``.

    ``rotation="hadamard"`` codes a randomized Hadamard rotation of the values, in blocks of
    ``rotation_block`` (a power of two dividing ``bucket_size``), with signs from the call's
    seed, the same on every rank: the same bytes on the wire, a smaller range per bucket where
    outliers stretched it, still unbiased (docs/wire-format.md, "Rotation"; docs/low-bits.md).
    """
    settings = _settings(
        tensor, bits, bucket_size, op, seed, skip_incomplete, rotation, rotation_block, public=True
    )
    group = check_group(group, "quantized_allreduce")
    if torch.compiler.is_compiling() or (tensor.requires_grad and torch.is_grad_enabled()):
        # The op: traced when compiling; eagerly, its autograd formula gives the backward.
        return torch.ops.cgx.quantized_allreduce(
            tensor, *_op_args(settings, group), settings.skip_incomplete, *_rotation_args(settings)
        )
    return collectives.allreduce(tensor, group, settings, check_agreement=True)


def _op_args(settings: CallSettings, group: dist.ProcessGroup) -> tuple[int | str, ...]:
    """The ops' leading arguments after the tensor: bits, bucket size, the group's name, the
    reduce op and the seed (-1: none)."""
    seed = -1 if settings.seed is None else settings.seed
    return (settings.bits, settings.bucket_size, group.group_name, settings.reduce_op, seed)


def _rotation_args(settings: CallSettings) -> tuple[str | int, ...]:
    """The ops' trailing rotation arguments: none where there is no rotation, so an unrotated
    call traces to the op's old schema (graphs traced before rotation existed still match)."""
    if settings.rotation is None:
        return ()
    return (settings.rotation_name, settings.rotation_block)


def quantized_allreduce_(
    tensor: torch.Tensor,
    bits: int = 4,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    seed: int | None = None,
    skip_incomplete: bool = False,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """:func:`quantized_allreduce` in place, like ``dist.all_reduce``: ``tensor`` receives the
    result (the same bytes on every rank) and is returned; where the policy does not
    compress, this is the plain allreduce itself, with no copy. Under ``torch.compile`` this
    is the op ``torch.ops.cgx.quantized_allreduce_``.

    As ``dist.all_reduce``, a rank outside ``group`` is warned and ``tensor`` left unchanged.
    Any dense layout is written through; a tensor whose elements share memory (an
    ``expand()``-ed view) is refused, before communicating. ``rotation``, ``rotation_block``:
    as :func:`quantized_allreduce`'s.
    """
    settings = _settings(
        tensor, bits, bucket_size, op, seed, skip_incomplete, rotation, rotation_block, public=True
    )
    if warn_if_not_member(group, "quantized_allreduce_"):
        return tensor
    check_writable(tensor)
    group = check_group(group, "quantized_allreduce_")
    if torch.compiler.is_compiling():
        rotated = _rotation_args(settings)
        torch.ops.cgx.quantized_allreduce_(
            tensor,
            *_op_args(settings, group),
            settings.skip_incomplete,
            *((True, *rotated) if rotated else ()),  # check_agreement before the rotation
        )
        return tensor
    if tensor.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "quantized_allreduce_ writes into a tensor that requires grad, and has no gradient: "
            "use quantized_allreduce (differentiable), or call it under torch.no_grad()"
        )
    return collectives.allreduce_(tensor, group, settings, check_agreement=True)
