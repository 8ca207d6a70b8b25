"""CGX's DDP hook: per-layer max-min compression of gradient buckets, small layers exact.

A layer (parameter) is compressed when it has more than one dimension and at least
``layer_min_size`` elements; biases, norms and small layers are averaged uncompressed.
"""

# No ``from __future__ import annotations``: DDP checks cgx_hook's annotations as objects.
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from .. import seeding
from ..checks import UNCOMPRESSED_BITS, check_bits, check_bucket_size
from ..collectives import CallSettings, agreement, policy
from ..collectives.adaptive import (
    check_average_bits,
    check_options,
    check_replan_every,
    layer_errors,
    plan_widths,
)
from ..collectives.fusion import allreduce_fused_, padded_numel, ring_bytes_sent
from ..collectives.hierarchical import hierarchical_allreduce_fused_, node_mesh
from ..collectives.rotations import DEFAULT_BLOCK, check_rotation
from ..comm import coding_stream, worker
from ..config import CGXConfig
from .error_feedback import ErrorFeedback
from .param_numbers import ParamNumbers

__all__ = ["CGXState", "cgx_hook"]

logger = logging.getLogger("cgx2")


@dataclass(frozen=True)
class _Plan:
    """Where a bucket's layers lie in its flat buffer, and which are compressed."""

    shapes: tuple[tuple[int, ...], ...]
    compressed: tuple[tuple[int, int], ...]  # (offset, numel) of each compressed layer
    exact: tuple[tuple[int, int], ...]
    layers: tuple[int, ...] = ()  # each compressed layer's index in the bucket


Layout = tuple[tuple[int, tuple[int, ...]], ...]
"""One backward pass's buckets, in the order DDP handed them over: each bucket's index and
its parameters' numbers (:meth:`CGXState.param_ids`)."""


