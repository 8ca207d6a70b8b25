"""Argument checks shared by the ops, collectives and config: fail fast, name the argument.

Every public entry point checks here, before any communication, so that what cgx2 cannot handle
is a ``TypeError``/``ValueError`` naming the argument, never an error from inside a codec.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

__all__ = [
    "MAX_SEED",
    "SUPPORTED_DTYPES",
    "UNCOMPRESSED_BITS",
    "check_bits",
    "check_bool",
    "check_bucket_size",
    "check_collective_tensor",
    "check_float_dtype",
    "check_float_tensor",
    "check_group",
    "check_module",
    "check_numel",
    "check_reduce_op",
    "check_seed",
    "check_writable",
    "warn_if_not_member",
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


def _dtype_names() -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)


def check_float_tensor(t: object, name: str = "tensor") -> torch.Tensor:
    """Return ``t`` if it is a dense (strided) tensor of a float dtype cgx2 can quantize, else
    ``TypeError``: sparse, nested and MKL-DNN tensors have no flat values to code."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype {_dtype_names()}; got {t.dtype}")
    if t.layout is not torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(
            f"{name} must be a dense (torch.strided) tensor, got a {layout} one: convert it "
            f"first (to_dense())"
        )
    return t


def check_collective_tensor(t: object, name: str = "tensor") -> torch.Tensor:
    """:func:`check_float_tensor`, and a tensor with data to send: not on the meta device."""
    check_float_tensor(t, name)
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device: it has no values to reduce")
    return t


def check_writable(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """Return ``t`` if an in-place collective can write its result into it: no two elements
    share memory (an ``expand()``-ed view's do), and not an inference tensor outside
    inference mode; else ``ValueError``. Checked before communicating, not when writing."""
    if t.is_contiguous() or t.numel() == 0:
        overlap = False
    else:
        # Each dimension, by increasing stride, must step past all the smaller ones' reach:
        # sufficient (a layout that passes never aliases), and every slice or permutation of
        # a dense tensor passes.
        dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1)
        reach, overlap = 1, False
        for stride, size in dims:
            if stride < reach:
                overlap = True
                break
            reach += stride * (size - 1)
    if overlap:
        raise ValueError(
            f"{name} has elements that share memory (an expand()-ed or as_strided view, strides "
            f"{t.stride()}): an in-place collective cannot write into it; pass {name}.clone(), "
            f"or use the functional form"
        )
    # Dynamo cannot trace is_inference(); a compiled graph fails on such a write itself.
    if (
        not torch.compiler.is_compiling()
        and t.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        raise ValueError(
            f"{name} is an inference tensor: an in-place collective can write into it only "
            f"inside torch.inference_mode(); clone it, or use the functional form"
        )
    return t


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a float dtype cgx2 decodes into, else ``TypeError``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be {_dtype_names()}; got {dtype}")
    return dtype


def check_numel(numel: object, name: str = "numel") -> int:
    """Return ``numel`` if it is an int >= 0 (or a symbolic one, traced), else raise naming it."""
    if isinstance(numel, torch.SymInt):
        return numel
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(numel).__name__}")
    if numel < 0:
        raise ValueError(f"{name} must be >= 0, got {numel}")
    return numel


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool, else ``TypeError`` naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


MAX_SEED = (1 << 63) - 1
"""The largest seed: the ops take it as a 64-bit signed int (what ``torch.compile`` passes)."""


def check_seed(seed: object, name: str = "seed", *, negative_draws: bool = False) -> int | None:
    """Return ``seed`` if it is None or an int in 0..:data:`MAX_SEED` (with
    ``negative_draws``, as the codec ops take it: an int >= -2**63, negative meaning "draw the
    next seed"), else raise naming it."""
    if seed is None and not negative_draws:
        return None
    if isinstance(seed, torch.SymInt):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        expected = "an int" if negative_draws else "None or an int"
        raise TypeError(f"{name} must be {expected}, got {type(seed).__name__}")
    low = -MAX_SEED - 1 if negative_draws else 0
    if not low <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be in {low}..2**63-1, got {seed}")
    return seed


def check_module(model: object, name: str = "model") -> torch.nn.Module:
    """Return ``model`` if it is an ``nn.Module``, else ``TypeError`` naming it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")
    return model


def _is_non_member(group: object) -> bool:
    # What dist.new_group returns on a rank outside its ranks: an int sentinel, not a group.
    return type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def check_group(group: object, op: str, name: str = "group") -> dist.ProcessGroup:
    """The process group ``group`` names (None: the default group), for a functional
    collective ``op``: a ``ValueError`` where this rank is not one of its members (as torch's
    functional collectives raise) or torch.distributed is not initialized, a ``TypeError``
    where ``group`` is not a process group."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(
                f"{op} needs torch.distributed.init_process_group first ({name} None is the "
                f"default group)"
            )
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if _is_non_member(group):
        raise ValueError(
            f"{name}: this rank (global rank {_global_rank()}) is not a member of the group "
            f"(dist.new_group returned GroupMember.NON_GROUP_MEMBER here); {op} returns a "
            f"result, so as torch's functional collectives, only the group's ranks may call it"
        )
    raise TypeError(
        f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
    )


def warn_if_not_member(group: object, op: str) -> bool:
    """True, with torch's warning, where this rank is not a member of ``group``: an in-place
    collective then leaves its tensor as it is, as ``dist.all_reduce`` does."""
    if not _is_non_member(group):
        return False
    warnings.warn(
        f"Running {op} on global rank {_global_rank()} which does not belong to the given "
        f"group: the tensor is left unchanged.",
        stacklevel=3,
    )
    return True


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
