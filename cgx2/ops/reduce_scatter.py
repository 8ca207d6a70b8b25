"""``cgx::quantized_reduce_scatter`` (functional) and ``cgx::quantized_reduce_scatter_out``
(into a given tensor): the quantized reduce-scatter as custom ops, and the public function.

As ``torch.distributed._functional_collectives.reduce_scatter_tensor``: the input's first
dimension is split into the group's W parts, rank r receives the reduction of every rank's
part r. The group is named as in the functional collectives, with its size beside it so that
the fake implementation needs no process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import collectives
from ..checks import check_float_tensor, check_group
from ..collectives import CallSettings
from ..collectives.rotations import DEFAULT_BLOCK
from ..seeding import SEEDED_OP_TAGS
from .allreduce import _op_args, _rotation_args, _settings, resolve_group

__all__ = ["quantized_reduce_scatter"]


def _output_shape(input: torch.Tensor, group_size: int) -> list[int]:
    if input.dim() == 0 or input.shape[0] % group_size:
        raise ValueError(
            f"quantized_reduce_scatter splits the input's first dimension into {group_size} "
            f"equal parts, one a rank; got a tensor of shape {tuple(input.shape)}"
        )
    return [input.shape[0] // group_size, *input.shape[1:]]


def _run(
    out: torch.Tensor,
    input: torch.Tensor,
    settings: CallSettings,
    group_size: int,
    group_name: str,
) -> None:
    group = resolve_group(group_name)
    if dist.get_world_size(group) != group_size:
        raise ValueError(
            f"group_size {group_size} is not the size of group {group_name!r} "
            f"({dist.get_world_size(group)})"
        )
    # A negative view's bit is torch's to apply: the codecs read the stored values. Averaged
    # by settings.reduce_op: the reduce-scatter scales by 1/W.
    flat = input.resolve_neg().contiguous().view(-1)
    collectives.reduce_scatter(out.view(-1), flat, group, settings, check_agreement=True)


@torch.library.custom_op("cgx::quantized_reduce_scatter", mutates_args=(), tags=SEEDED_OP_TAGS)
def _quantized_reduce_scatter_op(
    input: torch.Tensor,
    bits: int,
    bucket_size: int,
    group_size: int,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    rotation: str = "none",
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    settings = _settings(input, bits, bucket_size, reduce_op, seed, False, rotation, rotation_block)
    out = input.new_empty(_output_shape(input, group_size))
    _run(out, input, settings, group_size, group_name)
    return out


@_quantized_reduce_scatter_op.register_fake
def _(
    input,
    bits,
    bucket_size,
    group_size,
    group_name="",
    reduce_op="sum",
    seed=-1,
    rotation="none",
    rotation_block=DEFAULT_BLOCK,
):
    _settings(input, bits, bucket_size, reduce_op, seed, False, rotation, rotation_block)
    return input.new_empty(_output_shape(input, group_size))


def _setup_context(ctx, inputs, output) -> None:
    _, _, _, group_size, group_name, reduce_op, *_ = inputs
    ctx.gather_args = (group_size, group_name, reduce_op)


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    # Rank r's output is the sum of every rank's part r: each input's gradient is the
    # all-gather of the outputs' gradients (exact), a W-th of it when averaging.
    group_size, group_name, reduce_op = ctx.gather_args
    group = resolve_group(group_name)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # 2.13 renamed
    grad_input = funcol.wait_tensor(gather(grad.contiguous(), 0, group))
    if reduce_op == "avg":
        grad_input = grad_input / group_size
    return grad_input, None, None, None, None, None, None, None, None


_quantized_reduce_scatter_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(
    "cgx::quantized_reduce_scatter_out", mutates_args=("out",), tags=SEEDED_OP_TAGS
)
def _quantized_reduce_scatter_out_op(
    input: torch.Tensor,
    out: torch.Tensor,
    bits: int,
    bucket_size: int,
    group_size: int,
    group_name: str = "",
    reduce_op: str = "sum",
    seed: int = -1,
    rotation: str = "none",
    rotation_block: int = DEFAULT_BLOCK,
) -> None:
    settings = _settings(input, bits, bucket_size, reduce_op, seed, False, rotation, rotation_block)
    _check_out(input, out, group_size)
    _run(out, input, settings, group_size, group_name)


@_quantized_reduce_scatter_out_op.register_fake
def _(
    input,
    out,
    bits,
    bucket_size,
    group_size,
    group_name="",
    reduce_op="sum",
    seed=-1,
    rotation="none",
    rotation_block=DEFAULT_BLOCK,
):
    _settings(input, bits, bucket_size, reduce_op, seed, False, rotation, rotation_block)
    _check_out(input, out, group_size)


def _check_out(input: torch.Tensor, out: torch.Tensor, group_size: int) -> None:
    """``out``, checked against the output's shape (after the other arguments)."""
    shape = _output_shape(input, group_size)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.device != input.device:
        raise ValueError(f"out must be on the input's device ({input.device}), got {out.device}")
    if (
        list(out.shape) != shape
        or out.dtype != input.dtype
        or not out.is_contiguous()
        or out.is_neg()
        or out.layout is not torch.strided
    ):
        raise ValueError(
            f"out must be a contiguous {input.dtype} tensor of shape {tuple(shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )


def quantized_reduce_scatter(
    tensor: torch.Tensor,
    bits: int = 4,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    seed: int | None = None,
    *,
    out: torch.Tensor | None = None,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Reduce-scatter ``tensor`` across ``group`` (default: the world) with ``bits``-bit
    max-min quantization, summing (``op=SUM``) or averaging (``op=AVG``): the first dimension
    is split into W equal parts and this rank receives the reduction of every rank's part
    ``rank``, as ``dist.reduce_scatter_tensor`` does.

    Each value another rank sends is quantized once (stochastic rounding, unbiased, within
    one step of its bucket); this rank's own part is added exactly. ``bits=32``, and a tensor
    the routing policy does not compress, take the plain reduce-scatter. Returns a new tensor
    of shape ``(tensor.shape[0] // W, *tensor.shape[1:])``, or writes into ``out`` (that
    shape, contiguous) and returns it. Under ``torch.compile`` this is the op
    ``torch.ops.cgx.quantized_reduce_scatter`` (``_out`` with ``out``). Differentiable
    without ``out``: the input's gradient is the all-gather of the output's.

    As torch's functional collectives: any dense layout is reduced as its contiguous copy, and
    a rank outside ``group`` gets a ``ValueError``. ``rotation``, ``rotation_block``: as
    :func:`cgx2.quantized_allreduce`'s (the owner sums rotated values and rotates back).
    """
    settings = _settings(
        tensor, bits, bucket_size, op, seed, False, rotation, rotation_block, public=True
    )
    if out is not None:
        check_float_tensor(out, "out")
    group = check_group(group, "quantized_reduce_scatter")
    bits, bucket_size, name, reduce_op, seed = _op_args(settings, group)
    size = dist.get_world_size(group)
    args = (bits, bucket_size, size, name, reduce_op, seed, *_rotation_args(settings))
    if out is None:
        return torch.ops.cgx.quantized_reduce_scatter(tensor, *args)
    torch.ops.cgx.quantized_reduce_scatter_out(tensor, out, *args)
    return out