class CGXState:
    """State of :func:`cgx_hook`, with CGX's signature.

    ``compression_params`` may hold ``bits`` (1–8, or 32 for none) and ``bucket_size``; what
    it leaves out comes from ``CGX_COMPRESSION_QUANTIZATION_BITS`` and
    ``CGX_COMPRESSION_BUCKET_SIZE`` (read once, here). ``layer_min_size`` is raised to
    ``CGX_COMPRESSION_MINIMAL_SIZE`` (at least 16), as in CGX.

    ``rotation`` (cgx2's addition; or ``compression_params["rotation"]``): ``"hadamard"``
    codes each compressed layer's randomized Hadamard rotation, in blocks of
    ``rotation_block`` (``compression_params["rotation_block"]``, a power of two dividing the
    bucket size; checked here, before anything is sent), signs fresh every call and alike on
    every rank: a smaller error at the same bytes where outliers stretch a bucket's range
    (docs/low-bits.md). It composes with ``error_feedback`` (the residual is measured in the
    gradient's own domain) and ``adaptive_bits``.

    ``adaptive_bits`` (cgx2's addition, L-GreCo): widths to choose from per layer, every
    ``replan_every`` calls per bucket, by :func:`cgx2.collectives.adaptive.plan_bits` from the
    layers' gradient statistics (averaged over ranks, so all ranks agree): the fewest bytes whose
    total error stays within that of ``bits`` everywhere. With ``rotation`` the statistics are
    those of the rotated values, which the codec codes.

    ``average_bits`` (with ``adaptive_bits``; from its narrowest width to its widest): turns
    each bucket's plan around, to the least total error whose payload stays within
    ``average_bits`` bits a value over the bucket's compressed layers
    (:func:`cgx2.collectives.adaptive.plan_bits_within_bytes`): the bytes are the budget, and
    the bits go where the error falls most. It counts the levels only: each bucket of
    ``bucket_size`` values adds its scale and offset, and the layers sent exact their 32 bits.

    ``mesh`` (cgx2's addition): a ("inter", "intra") ``DeviceMesh`` makes the compressed
    layers go through :func:`cgx2.hierarchical_allreduce` (plain inside a node, quantized
    between nodes; ``CGX_INTRA_BROADCAST`` picks the variant). ``"auto"`` builds one from
    ``LOCAL_WORLD_SIZE`` when the job spans several nodes and the group is the world, and
    sends each bucket over it or flat as the policy chooses
    (:func:`cgx2.collectives.policy.by_node_mesh`: CPU tensors by what was faster on the job's
    link, timed at the first compressed bucket); None never does.

    ``error_feedback`` (cgx2's addition, CGX had it in its kernels): each compressed layer
    keeps a residual, added to its gradient at the next step: what this rank put in minus
    what its peers decode of it in the allreduce's first stage. That is exact, not a local
    re-quantization: the allreduce decodes the very bytes it sends (zero error on the chunk
    this rank owns, which stays exact). The second stage's error (each reduced chunk
    quantized once more, common to all ranks) is not fed back. Residuals are per parameter
    (:class:`cgx2.ddp.error_feedback.ErrorFeedback`) and checkpointed; error feedback does not
    combine with a hierarchical mesh nor with compiled autograd's per-parameter reducer.

    ``start_iter``: backward passes averaged exactly before compression starts. The default,
    1, sends DDP's first iteration exact, as CGX did (it registered its layers then): DDP
    puts the whole model in one bucket in that iteration, and Adam's first update, about
    ±lr per weight whatever the gradient's size, turns quantization noise in small
    gradients into full-size steps. Compiled autograd's per-parameter reducer sees no
    iterations: it compresses from the first.

    With ``mesh="auto"`` on several nodes, ``adaptive_bits`` and ``error_feedback`` keep the
    flat allreduce (neither combines with the mesh yet); an explicit mesh with either is
    refused.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        layer_min_size: int = 1024,
        compression_params: Mapping[str, int | str | None] | None = None,
        *,
        mesh: DeviceMesh | str | None = "auto",
        adaptive_bits: Sequence[int] | None = None,
        replan_every: int = 100,
        error_feedback: bool = False,
        start_iter: int = 1,
        rotation: str | None = None,
        rotation_block: int | None = None,
        average_bits: float | None = None,
    ) -> None:
        config = CGXConfig.from_env()
        params = dict(compression_params or {})
        unknown = set(params) - {"bits", "bucket_size", "rotation", "rotation_block"}
        if unknown:
            raise ValueError(
                f"compression_params: unknown keys {sorted(unknown)}; expected 'bits', "
                "'bucket_size', 'rotation', 'rotation_block'"
            )
        for key, given in (("rotation", rotation), ("rotation_block", rotation_block)):
            if given is not None and key in params and params[key] != given:
                raise ValueError(
                    f"{key}={given!r} and compression_params[{key!r}]={params[key]!r} differ"
                )
        if isinstance(layer_min_size, bool) or not isinstance(layer_min_size, int):
            raise TypeError(f"layer_min_size must be an int, got {type(layer_min_size).__name__}")
        if layer_min_size < 0:
            raise ValueError(f"layer_min_size must be >= 0, got {layer_min_size}")
        self.process_group = process_group
        self.bits = check_bits(
            params.get("bits", config.quantization_bits), "compression_params['bits']"
        )
        self.bucket_size = check_bucket_size(
            params.get("bucket_size", config.bucket_size), "compression_params['bucket_size']"
        )
        rotation = params.get("rotation", rotation)
        rotation_block = params.get("rotation_block", rotation_block)
        self.rotation_block = DEFAULT_BLOCK if rotation_block is None else rotation_block
        self.rotation = check_rotation(
            rotation,
            self.rotation_block,
            self.bucket_size,
            "compression_params['rotation']",
            "compression_params['rotation_block']",
        )
        self.layer_min_size = max(layer_min_size, config.minimal_size)
        self.skip_incomplete = config.skip_incomplete_buckets
        self.intra_broadcast = config.intra_broadcast
        self._mesh_by_policy = mesh == "auto"
        if mesh == "auto":
            several = policy.hierarchical(process_group, self.bits)
            if several and (adaptive_bits is not None or error_feedback):
                # Neither combines with the mesh yet: the flat allreduce serves them.
                logger.info(
                    "cgx2: CGXState with adaptive_bits or error_feedback on several "
                    "nodes uses the flat allreduce, not the node mesh"
                )
                several = False
            mesh = node_mesh() if several else None
        elif mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, 'auto' or None, got {mesh!r}")
        self.mesh = mesh
        if adaptive_bits is not None:
            adaptive_bits = check_options(adaptive_bits, self.bits)
            if mesh is not None:
                raise ValueError("adaptive_bits and a hierarchical mesh do not combine yet")
        self.adaptive_bits = adaptive_bits
        self.average_bits = check_average_bits(average_bits, adaptive_bits)
        self.replan_every = check_replan_every(replan_every)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        if error_feedback and mesh is not None:
            raise ValueError("error_feedback and a hierarchical mesh do not combine yet: mesh=None")
        self.errors = ErrorFeedback() if error_feedback else None
        """The residuals (None: error feedback off)."""
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.start_iter = start_iter
        self.iteration = 0
        """Backward passes whose last bucket this hook has reduced."""
        self._bit_plans: dict[int, tuple[int, ...]] = {}
        self._calls: dict[int, int] = {}
        self._plans: dict[int, _Plan] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._param_numbers = ParamNumbers()
        # Per bucket index, its parameters' addresses and numbers: a weak lookup a parameter
        # costs about a microsecond, a step of a large model a fraction of a millisecond.
        self._bucket_ids: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}  # each numbered parameter's shape
        self._layout: Layout = ()  # the last whole backward pass's buckets
        self._layout_now: list[tuple[int, tuple[int, ...]]] = []
        # Whether _layout is DDP's rebuilt one: DDP lays out its first pass afresh (one bucket
        # of every parameter) and rebuilds its buckets after it.
        self._layout_settled = False
        self._passes = 0  # backward passes this process's hook has seen
        self._resume: _Resume | None = None
        self.bytes_sent = 0
        """Bytes this rank has sent for the buckets so far (ring allreduce for exact layers)."""
        self.bytes_uncompressed = 0
        """What plain DDP (a ring allreduce of every bucket) would have sent."""
        self._agreed = False  # whether the ranks' settings were compared (at the first call)
        # This backward pass's exact layers waiting for its last bucket (coalesces_exact),
        # and the futures of the buckets they came from, set once those are reduced.
        self._exact_later: list[torch.Tensor] = []
        self._waiting: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = []
        self.optimizer_in_hook = False
        """Whether an optimizer steps each bucket as its future completes
        (:func:`cgx2.ddp.optimizer_in_hook` sets it): a bucket whose exact layers are held
        for the last bucket then also has a future of its compressed layers alone, set as
        soon as they are averaged (:meth:`take_compressed_ready`), so that those are stepped
        at once and only the exact ones wait."""
        self._compressed_ready: dict[
            int, tuple[torch.futures.Future[torch.Tensor], tuple[int, ...]]
        ] = {}

    def take_compressed_ready(
        self, index: int
    ) -> tuple[torch.futures.Future[torch.Tensor], tuple[int, ...]] | None:
        """Where bucket ``index`` (its hook just called) holds its exact layers for the last
        bucket and :attr:`optimizer_in_hook` is set: a future set once its compressed layers
        are averaged, and those layers' places among the bucket's parameters; else None."""
        return self._compressed_ready.pop(index, None)

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint needs to resume the hook identically: its settings, counters,
        cgx2's seed stream (:func:`cgx2.seeding.get_state`), the residuals and the last
        backward pass's bucket layout (which layers were reduced together)."""
        if len(self._layout) == 1 and not self._layout_settled:
            # DDP's first pass has one bucket of every parameter (but with
            # find_unused_parameters, which never rebuilds); the rebuilt buckets are not known.
            logger.warning(
                "cgx2: CGXState.state_dict() after DDP's first backward pass only, before DDP "
                "rebuilt its buckets: a run resumed from it groups the next step's layers as "
                "that first pass did, not as the rebuilt buckets will (close, but it may not "
                "be bit-identical)"
            )
        return {
            **self._coding(),
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "bit_plans": dict(self._bit_plans),
            "calls": dict(self._calls),
            "iteration": self.iteration,
            "seed_state": seeding.get_state(),
            "error_feedback": None if self.errors is None else self.errors.state_dict(),
            "layout": [
                [index, list(ids), [list(self._shapes[p]) for p in ids]]
                for index, ids in self._layout
            ],
            "layout_settled": self._layout_settled,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s values (the settings too). The next backward pass
        reduces the layers grouped as in the checkpoint's last one, whatever buckets DDP
        hands over (a fresh DDP's first iteration has one bucket of every parameter)."""
        layout, shapes = _checked_layout(state.get("layout", []))
        self.bits = check_bits(state["bits"], "bits")
        self.bucket_size = check_bucket_size(state["bucket_size"])
        # A checkpoint from before rotation existed: none.
        self.rotation_block = int(state.get("rotation_block", DEFAULT_BLOCK))
        self.rotation = check_rotation(state.get("rotation"), self.rotation_block, self.bucket_size)
        self.layer_min_size = int(state["layer_min_size"])
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_uncompressed = int(state["bytes_uncompressed"])
        self._plans.clear()
        self._layout, self._layout_now = layout, []
        self._shapes.update(shapes)
        self._layout_settled = bool(state.get("layout_settled", False))
        self._resume = _Resume(layout) if layout else None
        self._bit_plans = dict(state.get("bit_plans", {}))
        self._calls = dict(state.get("calls", {}))
        self.iteration = int(state.get("iteration", self.start_iter))
        seeding.set_state(state["seed_state"])
        residuals = state.get("error_feedback")
        if residuals is not None:
            if self.mesh is not None:
                raise ValueError("error_feedback and a hierarchical mesh do not combine yet")
            if self.errors is None:
                self.errors = ErrorFeedback()
            self.errors.load_state_dict(residuals)
        elif self.errors is not None:  # a checkpoint without residuals: none are owed
            self.errors.clear()

    def over_mesh(self, t: torch.Tensor, group: dist.ProcessGroup, numel: int) -> bool:
        """Whether a compressed allreduce of ``numel`` values like ``t`` over ``group`` goes over
        :attr:`mesh`: always for a mesh the caller passed, by the policy's choice for
        ``mesh="auto"``'s."""
        if self.mesh is None:
            return False
        return not self._mesh_by_policy or policy.by_node_mesh(
            t, group, self.mesh, self._call_settings(self.bits), self.intra_broadcast, numel
        )

    def layer_bits(
        self, index: int, layers: Sequence[torch.Tensor], group: dist.ProcessGroup
    ) -> tuple[int, ...]:
        """Bits for each compressed layer of bucket ``index`` (adaptive mode), re-planned every
        ``replan_every`` calls from statistics all ranks share."""
        calls = self._calls.get(index, 0)
        self._calls[index] = calls + 1
        plan = self._bit_plans.get(index)
        if plan is None or len(plan) != len(layers) or calls % self.replan_every == 0:
            options, block = self.adaptive_bits, self.rotation_block if self.rotation else None
            errors = [layer_errors(x, self.bucket_size, options, block) for x in layers]
            numels = [x.numel() for x in layers]
            plan = plan_widths(errors, numels, options, self.bits, group, self.average_bits)
            self._bit_plans[index] = plan
        return plan

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream this state's hook codes and communicates on, one per device."""
        if device not in self._streams:
            self._streams[device] = coding_stream(device)
        return self._streams[device]

    def _coding(self) -> dict[str, object]:
        """How a layer is coded: what a checkpoint restores and the ranks compare first."""
        return {
            "bits": self.bits,
            "bucket_size": self.bucket_size,
            "rotation": self.rotation,
            "rotation_block": self.rotation_block,
            "layer_min_size": self.layer_min_size,
        }

    def _call_settings(self, bits: int) -> CallSettings:
        """How a bucket's compressed layers are averaged at ``bits``, each call's seed the next
        of cgx2's stream."""
        return CallSettings.of(
            bits,
            self.bucket_size,
            "avg",
            rotation=self.rotation,
            rotation_block=self.rotation_block,
        )

    def _settings(self) -> dict[str, object]:
        """The settings that decide how a bucket is reduced: what ranks compare before the
        first (the hook's and :func:`cgx2.ddp.compress`'s checks add their own)."""
        return {
            **self._coding(),
            "skip_incomplete": self.skip_incomplete,
            "mesh": None if self.mesh is None else list(self.mesh.mesh.shape),
            "adaptive_bits": self.adaptive_bits,
            "average_bits": self.average_bits,
            "replan_every": self.replan_every,
            "error_feedback": self.errors is not None,
            "start_iter": self.start_iter,
        }

    def param_ids(self, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """Each parameter's number: the order in which the hook first met it, which DDP's
        first iteration fixes (the model's parameter order) in a resumed run as in the run
        that saved it. Parameters are held weakly."""
        ids = []
        for p in params:
            number, new = self._param_numbers.number(p)
            if new:
                self._shapes.setdefault(number, tuple(p.shape))
            ids.append(number)
        return tuple(ids)

    def bucket_ids(self, index: int, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """:meth:`param_ids` of bucket ``index``'s parameters, looked up again only when they
        are not the parameters it held last (DDP rebuilt its buckets)."""
        addresses = tuple(map(id, params))
        cached = self._bucket_ids.get(index)
        if cached is not None:
            held, ids = cached
            if held == addresses:
                return ids
        ids = self.param_ids(params)
        self._bucket_ids[index] = (addresses, ids)
        return ids

    def _record(self, index: int, ids: tuple[int, ...], last: bool) -> None:
        """Note bucket ``index``'s parameters; the pass's layout is kept at its last bucket."""
        self._layout_now.append((index, ids))
        if last:
            self._layout, self._layout_now = tuple(self._layout_now), []
            self._layout_settled = self._passes > 0
            self._passes += 1

    def plan(self, bucket: dist.GradBucket) -> _Plan:
        """The bucket's layer plan, made at its first step and reused while shapes hold."""
        return self._plan(bucket.index(), tuple(tuple(g.shape) for g in bucket.gradients()))

    def _plan(self, index: int, shapes: tuple[tuple[int, ...], ...]) -> _Plan:
        """The plan of bucket ``index`` whose layers have ``shapes``."""
        plan = self._plans.get(index)
        if plan is None or plan.shapes != shapes:
            compressed, exact, layers, offset = [], [], [], 0
            for at, shape in enumerate(shapes):  # (not ``index``: the plan is kept by it)
                numel = torch.Size(shape).numel()
                if len(shape) > 1 and numel >= self.layer_min_size:
                    # CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS: a layer's last, shorter
                    # bucket goes uncompressed.
                    tail = numel % self.bucket_size if self.skip_incomplete else 0
                    if numel > tail:
                        compressed.append((offset, numel - tail))
                        layers.append(at)
                    if tail:
                        exact.append((offset + numel - tail, tail))
                else:
                    exact.append((offset, numel))
                offset += numel
            plan = _Plan(
                shapes=shapes,
                compressed=tuple(compressed),
                exact=tuple(exact),
                layers=tuple(layers),
            )
            self._plans[index] = plan
        return plan


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket across ranks, compressing its large layers (see module
    doc). Gradients come out bit-identical on every rank."""
    if not isinstance(state, CGXState):
        raise TypeError(f"cgx_hook needs a CGXState as its state, got {type(state).__name__}")
    if isinstance(bucket, tuple) and len(bucket) == 2 and isinstance(bucket[0], torch.Tensor):
        # DDP's Python reducer (torch.compile with compiled autograd, optimize_ddp =
        # "python_reducer") calls hook(state, (param.grad, param)) for each parameter and
        # expects the gradient averaged in place.
        if state.errors is not None:
            # Residuals are Python-side state the traced graph would freeze, not update.
            raise NotImplementedError(
                "CGXState(error_feedback=True) is not supported under compiled autograd's "
                "per-parameter reducer (optimize_ddp='python_reducer'); turn one of them off"
            )
        _reduce_parameter_grad_(state, bucket[0])
        return None
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            "cgx_hook is a DistributedDataParallel communication hook "
            "(ddp_model.register_comm_hook(state, cgx_hook)); it was called with a "
            f"{type(bucket).__name__} instead of a GradBucket (FSDP's hooks get tensors)"
        )
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if not state._agreed:
        _agree(state, group, buffer)
    # What the bucket says is read here, on DDP's thread; the reduction may run elsewhere.
    plan = state.plan(bucket)
    params = bucket.parameters()
    keys = None
    if state.errors is not None and plan.compressed:
        # Keyed by parameter, not by bucket position: DDP rebuilds its buckets after the
        # first iteration.
        keys = state.errors.keys(params[i] for i in plan.layers)
    warm = state.iteration >= state.start_iter
    index, last = bucket.index(), bucket.is_last()
    if last:
        state.iteration += 1
    resume = state._resume
    if resume is not None:
        if last:
            state._resume = None
        return _resume_bucket(state, group, resume, bucket, params, warm)
    state._record(index, state.bucket_ids(index, params), last)

    def reduce(asynchronous: bool = False) -> torch.Tensor | torch.futures.Future[torch.Tensor]:
        running = _reduce_bucket_(state, group, buffer, plan, keys, warm, index, asynchronous)
        return buffer if running is None else running

    if policy.runs_on_worker(buffer, group):
        # gloo would hold autograd's thread until each collective has crossed the wire. A CPU
        # bucket sent exact is left running, as DDP's own allreduce is: the worker goes on.
        return worker.submit(group, lambda: reduce(asynchronous=not buffer.is_cuda), [buffer])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    if index == 0:  # a backward pass that raised midway left its waiting buckets behind
        state._exact_later, state._waiting, state._compressed_ready = [], [], {}
    coalesces = policy.coalesces_exact(buffer, group)
    later = state._exact_later if coalesces else None
    side = state.stream(buffer.device) if buffer.is_cuda else None
    if side is not None:
        # On NCCL the coding and its waits on the collectives run on a side stream, so that
        # the backward pass goes on computing; the future's CUDA event (recorded on the side
        # stream) is what DDP's reducer waits for.
        side.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        before = len(later or ())
        _reduce_bucket_(state, group, buffer, plan, keys, warm, index, exact_later=later)
        if later is not None and len(later) > before:
            state._waiting.append((future, buffer))  # set when its exact layers are reduced
            if state.optimizer_in_hook:
                ready: torch.futures.Future[torch.Tensor] = torch.futures.Future(
                    devices=[buffer.device] if buffer.is_cuda else None
                )
                ready.set_result(buffer)  # on the side stream: after the compressed layers
                state._compressed_ready[index] = (ready, plan.layers)
        else:
            future.set_result(buffer)
        if last and later is not None:
            _reduce_exact_later_(state, group)
    if side is not None:
        buffer.record_stream(side)
    return future


def _reduce_exact_later_(state: CGXState, group: dist.ProcessGroup) -> None:
    """Average the backward pass's waiting exact layers in one plain allreduce, in place, then
    set the futures of the buckets they came from (DDP waits for those before it reads
    them)."""
    segments, waiting = state._exact_later, state._waiting
    state._exact_later, state._waiting = [], []
    if segments:
        _reduce_exact_(segments, group)
    for future, buffer in waiting:
        future.set_result(buffer)


def _agree(state: CGXState, group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Raise :class:`cgx2.collectives.agreement.DisagreementError` on every rank unless all
    hold the settings that decide the bucket's bytes alike: once, at the hook's first call
    (on the calling thread, so that DDP raises the error itself), which every rank makes."""
    settings = {
        **state._settings(),
        "intra_broadcast": state.intra_broadcast,
        "mesh_by_policy": state._mesh_by_policy,
        "iteration": state.iteration,
        "dtype": buffer.dtype,
    }
    agreement.check_settings(group, "cgx_hook", settings, buffer.device)
    state._agreed = True


def _reduce_parameter_grad_(state: CGXState, grad: torch.Tensor) -> None:
    """One parameter's gradient, averaged in place with the same per-layer rule as buckets;
    traceable by compiled autograd (custom op and functional collective only)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if state.bits != UNCOMPRESSED_BITS and grad.dim() > 1 and grad.numel() >= state.layer_min_size:
        torch.ops.cgx.quantized_allreduce_(  # DDP gives every rank the same parameters
            grad,
            state.bits,
            state.bucket_size,
            group.group_name,
            "avg",
            -1,
            state.skip_incomplete,
            False,
            *(() if state.rotation is None else (state.rotation, state.rotation_block)),
        )
    else:
        grad.copy_(funcol.all_reduce(grad / dist.get_world_size(group), "sum", group))


def _allreduce_layers_(
    state: CGXState,
    layers: list[torch.Tensor],
    bits: int,
    group: dist.ProcessGroup,
    keys: list[int] | None,
    route_numel: int | None = None,
) -> int:
    """:func:`cgx2.collectives.allreduce_fused_` of ``layers`` at ``bits``; with ``keys``, each
    layer's first-stage error becomes its residual. Returns the bytes this rank sent.
    ``route_numel``: the bucket's size, where ``layers`` are its layers of one width (the
    bucket compresses as a whole: the widths were planned as quantized)."""
    errors: list[torch.Tensor] | None = None if keys is None else []
    settings = state._call_settings(bits)
    sent = allreduce_fused_(layers, group, settings, errors, route_numel=route_numel)
    if keys is not None:
        state.errors.store_many_(keys, errors)
    return sent


def _reduce_bucket_(
    state: CGXState,
    group: dist.ProcessGroup,
    buffer: torch.Tensor,
    plan: _Plan,
    keys: list[int] | None,
    warm: bool,
    index: int,
    asynchronous: bool = False,
    exact_later: list[torch.Tensor] | None = None,
) -> torch.futures.Future[torch.Tensor] | None:
    """Average the bucket ``buffer`` in place by ``plan``: its compressed layers quantized
    (with ``keys``' residuals added first, when error feedback is on) once ``warm``, its exact
    layers plain, or, given ``exact_later``, appended to it for :func:`_reduce_exact_later_`.
    ``asynchronous``: a bucket sent whole and exact is left running, and a future of
    ``buffer`` returned (:meth:`.Transport.allreduce_plain_async_`)."""
    world = dist.get_world_size(group)
    padded = sum(padded_numel(n, state.bucket_size) for _, n in plan.compressed)
    state.bytes_uncompressed += ring_bytes_sent(buffer.numel() * buffer.element_size(), world)
    if keys is not None:
        # Residuals go in before anything reads the layers.
        layers = [buffer[offset : offset + numel] for offset, numel in plan.compressed]
        state.errors.add_many_(keys, layers)
    if (
        warm
        and plan.compressed
        and policy.compresses(buffer, group, state.bits, state.bucket_size, padded)
    ):
        layers = [buffer[offset : offset + numel] for offset, numel in plan.compressed]
        if state.over_mesh(buffer, group, padded):
            settings = state._call_settings(state.bits)
            state.bytes_sent += hierarchical_allreduce_fused_(
                layers, state.mesh, settings, state.intra_broadcast
            )
        elif state.adaptive_bits is not None:
            widths = state.layer_bits(index, layers, group)
            for bits in sorted(set(widths)):
                chosen = [i for i, b in enumerate(widths) if b == bits]
                state.bytes_sent += _allreduce_layers_(
                    state,
                    [layers[i] for i in chosen],
                    bits,
                    group,
                    None if keys is None else [keys[i] for i in chosen],
                    route_numel=padded,
                )
        else:
            state.bytes_sent += _allreduce_layers_(state, layers, state.bits, group, keys)
        if plan.exact:
            exact_bytes = sum(n for _, n in plan.exact) * buffer.element_size()
            state.bytes_sent += ring_bytes_sent(exact_bytes, world)
            segments = [buffer[o : o + n] for o, n in plan.exact]
            if exact_later is not None:
                exact_later.extend(segments)
            else:
                _reduce_exact_(segments, group)
    else:  # nothing to compress, or too little to pay on this interconnect: exact, in place
        for key in keys or ():  # the residuals were delivered exactly: nothing more is owed
            state.errors.discard_(key)
        state.bytes_sent += ring_bytes_sent(buffer.numel() * buffer.element_size(), world)
        if asynchronous:
            return policy.transport(buffer.device, group).allreduce_plain_async_(
                buffer, group, "avg"
            )
        _plain_(buffer, group)
    return None


def _reduce_exact_(segments: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """The exact average of ``segments`` in place, in one plain allreduce."""
    # torch.cat already copies: reduce that copy in place.
    reduced = _plain_(torch.cat(segments), group)
    at = 0
    for segment in segments:
        segment.copy_(reduced[at : at + segment.numel()])
        at += segment.numel()


def _plain_(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The exact average of ``t`` in place, through the transport the policy gives ``t``'s
    collectives (shared memory on one host, where the quantized ones ride it too)."""
    return policy.transport(t.device, group).allreduce_plain_(t, group, "avg")


class _Arrived(NamedTuple):
    """A parameter's gradient as it arrived after a checkpoint was loaded."""

    view: torch.Tensor  # the gradient's view in a live bucket
    param: torch.Tensor
    live: int  # that bucket's index


@dataclass(slots=True)
class _Waiting:
    """A live bucket waiting for the checkpoint's buckets that hold its layers."""

    left: int  # the checkpoint's buckets still to reduce
    future: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor


class _Resume:
    """The first backward pass after :meth:`CGXState.load_state_dict`: DDP's buckets arrive as
    laid out now, and the layers are reduced as the checkpoint's buckets grouped them, each
    such bucket once every one of its parameters has arrived (the same bits as the run that
    saved it: the quantized allreduce's chunks and seeds follow the grouping)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.reduced = 0  # the layout's buckets handed to a reduction so far
        self.bucket_of = {p: at for at, (_, ids) in enumerate(layout) for p in ids}
        self.arrived: dict[int, _Arrived] = {}  # by parameter number
        self.waiting: dict[int, _Waiting] = {}  # by live bucket index

    def ready(self) -> list[int]:
        """The layout's buckets whose parameters have all arrived, not yet handed over."""
        start = self.reduced
        while self.reduced < len(self.layout):
            _, ids = self.layout[self.reduced]
            if not all(p in self.arrived for p in ids):
                break
            self.reduced += 1
        return list(range(start, self.reduced))


def _checked_layout(layout: object) -> tuple[Layout, dict[int, tuple[int, ...]]]:
    """:meth:`CGXState.state_dict`'s ``layout`` as a :data:`Layout` and each parameter's
    shape, or a ``TypeError``/``ValueError`` naming it."""
    try:
        entries = [
            (int(index), [int(p) for p in ids], [tuple(int(d) for d in shape) for shape in shapes])
            for index, ids, shapes in layout
        ]
    except (TypeError, ValueError):
        raise TypeError(
            "CGXState state: 'layout' must be a list of [bucket index, [parameter numbers], "
            "[their shapes]]"
        ) from None
    numbers = [p for _, ids, _ in entries for p in ids]
    if len(numbers) != len(set(numbers)) or any(len(i) != len(s) for _, i, s in entries):
        raise ValueError("CGXState state: 'layout' names a parameter twice or lacks a shape")
    shapes = {p: shape for _, ids, s in entries for p, shape in zip(ids, s, strict=True)}
    return tuple((index, tuple(ids)) for index, ids, _ in entries), shapes


def _resume_bucket(
    state: CGXState,
    group: dist.ProcessGroup,
    resume: _Resume,
    bucket: dist.GradBucket,
    params: list[torch.Tensor],
    warm: bool,
) -> torch.futures.Future[torch.Tensor]:
    """The hook for a bucket of the first backward pass after a checkpoint was loaded: its
    future is set once each of the checkpoint's buckets that holds one of its layers has been
    reduced, in the checkpoint's order (:class:`_Resume`)."""
    buffer, live = bucket.buffer(), bucket.index()
    ids = state.param_ids(params)
    unknown = [
        i
        for i, (p, param) in enumerate(zip(ids, params, strict=True))
        if p not in resume.bucket_of or state._shapes[p] != tuple(param.shape)
    ]
    if unknown:
        raise ValueError(
            f"CGXState.load_state_dict: the checkpoint's buckets do not hold the parameter of "
            f"shape {tuple(params[unknown[0]].shape)} (DDP bucket {live}, place {unknown[0]}): "
            "load a checkpoint into the model it came from, built the same way"
        )
    offset = 0
    for p, param, grad in zip(ids, params, bucket.gradients(), strict=True):
        resume.arrived[p] = _Arrived(
            view=buffer[offset : offset + grad.numel()], param=param, live=live
        )
        offset += grad.numel()
    owners = {resume.bucket_of[p] for p in ids}
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    resume.waiting[live] = _Waiting(left=len(owners), future=future, buffer=buffer)
    ready = resume.ready()
    if bucket.is_last() and resume.reduced < len(resume.layout):
        _, held = resume.layout[resume.reduced]
        missing = [p for p in held if p not in resume.arrived]
        raise ValueError(
            f"CGXState.load_state_dict: the checkpoint's bucket {resume.reduced} holds "
            f"parameters this model's DDP never handed over ({len(missing)} of them): load a "
            "checkpoint into the model it came from, built the same way"
        )
    # The checkpoint's layout stays the one to save: it is what the run goes on with.
    state._layout = resume.layout
    if bucket.is_last():
        state._passes += 1

    def reduce() -> torch.Tensor:
        try:
            for at in ready:
                _reduce_as_saved_(state, group, resume, at, warm)
        except BaseException as e:
            for waiting in list(resume.waiting.values()):
                if not waiting.future.done():
                    waiting.future.set_exception(e)
            raise
        return buffer

    if not ready:
        return future
    if policy.runs_on_worker(buffer, group):
        worker.submit(group, reduce, [buffer])
        return future
    if not buffer.is_cuda:
        reduce()
        return future
    side = state.stream(buffer.device)
    side.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(side):
        reduce()
    for waiting in list(resume.waiting.values()):
        waiting.buffer.record_stream(side)
    return future


def _reduce_as_saved_(
    state: CGXState, group: dist.ProcessGroup, resume: _Resume, at: int, warm: bool
) -> None:
    """Reduce the checkpoint's bucket ``at`` as the run that saved it did: its layers copied
    into one buffer laid out as that bucket was, reduced, and copied back; then set the
    futures of the live buckets it completes."""
    index, ids = resume.layout[at]
    views = [resume.arrived[p].view for p in ids]
    params = [resume.arrived[p].param for p in ids]
    plan = state._plan(index, tuple(tuple(p.shape) for p in params))
    keys = None
    if state.errors is not None and plan.compressed:
        keys = state.errors.keys(params[i] for i in plan.layers)
    buffer = torch.cat(views)
    _reduce_bucket_(state, group, buffer, plan, keys, warm, index)
    for view, reduced in zip(views, buffer.split([v.numel() for v in views]), strict=True):
        view.copy_(reduced)
    for live in {resume.arrived[p].live for p in ids}:
        waiting = resume.waiting[live]
        waiting.left -= 1
        if waiting.left == 0:
            waiting.future.set_result(waiting.buffer)
