"""FSDP2 with quantized gradients and parameters: ``cgx2.fsdp.compress(model, bits=4,
param_bits=8)`` sets a quantized reduce-scatter (and, with ``param_bits``, a quantized
parameter all-gather) on every ``fully_shard`` module, leaving small and 1-D parameters exact,
and on a 2-D (replicate × shard) mesh quantizes the all-reduce across replicas (HSDP);
``adaptive_bits=`` lets each module choose its parameters' widths (L-GreCo,
:mod:`cgx2.collectives.adaptive`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import seeding
from ..checks import (
    UNCOMPRESSED_BITS,
    check_bits,
    check_bucket_size,
    check_module,
    check_numel,
    reduce_op_name,
)
from ..collectives import CallSettings, agreement, allreduce_, policy
from ..collectives.adaptive import (
    check_average_bits,
    check_options,
    check_replan_every,
    layer_errors,
    plan_widths,
)
from ..collectives.all_gather import GatheredRows, decode_rows, gather_rows
from ..collectives.fusion import padded_numel
from ..collectives.reduce_scatter import Segment
from ..collectives.reduce_scatter import reduce_scatter as reduce_scatter_quantized
from ..collectives.reference import reference_reduce_scatter
from ..collectives.rotations import DEFAULT_BLOCK, check_rotation
from ..comm import CompletedWork
from ..config import CGXConfig, env_quantization_bits

__all__ = [
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "compress",
    "compression_state_dict",
    "load_compression_state_dict",
    "reduce_scatter_quantized",
    "reference_reduce_scatter",
]


def premul_factor(op: dist.ReduceOp) -> float:
    """The factor of a ``PREMUL_SUM`` op (a float, or a one-element tensor). Torch 2.13
    exposes it as ``op.factor``; torch 2.11 has no such attribute, and both give it as the
    second item of the op's pickled state."""
    factor = getattr(op, "factor", None)
    if factor is None:
        factor = op.__getstate__()[1]
    return float(factor)


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, quantized to ``bits`` (the protocol of torch's ``_fsdp_api``).

    ``row_params`` lists, in FSDP's order, each parameter's values per rank (its padded shard
    size) and whether it is compressed; when a reduction's rows do not match it (a parameter
    without a gradient), the whole row is compressed. ``bytes_sent`` counts this rank's bytes.

    ``adaptive_bits`` (L-GreCo): widths (1..8, ``bits`` among them) to choose from per
    compressed parameter, planned at the first call and every ``replan_every`` calls after by
    :func:`cgx2.collectives.adaptive.plan_bits`: the fewest bytes whose total error, measured
    on this call's gradients and summed over ranks, stays within that of ``bits`` everywhere;
    with ``average_bits`` (from the narrowest of ``adaptive_bits`` to its widest), the least
    total error whose payload stays within that many bits a value over the module's compressed
    parameters (:func:`cgx2.collectives.adaptive.plan_bits_within_bytes`). With ``rotation``
    the error is measured on the rotated values. ``widths`` holds the plan in force (None
    before the first).

    ``rotation`` (``"hadamard"``; None: none): each width group coded rotated in blocks of
    ``rotation_block`` (a power of two dividing ``bucket_size``), signs fresh every call and
    alike on every rank (:func:`cgx2.collectives.reduce_scatter`).

    ``error_feedback``: this rank's residual, what it put in minus what the owners decode of
    it (zero on its own shard, which stays exact, and on exact parameters), measured in the
    gradient's own domain (rotated back where rotated), is added to its next reduce-scatter
    input. The residual has the input's shape (every rank's shard of each parameter: as much
    memory as the unsharded gradients, as DDP's error feedback holds); it is kept in
    :meth:`state_dict`. A reduction whose rows do not match ``row_params`` (a parameter
    without a gradient) runs without it and leaves the residual for the next that does.
    """

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 512,
        row_params: list[tuple[int, bool]] | None = None,
        adaptive_bits: Sequence[int] | None = None,
        replan_every: int = 100,
        *,
        rotation: str | None = None,
        rotation_block: int = DEFAULT_BLOCK,
        error_feedback: bool = False,
        average_bits: float | None = None,
    ) -> None:
        self.bits = check_bits(bits)
        self.bucket_size = check_bucket_size(bucket_size)
        self.rotation = check_rotation(rotation, rotation_block, self.bucket_size)
        self.rotation_block = rotation_block
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        self.error_feedback = error_feedback
        self.residual: torch.Tensor | None = None
        """This rank's residual (flat, the input's size), or None: none owed."""
        self.row_params = row_params or []
        self.adaptive_bits = None if adaptive_bits is None else check_options(adaptive_bits, bits)
        self.average_bits = check_average_bits(average_bits, self.adaptive_bits)
        self.replan_every = check_replan_every(replan_every)
        self.bytes_sent = 0
        self.calls = 0
        """Reductions that used the adaptive widths: every ``replan_every``-th re-plans."""
        self.widths: tuple[int, ...] | None = None
        self._agreed = False  # whether the ranks' settings were compared (at the first call)

    def state_dict(self) -> dict[str, object]:
        """Settings, plan and counters: with cgx2's seed stream (which
        :func:`compression_state_dict` adds), what a resumed run needs to plan and round as
        the uninterrupted one would."""
        return {
            "bits": self.bits,
            "bucket_size": self.bucket_size,
            "adaptive_bits": self.adaptive_bits,
            "average_bits": self.average_bits,
            "replan_every": self.replan_every,
            "widths": self.widths,
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "rotation": self.rotation,
            "rotation_block": self.rotation_block,
            "error_feedback": self.error_feedback,
            "residual": None if self.residual is None else self.residual.detach().clone(),
            "rank": dist.get_rank() if dist.is_initialized() else None,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s values (the settings too, checked again)."""
        bits = check_bits(state["bits"])
        options = state["adaptive_bits"]
        self.adaptive_bits = None if options is None else check_options(options, bits)
        # A checkpoint from before average_bits: none.
        self.average_bits = check_average_bits(state.get("average_bits"), self.adaptive_bits)
        self.bits = bits
        self.bucket_size = check_bucket_size(state["bucket_size"])
        self.replan_every = check_replan_every(state["replan_every"])
        widths = state["widths"]
        self.widths = None if widths is None else tuple(int(b) for b in widths)
        self.calls = int(state["calls"])
        self.bytes_sent = int(state["bytes_sent"])
        # Checkpoints from before rotation and error feedback: neither.
        self.rotation_block = int(state.get("rotation_block", DEFAULT_BLOCK))
        self.rotation = check_rotation(state.get("rotation"), self.rotation_block, self.bucket_size)
        self.error_feedback = bool(state.get("error_feedback", False))
        residual = state.get("residual")
        saved_rank = state.get("rank")
        if residual is not None and saved_rank is not None and dist.is_initialized():
            if saved_rank != dist.get_rank():
                raise ValueError(
                    f"this reduce-scatter's residual is rank {saved_rank}'s, loaded on rank "
                    f"{dist.get_rank()}: save each rank's state and load it on the same rank"
                )
        self.residual = None if residual is None else residual.reshape(-1).clone()

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _segments(self, n: int) -> list[Segment] | None:
        if sum(k for k, _ in self.row_params) != n:
            return None
        segments, at = [], 0
        for k, compressed in self.row_params:
            segments.append((at, k, compressed))
            at += k
        return segments

    def _widths(
        self, segments: list[Segment], input: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[int, ...] | None:
        """The compressed segments' widths for this call, re-planned when due; None where the
        reduction would not be compressed anyway."""
        compressed = [s for s in segments if s[2]]
        world = dist.get_world_size(group)
        padded = sum(padded_numel(k, self.bucket_size) for _, k, _ in compressed)
        if not compressed or not policy.compresses(
            input, group, self.bits, self.bucket_size, world * padded
        ):
            return None
        due = self.calls % self.replan_every == 0
        self.calls += 1
        if due or self.widths is None or len(self.widths) != len(compressed):
            self.widths = self._plan(compressed, input, group)
        return self.widths

    def _plan(
        self, compressed: list[Segment], input: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[int, ...]:
        """Widths from this call's gradients. A segment's error is measured where it is
        quantized: on the W−1 rows this rank encodes (its own row stays exact), each row's
        slice padded to whole buckets with its last value as the codec pads it. The table is
        summed over ranks, so every rank plans the same widths: each rank decodes what the
        others encode, and a rank with another plan would misread the payload."""
        options = self.adaptive_bits or (self.bits,)
        block = self.rotation_block if self.rotation else None
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input.view(world, -1)
        others = torch.tensor([r for r in range(world) if r != rank], device=input.device)
        errors = []
        for o, k, _ in compressed:
            x = rows[:, o : o + k].index_select(0, others)
            pad = -k % self.bucket_size
            if pad:
                x = torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)
            errors.append(layer_errors(x, self.bucket_size, options, block))
        numels = [padded_numel(k, self.bucket_size) for _, k, _ in compressed]
        return plan_widths(errors, numels, options, self.bits, group, self.average_bits)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self._agreed:
            more = {"adaptive_bits": self.adaptive_bits, "replan_every": self.replan_every}
            more |= {"average_bits": self.average_bits}
            more |= {"calls": self.calls, "widths": self.widths}
            more |= {"rotation": self.rotation, "rotation_block": self.rotation_block}
            more |= {"error_feedback": self.error_feedback}
            _agree(self, group, "cgx2.fsdp's reduce-scatter", input_tensor, more)
        world = dist.get_world_size(group)
        if op == dist.ReduceOp.SUM:
            scale = None
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        elif op == dist.ReduceOp.PREMUL_SUM:
            scale = premul_factor(op)
        else:
            raise ValueError(f"cgx2's FSDP reduce-scatter takes SUM, AVG or PREMUL_SUM, not {op}")
        widths = error = None
        if self.bits == UNCOMPRESSED_BITS:
            segments = [(0, output_tensor.numel(), False)]
        else:
            segments = self._segments(output_tensor.numel())
            if segments is not None and self.error_feedback and input_tensor.is_contiguous():
                error = self._feed_back_(input_tensor)
            if segments is not None and self.adaptive_bits is not None and world > 1:
                widths = self._widths(segments, input_tensor, group)
        # Positional, as wrappers of this function pass; the error only where fed back.
        self.bytes_sent += reduce_scatter_quantized(
            output_tensor,
            input_tensor,
            group,
            self._call_settings(),
            scale,
            segments,
            widths,
            **({} if error is None else {"error": error}),
        )
        if error is not None:  # owed at the next step; a non-finite step owes nothing
            self.residual = error.view(-1).nan_to_num_(0.0, 0.0, 0.0)
        if async_op:
            return CompletedWork([output_tensor])
        return None

    def _call_settings(self) -> CallSettings:
        """How a reduction's compressed segments are coded (summed, then scaled by the op's
        factor), each call's seed the next of cgx2's stream."""
        return CallSettings.of(
            self.bits, self.bucket_size, rotation=self.rotation, rotation_block=self.rotation_block
        )

    def _feed_back_(self, input_tensor: torch.Tensor) -> torch.Tensor:
        """Add the residual owed to ``input_tensor`` (in place: FSDP's buffer for this
        reduction) and return the tensor the reduction's new error goes into."""
        residual = self.residual
        if residual is not None and residual.numel() == input_tensor.numel():
            if residual.device != input_tensor.device or residual.dtype != input_tensor.dtype:
                residual = residual.to(device=input_tensor.device, dtype=input_tensor.dtype)
            input_tensor.view(-1).add_(residual)
        return torch.empty_like(input_tensor)


def _agree(
    comm: QuantizedReduceScatter | QuantizedAllGather,
    group: dist.ProcessGroup,
    operation: str,
    input_tensor: torch.Tensor,
    more: dict[str, object],
) -> None:
    """Raise :class:`cgx2.collectives.agreement.DisagreementError` on every rank unless all
    hold ``comm``'s settings (its width, buckets and rows, ``more``, the input's dtype) alike:
    at its first call, which every rank makes."""
    settings = {"bits": comm.bits, "bucket_size": comm.bucket_size, "row_params": comm.row_params}
    settings |= more | {"dtype": input_tensor.dtype}
    agreement.check_settings(group, operation, settings, input_tensor.device)
    comm._agreed = True


_Key = tuple[tuple[object, ...], tuple[object, ...]]
"""A kept gather's objects (compared by identity: tensors have no truth value) and values."""


def _same_key(a: _Key, b: _Key) -> bool:
    if len(a[0]) != len(b[0]) or a[1] != b[1]:
        return False
    return all(x is y for x, y in zip(a[0], b[0], strict=True))


class QuantizedAllGather(AllGather):
    """FSDP2's parameter all-gather, quantized to ``bits`` with round-to-nearest (the protocol
    of torch's ``_fsdp_api``; :func:`cgx2.collectives.all_gather.all_gather`).

    ``row_params`` lists, in FSDP's order, each parameter's values per rank and whether it is
    compressed, as :class:`QuantizedReduceScatter`'s; an all-gather whose rows do not match
    it, or of mixed dtypes (FSDP then gathers bytes), runs exactly. Every rank decodes the
    same bytes, so every rank computes with the same unsharded parameters; the sharded
    parameters the optimizer updates are never quantized. ``bytes_sent`` counts this rank's.

    ``keep_quantized_params`` (with ``param_group``, the FSDP parameter group whose
    parameters this gathers): a quantized gather in the forward of a module that FSDP
    reshards after forward keeps what it received (every rank's row of bytes, about
    ``bits``/32 of the unsharded fp32 parameters) until the module's backward, whose gather
    decodes it again instead of sending it again: the same values, bit for bit, and one
    all-gather a step instead of two. The kept rows are used once and dropped; they are
    used only while the sharded parameters are the ones gathered (their version counters and
    tensors unchanged, the same input and output), and any other call gathers anew.
    ``reused`` counts the gathers served from kept rows; ``kept_bytes`` is what is held now.
    """

    def __init__(
        self,
        bits: int = 8,
        bucket_size: int = 512,
        row_params: list[tuple[int, bool]] | None = None,
        *,
        keep_quantized_params: bool = False,
        param_group: object | None = None,
    ) -> None:
        self.bits = check_bits(bits)
        self.bucket_size = check_bucket_size(bucket_size)
        self.row_params = row_params or []
        self.keep_quantized_params = _check_keep(keep_quantized_params)
        if keep_quantized_params and param_group is None:
            raise ValueError(
                "keep_quantized_params needs param_group (the FSDP parameter group gathered): "
                "it tells whether FSDP reshards after forward and whether the parameters changed"
            )
        self.param_group = param_group
        self.bytes_sent = 0
        self.reused = 0
        self._kept: tuple[_Key, GatheredRows] | None = None
        self._agreed = False  # whether the ranks' settings were compared (at the first call)

    @property
    def kept_bytes(self) -> int:
        """The bytes of the gathered rows held for the module's backward (0: none)."""
        return 0 if self._kept is None else self._kept[1].held_bytes

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self._agreed:
            more = {"keep_quantized_params": self.keep_quantized_params}
            _agree(self, group, "cgx2.fsdp's all-gather", input_tensor, more)
        kept, self._kept = self._kept, None  # used at most once, whatever this call does
        if self.keep_quantized_params:
            key = self._key(output_tensor, input_tensor, group)
            if kept is not None and _same_key(kept[0], key) and self._in_backward():
                if output_tensor.is_cuda:  # read on this stream, maybe not the one it was made on
                    kept[1].recv.record_stream(torch.cuda.current_stream(output_tensor.device))
                decode_rows(output_tensor, kept[1])
                self.reused += 1
                return CompletedWork([output_tensor]) if async_op else None
        segments = None
        if self.bits != UNCOMPRESSED_BITS and sum(k for k, _ in self.row_params) == (
            input_tensor.numel()
        ):
            segments, at = [], 0
            for k, compressed in self.row_params:
                segments.append((at, k, compressed))
                at += k
        else:
            segments = [(0, input_tensor.numel(), False)]
        gathered, sent = gather_rows(
            output_tensor,
            input_tensor,
            group,
            segments,
            bits=self.bits,
            bucket_size=self.bucket_size,
        )
        self.bytes_sent += sent
        if gathered is not None:
            decode_rows(output_tensor, gathered)
            if self.keep_quantized_params and self._gathered_again_in_backward():
                self._kept = (key, gathered)
        return CompletedWork([output_tensor]) if async_op else None

    def _key(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> _Key:
        """What must be unchanged for kept rows to be this call's: the group, each sharded
        parameter, its local tensor and FSDP's padded copy of it (the same objects, and the
        same versions), the input's size and dtype, the output's shape and dtype. The
        optimizer's in-place update of a sharded DTensor bumps the DTensor's version (not
        its local tensor's); an in-place change of the local tensor bumps the local tensor's."""
        objects: list[object] = [group]
        values: list[object] = [input.numel(), input.dtype, tuple(output.shape), output.dtype]
        for fsdp_param in getattr(self.param_group, "fsdp_params", ()):
            sharded = fsdp_param.sharded_param
            local = getattr(sharded, "_local_tensor", sharded)
            data = fsdp_param._sharded_param_data
            objects += [sharded, local, data]
            values += [sharded._version, local._version, data._version]
        return tuple(objects), tuple(values)

    def _state(self) -> str | None:
        state = getattr(self.param_group, "_training_state", None)
        return getattr(state, "name", None)

    def _in_backward(self) -> bool:
        """Kept rows serve only the backward's gather (or its prefetch): version counters miss
        foreach and fused optimizers' updates of DTensors (torch 2.13), so a later forward,
        after an optimizer step, could not tell that the parameters changed."""
        return self._state() == "PRE_BACKWARD"

    def _gathered_again_in_backward(self) -> bool:
        """Whether FSDP will gather these parameters again in the module's backward: a forward
        gather of a module FSDP reshards after forward to the same mesh (its root, and
        modules sharded with ``reshard_after_forward=False``, stay unsharded; with an int, the
        backward gathers over a smaller mesh). Every rank decides alike: FSDP's settings and
        state are alike on every rank."""
        group = self.param_group
        return (
            self._state() == "FORWARD"
            and getattr(group, "post_forward_mesh_info", None) is not None
            and group.post_forward_mesh_info == getattr(group, "mesh_info", None)
        )


def _check_keep(keep_quantized_params: object) -> bool:
    if not isinstance(keep_quantized_params, bool):
        raise TypeError(
            f"keep_quantized_params must be a bool, got {type(keep_quantized_params).__name__}"
        )
    return keep_quantized_params


class QuantizedReplicaGroup(dist.ProcessGroup):
    """The process group across HSDP's replicas, as FSDP2 uses it, with its float SUM/AVG
    all-reduces quantized to ``bits`` (:func:`cgx2.collectives.allreduce_`, bit-identical on
    every replica); everything else, and what does not pay, goes to ``inner`` as it is."""

    def __init__(
        self,
        inner: dist.ProcessGroup,
        bits: int,
        bucket_size: int,
        rotation: str | None = None,
        rotation_block: int = DEFAULT_BLOCK,
    ) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner, self.bits, self.bucket_size = inner, bits, bucket_size
        self.rotation = check_rotation(rotation, rotation_block, bucket_size)
        self.rotation_block = rotation_block
        self._agreed = False  # whether the ranks' settings were compared (at the first call)

    @property
    def group_name(self) -> str:  # the name its collectives resolve, and the policy's key
        return self.inner.group_name

    def getBackendName(self) -> str:  # the C++ method name, which the binding looks up
        return (
            self.inner._get_backend_name()
            if hasattr(self.inner, "_get_backend_name")
            else dist.get_backend(self.inner)
        )

    def allreduce(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> dist.Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        op = reduce_op_name(opts.reduceOp)
        if len(tensors) != 1 or op is None or not tensors[0].is_floating_point():
            return self.inner.allreduce(tensors, opts)
        if not self._agreed:
            settings = {
                "bits": self.bits,
                "bucket_size": self.bucket_size,
                "op": op,
                "dtype": tensors[0].dtype,
                "rotation": self.rotation,
                "rotation_block": self.rotation_block,
            }
            agreement.check_settings(
                self.inner, "cgx2.fsdp's replica all-reduce", settings, tensors[0].device
            )
            self._agreed = True
        settings = CallSettings.of(
            self.bits,
            self.bucket_size,
            op,
            rotation=self.rotation,
            rotation_block=self.rotation_block,
        )
        allreduce_(tensors[0], self.inner, settings)
        return CompletedWork(tensors)

    def __getattr__(self, name: str) -> object:  # rank(), size(), the rest: the inner group's
        return getattr(self.inner, name)


def compress(
    model: nn.Module,
    bits: int | None = None,
    bucket_size: int | None = None,
    min_size: int = 1024,
    adaptive_bits: Sequence[int] | None = None,
    replan_every: int = 100,
    param_bits: int | None = None,
    replica_bits: int | None = None,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
    error_feedback: bool = False,
    average_bits: float | None = None,
    keep_quantized_params: bool = False,
) -> list[QuantizedReduceScatter]:
    """Set a :class:`QuantizedReduceScatter` on every FSDP2 module of ``model`` (call it after
    ``fully_shard``). Parameters with one dimension or fewer than ``min_size`` values are
    reduced exactly, as CGX's ``layer_min_size``. ``bits``/``bucket_size`` default to
    ``CGX_COMPRESSION_QUANTIZATION_BITS`` (4 when it is not set: this function is asked to
    compress)/``CGX_COMPRESSION_BUCKET_SIZE``. ``adaptive_bits`` (widths in 1..8 that include
    ``bits``) makes each module plan its compressed parameters' widths every ``replan_every``
    reductions, within the error of ``bits`` everywhere, or with ``average_bits`` (from the
    narrowest width of ``adaptive_bits`` to its widest) for the least error within that many
    payload bits a value (:class:`QuantizedReduceScatter`).

    ``param_bits`` (1..8; None: exact) also sets a :class:`QuantizedAllGather` of the
    parameters, the same ones compressed. On a 2-D mesh (HSDP: replicate × shard), the
    gradients' all-reduce across replicas is quantized to ``replica_bits`` (default ``bits``;
    32: exact) by :class:`QuantizedReplicaGroup`.
    Returns the reduce-scatters set, whose ``bytes_sent`` add up to what this rank sent."""
    check_module(model)
    check_numel(min_size, "min_size")
    config = CGXConfig.from_env()
    if bits is None:
        bits = env_quantization_bits(default=4)
    bits = check_bits(bits)
    if param_bits is not None:
        param_bits = check_bits(param_bits, "param_bits")
    if _check_keep(keep_quantized_params) and param_bits is None:
        raise ValueError(
            "keep_quantized_params keeps the quantized parameter all-gather's rows: it needs "
            "param_bits (1..8), which is None"
        )
    replica_bits = bits if replica_bits is None else check_bits(replica_bits, "replica_bits")
    if adaptive_bits is not None:  # fail before touching the model
        adaptive_bits = check_options(adaptive_bits, bits)
    average_bits = check_average_bits(average_bits, adaptive_bits)
    replan_every = check_replan_every(replan_every)
    bucket_size = config.bucket_size if bucket_size is None else check_bucket_size(bucket_size)
    rotation = check_rotation(rotation, rotation_block, bucket_size)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
    min_size = max(min_size, config.minimal_size)
    comms = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:  # a module with no parameters of its own
            continue
        row_params = [
            (
                p.padded_sharded_param_size.numel(),
                len(p._orig_size) > 1 and p._orig_size.numel() >= min_size,
            )
            for p in group.fsdp_params
        ]
        comm = QuantizedReduceScatter(
            bits,
            bucket_size,
            row_params,
            adaptive_bits,
            replan_every,
            rotation=rotation,
            rotation_block=rotation_block,
            error_feedback=error_feedback,
            average_bits=average_bits,
        )
        module.set_custom_reduce_scatter(comm)
        comms.append(comm)
        if param_bits is not None:
            if not hasattr(module, "set_custom_all_gather"):
                raise RuntimeError(
                    "param_bits needs FSDPModule.set_custom_all_gather, which "
                    f"torch {torch.__version__} lacks"
                )
            gather = QuantizedAllGather(
                param_bits,
                bucket_size,
                row_params,
                keep_quantized_params=keep_quantized_params,
                param_group=group,
            )
            module.set_custom_all_gather(gather)
        _quantize_replicas(group, replica_bits, bucket_size, rotation, rotation_block)
    if not comms:
        raise ValueError("compress() found no fully_shard module with parameters in the model")
    return comms


def _quantize_replicas(
    group: object,
    bits: int,
    bucket_size: int,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> None:
    """On HSDP, FSDP2 all-reduces each reduce-scatter's output across replicas with
    ``dist.all_reduce(..., group=mesh_info.replicate_process_group)``: that group becomes a
    :class:`QuantizedReplicaGroup` of it."""
    mesh_info = getattr(group, "mesh_info", None)
    replicas = getattr(mesh_info, "replicate_process_group", None)
    if replicas is None or bits == UNCOMPRESSED_BITS or dist.get_world_size(replicas) < 2:
        return
    if isinstance(replicas, QuantizedReplicaGroup):
        replicas = replicas.inner
    mesh_info.replicate_process_group = QuantizedReplicaGroup(
        replicas, bits, bucket_size, rotation, rotation_block
    )


def _named_comms(model: nn.Module) -> Iterator[tuple[str, QuantizedReduceScatter]]:
    """The :class:`QuantizedReduceScatter` set on each FSDP2 module, by module name."""
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            comm = getattr(group, "_reduce_scatter_comm", None)  # torch keeps it there
            if isinstance(comm, QuantizedReduceScatter):
                yield name, comm


def compression_state_dict(model: nn.Module) -> dict[str, object]:
    """Every :class:`QuantizedReduceScatter` of ``model`` (by module name) and cgx2's seed
    stream: saved with the model and optimizer, :func:`load_compression_state_dict` makes a
    resumed run plan and round as the uninterrupted one would."""
    check_module(model)
    comms = {name: comm.state_dict() for name, comm in _named_comms(model)}
    if not comms:
        raise ValueError("the model has no cgx2 reduce-scatter: call cgx2.fsdp.compress first")
    return {"reduce_scatters": comms, "seed_state": seeding.get_state()}


def load_compression_state_dict(model: nn.Module, state: Mapping[str, object]) -> None:
    """Restore :func:`compression_state_dict`'s values into ``model``'s reduce-scatters (set
    by :func:`compress` on a model sharded as the saved one was)."""
    check_module(model)
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a Mapping (compression_state_dict's), got {type(state).__name__}"
        )
    missing = [key for key in ("reduce_scatters", "seed_state") if key not in state]
    if missing:
        raise ValueError(
            f"state lacks {', '.join(map(repr, missing))}: not a compression_state_dict"
        )
    comms = dict(_named_comms(model))
    saved = state["reduce_scatters"]
    if not isinstance(saved, Mapping) or set(saved) != set(comms):
        raise ValueError(
            f"the state holds reduce-scatters of modules {list(saved)}, the model has "
            f"{sorted(comms)}"
        )
    for name, comm in comms.items():
        comm.load_state_dict(saved[name])
    seeding.set_state(state["seed_state"])
