"""``cgx2.ddp.compress(ddp_model, bits=4)``: CGX's hook registered on a DDP model only where the
policy compresses one of the buckets DDP will reduce; elsewhere DDP's own allreduce stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..checks import UNCOMPRESSED_BITS, check_bits, check_bucket_size
from ..collectives import agreement, policy
from ..collectives.fusion import padded_numel
from ..comm import worker
from ..config import env_quantization_bits
from .cgx_hook import CGXState, cgx_hook
from .optimizer_overlap import check_optimizer, optimizer_in_hook

__all__ = ["bucket_layout", "compress"]

logger = logging.getLogger("cgx2")


class _Bucket(NamedTuple):
    """One of DDP's buckets, as the hook will pad it."""

    dtype: torch.dtype
    device: torch.device
    numel: int  # values to quantize


class _Decision(NamedTuple):
    """The policy's answer for a bucket, with what it was decided by."""

    compresses: bool
    crossover: int | None  # None where it was not read
    regime: str  # "" where it was not read


_T = TypeVar("_T")


def compress(
    ddp_model: DistributedDataParallel,
    bits: int | None = None,
    bucket_size: int | None = None,
    layer_min_size: int = 1024,
    *,
    mesh: DeviceMesh | str | None = "auto",
    adaptive_bits: Sequence[int] | None = None,
    replan_every: int = 100,
    error_feedback: bool = False,
    start_iter: int = 1,
    rotation: str | None = None,
    rotation_block: int | None = None,
    average_bits: float | None = None,
    optimizer: type[torch.optim.Optimizer] | None = None,
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> CGXState | None:
    """Register :func:`cgx2.ddp.cgx_hook` on ``ddp_model`` where compression pays for at least
    one of its buckets, else leave DDP's own allreduce: a hook that sends every bucket plain
    still costs DDP's hook machinery, which DDP's own allreduce does not. Call it after
    wrapping the model, on every rank at the same point (it communicates), before training.

    The hook's :class:`CGXState` is built from the arguments, named as its own
    (``bits``/``bucket_size`` are its ``compression_params``; ``rotation="hadamard"`` and
    ``rotation_block`` its rotation; ``adaptive_bits`` with ``average_bits``, the widths by
    layer error within that many payload bits a value), on DDP's process group; ``bits``
    defaults to ``CGX_COMPRESSION_QUANTIZATION_BITS``, or 4 where it is not set (this function
    is asked to compress). The decision is the policy's
    (:func:`cgx2.collectives.policy.compresses`), asked about each bucket DDP will reduce as
    the hook asks about it, on the thread the hook would run on: its layers to quantize (more
    than one dimension, at least ``layer_min_size`` values), padded to whole quantization
    buckets, against the crossover of the group's regime. The buckets are DDP's own
    assignment of the parameters to its caps (``bucket_cap_mb``, and its smaller first bucket)
    in the order DDP expects their gradients, as it rebuilds them after the first backward
    pass (with ``find_unused_parameters``, which never rebuilds, as it laid them out).
    The ranks' settings and buckets are compared first: ranks that differ raise
    :class:`cgx2.collectives.agreement.DisagreementError` on every rank, and ranks that agree
    decide alike. What was decided, and why, is logged once (logger ``"cgx2"``, INFO).

    Returns the registered hook's state (for ``state_dict()``, ``bytes_sent``), or None where
    DDP's own allreduce was kept. A calibration file (``python -m cgx2.bench calibrate``)
    makes the decision the same in every run; ``CGX2_CROSSOVER_BYTES=0`` always registers.

    ``optimizer`` (a class: ``torch.optim.AdamW``, ``Adam`` or ``SGD``, those torch has a
    functional form for that keeps its state per parameter) with ``optimizer_kwargs`` (its
    arguments, not its parameters): the optimizer steps in the backward pass, bucket by bucket,
    as soon as each bucket's averaged gradient is ready (in the hook's future's callback), so
    that its step overlaps the rest of the backward pass and the communication. It is torch's
    functional form with a state of its own (:func:`cgx2.ddp.optimizer_in_hook`), stepping
    each bucket's parameters in one call, with the arithmetic ``optimizer(params,
    **optimizer_kwargs)`` would use (multi-tensor, ``foreach``, on CUDA; single-tensor on CPU;
    ``foreach=True``/``False`` in ``optimizer_kwargs`` says which), around ``cgx_hook``; where
    no bucket pays for compression, around torch's ``allreduce_hook`` (as
    ``ddp_model._register_fused_optim``, which steps a parameter at a time). Then, as with
    ``_register_fused_optim``:

    - call no optimizer's ``step()``: ``loss.backward()`` has stepped every parameter DDP
      reduces when it returns; still clear the gradients as usual (``model.zero_grad()``);
    - the gradients cannot be clipped, scaled (AMP's ``GradScaler``) or otherwise changed over
      all parameters before the step, which comes bucket by bucket;
    - under ``no_sync`` (gradient accumulation) no hook runs, so no step is taken: the step
      comes with the next synchronized backward pass, on the gradients accumulated;
    - the optimizer's state (Adam's moments) lives in the hook, in no ``state_dict``, and its
      learning rate is fixed (no ``lr_scheduler``);
    - not under compiled autograd's per-parameter reducer (``optimize_ddp="python_reducer"``).

    On NCCL, where ``cgx_hook`` holds the exact layers (biases, norms) of every compressed
    bucket for the last bucket, a bucket's compressed layers are stepped as soon as they are
    averaged and its exact layers once they are.

    Example::

        >>> import cgx2.ddp
        >>> model = DistributedDataParallel(model, device_ids=[local_rank])
        >>> state = cgx2.ddp.compress(model, bits=4)  # None: DDP's own allreduce pays more
        >>> # Or with AdamW stepping each bucket as it arrives:
        >>> cgx2.ddp.compress(
        ...     model, bits=4, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 3e-4}
        ... )
        >>> for x, y in batches:
        ...     model.zero_grad(set_to_none=True)
        ...     loss_fn(model(x), y).backward()  # the parameters are stepped: no opt.step()
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            "cgx2.ddp.compress needs a torch.nn.parallel.DistributedDataParallel model (call it "
            f"after wrapping, before torch.compile), got {type(ddp_model).__name__}; for "
            "FSDP2, cgx2.fsdp.compress"
        )
    bits = check_bits(env_quantization_bits(default=4) if bits is None else bits, "bits")
    optimizer_kwargs = check_optimizer(optimizer, optimizer_kwargs)
    # Built before anything is sent, so that arguments the optimizer refuses raise first.
    stepping = (
        None if optimizer is None else optimizer_in_hook(cgx_hook, optimizer, optimizer_kwargs)
    )
    compression_params = {"bits": bits}
    if bucket_size is not None:
        compression_params["bucket_size"] = check_bucket_size(bucket_size, "bucket_size")
    group = ddp_model.process_group
    state = CGXState(
        group,
        layer_min_size,
        compression_params,
        mesh=mesh,
        adaptive_bits=adaptive_bits,
        replan_every=replan_every,
        error_feedback=error_feedback,
        start_iter=start_iter,
        rotation=rotation,
        rotation_block=rotation_block,
        average_bits=average_bits,
    )
    buckets = bucket_layout(ddp_model)
    # Per bucket: its dtype, device and values to quantize, as the hook will pad them.
    sizes = [
        _Bucket(
            dtype=params[0].dtype, device=params[0].device, numel=_to_quantize(state, index, params)
        )
        for index, params in enumerate(buckets)
    ]
    state._plans.clear()  # the hook plans DDP's buckets afresh
    _agree(state, group, sizes, optimizer, optimizer_kwargs)
    decided = [
        _on_hooks_thread(
            group, device, lambda d=dtype, v=device, n=numel: _compresses(state, group, d, v, n)
        )
        for dtype, device, numel in sizes
    ]
    registered = any(d.compresses for d in decided)
    logger.info("%s", _decision_in_words(state, group, sizes, decided, registered, optimizer))
    if registered:
        ddp_model.register_comm_hook(state, cgx_hook if stepping is None else stepping)
        return state
    if optimizer is not None:
        ddp_model.register_comm_hook(
            group, optimizer_in_hook(default_hooks.allreduce_hook, optimizer, optimizer_kwargs)
        )
    return None


def bucket_layout(ddp_model: DistributedDataParallel) -> list[list[nn.Parameter]]:
    """The parameters of each bucket ``ddp_model`` will reduce: DDP's own assignment
    (``dist._compute_bucket_assignment_by_size``) to its caps, a smaller first one where
    ``bucket_cap_mb`` was left at its default, of the parameters it reduces (those that need a
    gradient and are not ignored, each once), in the order of the buckets it rebuilds after
    the first backward pass: the reverse of the model's, the order gradients are expected in.
    With ``find_unused_parameters`` (and no ``static_graph``) DDP never rebuilds: the layout
    it made at construction, of the model's order. Gradients that arrive in another order
    group otherwise, a layer or so at each boundary."""
    ignored = ddp_model.parameters_to_ignore
    seen: set[nn.Parameter] = set()
    params, sparse = [], []
    for module_name, module in ddp_model.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            # DDP's own filter and names (_build_params_for_reducer).
            if p.requires_grad and f"{module_name}.{name}" not in ignored and p not in seen:
                seen.add(p)
                params.append(p)
                sparse.append(isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse)
    custom = list(getattr(ddp_model, "bucket_bytes_cap_list", None) or ())  # torch >= 2.12
    cap = ddp_model.bucket_bytes_cap
    config = getattr(ddp_model, "_bucket_config", None)  # torch >= 2.12
    if config is not None:
        first = config.first_bucket_bytes_cap
    else:  # torch 2.11 passes its Reducer this first cap
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp_model.bucket_bytes_cap_default else cap
    limits = custom or [first, cap]
    rebuilds = ddp_model.static_graph or not ddp_model.find_unused_parameters
    if rebuilds:
        params, sparse = params[::-1], sparse[::-1]
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse)
    return [[params[i] for i in bucket] for bucket in indices]


def _to_quantize(state: CGXState, index: int, params: Sequence[nn.Parameter]) -> int:
    """The values of a bucket of ``params`` that the hook quantizes, padded as it pads them (0
    for a bucket of sparse gradients, which it does not take)."""
    if any(p.layout != torch.strided for p in params):
        return 0
    plan = state._plan(index, tuple(tuple(p.shape) for p in params))
    return sum(padded_numel(n, state.bucket_size) for _, n in plan.compressed)


def _agree(
    state: CGXState,
    group: dist.ProcessGroup,
    sizes: list[_Bucket],
    optimizer: type[torch.optim.Optimizer] | None,
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Raise :class:`DisagreementError` on every rank unless all hold the same settings and
    buckets: what the decision reads, so that ranks that pass decide alike; and the same
    optimizer, where it steps in the hook, so that the replicas stay alike."""
    settings = {
        **state._settings(),
        "buckets": [[str(dtype), numel] for dtype, _, numel in sizes],
    }
    if optimizer is not None:
        arguments = ", ".join(f"{k}={v!r}" for k, v in sorted(optimizer_kwargs.items()))
        settings["optimizer"] = f"{optimizer.__qualname__}({arguments})"
    agreement.check_settings(group, "cgx2.ddp.compress", settings, sizes[0].device)


def _on_hooks_thread(group: dist.ProcessGroup, device: torch.device, fn: Callable[[], _T]) -> _T:
    """``fn()`` on the thread the hook reduces a bucket of ``device`` on: the group's worker
    where the policy sends it there, where crossovers measured beside the training step
    apply (:func:`cgx2.collectives.policy.runs_on_worker`), else this thread."""
    probe = torch.empty(0, device=device)  # a bucket's stand-in: the hook's thread and stream
    if not policy.runs_on_worker(probe, group):
        return fn()
    found = []

    def run() -> torch.Tensor:
        found.append(fn())
        return probe

    worker.submit(group, run, [probe]).wait()  # raises what fn raised
    return found[0]


def _compresses(
    state: CGXState, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device, numel: int
) -> _Decision:
    """The policy's answer for a bucket of ``numel`` values to quantize, as the hook asks it,
    with the crossover and regime it was decided by (None, "" where it did not read them)."""
    if numel == 0:
        return _Decision(compresses=False, crossover=None, regime="")
    t = torch.empty(0, dtype=dtype, device=device)
    yes = policy.compresses(t, group, state.bits, state.bucket_size, numel)
    if state.bits == UNCOMPRESSED_BITS or dist.get_world_size(group) == 1:
        # Plain without a crossover: never measure for it.
        return _Decision(compresses=yes, crossover=None, regime="")
    return _Decision(
        compresses=yes,
        crossover=policy.crossover_bytes(device, dtype, group),
        regime=policy.group_regime(device, group),
    )


def _decision_in_words(
    state: CGXState,
    group: dist.ProcessGroup,
    sizes: list[_Bucket],
    decided: list[_Decision],
    registered: bool,
    optimizer: type[torch.optim.Optimizer] | None,
) -> str:
    """What :func:`compress` decided, and why, in one line, the same on every rank."""
    n = len(sizes)
    largest = max(range(n), key=lambda i: sizes[i].numel * sizes[i].dtype.itemsize)
    dtype, _, numel = sizes[largest]
    crossover, regime = decided[largest].crossover, decided[largest].regime
    nbytes = numel * dtype.itemsize
    if registered:
        compressing = sum(d.compresses for d in decided)
        stepping = (
            ""
            if optimizer is None
            else f", {optimizer.__name__} stepping each bucket as the hook averages it"
        )
        return (
            f"cgx2.ddp.compress: registered cgx_hook at {state.bits} bits{stepping}: "
            f"{compressing} of "
            f"DDP's {n} buckets compress (the largest holds "
            f"{nbytes} bytes of {dtype} to quantize; the {regime} regime quantizes from "
            f"{crossover} bytes)"
        )
    if state.bits == UNCOMPRESSED_BITS:
        why = "bits=32 sends every bucket plain"
    elif dist.get_world_size(group) == 1:
        why = "a group of one rank has nothing to send"
    elif numel == 0:
        why = (
            f"no layer has more than one dimension and layer_min_size={state.layer_min_size} "
            "values or more"
        )
    else:
        at = "never" if crossover is None else f"from {crossover} bytes"
        why = (
            f"none of its {n} buckets reaches the crossover (the largest holds {nbytes} "
            f"bytes of {dtype} to quantize; the {regime} regime quantizes {at}; "
            "CGX2_CROSSOVER_BYTES=0 always compresses)"
        )
    if optimizer is not None:
        return (
            "cgx2.ddp.compress: kept DDP's own allreduce, as torch's allreduce_hook with "
            f"{optimizer.__name__} stepping each bucket as it is averaged (as "
            f"DDP._register_fused_optim), no cgx_hook: {why}"
        )
    return (
        "cgx2.ddp.compress: kept DDP's own allreduce, no hook: "
        f"{why}; a hook that sends every bucket plain would cost DDP's hook machinery for "
        "nothing"
    )
