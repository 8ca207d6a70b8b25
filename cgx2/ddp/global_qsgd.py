"""Global-QSGD's DDP hooks (``gqsgd.ddphook``): levels against one global norm, so that every
rank's integers add up exactly in one integer allreduce; THC, QSGD, exponential dithering,
PowerSGD and the plain allreduce as baselines. The level maths is the codecs'
(:mod:`cgx2.codecs.global_norm`, :mod:`cgx2.codecs.exponential`); here are the collectives.

Each hook is ``hook(state, bucket)``: ``state`` is None (the world), a process group, or a
:class:`GlobalQSGDState` (group, bits, seed). Gradients are averaged, bit-identical on every
rank. ``ddp.register_comm_hook(None, standard_dithering_hook)`` as with Global-QSGD.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from .. import seeding
from ..codecs import global_norm
from ..codecs.exponential import exponential_codec, exponential_codes, exponential_values
from ..codecs.global_norm import level_dtype
from ..collectives import agreement, policy
from ..collectives.fusion import ring_bytes_sent
from ..comm import all_gather_single, group_state, worker
from ..seeding import derive_key, next_seed
from .error_feedback import ErrorFeedback
from .lgreco import PowerSGDState, powerSGD_hook

__all__ = [
    "GlobalQSGDState",
    "PowerSGDState",
    "default_hook",
    "exponential_codes",
    "exponential_dithering",
    "exponential_dithering_hook",
    "exponential_values",
    "level_dtype",
    "levels_4bit",
    "linear_levels",
    "powerSGD_hook",
    "qsgd",
    "qsgd_hook",
    "standard_dithering",
    "standard_dithering_4bit",
    "standard_dithering_4bit_hook",
    "standard_dithering_hook",
    "thc",
    "thc_hook",
]


@dataclass
class GlobalQSGDState:
    """Settings for the Global-QSGD hooks. ``bits`` None keeps Global-QSGD's int8 wire: each
    rank gets floor(127 / W) levels a side, so the sum fits int8. ``bits`` b gives every rank
    2^(b-1) - 1 levels a side and sums in the narrowest integer that cannot overflow
    (:func:`level_dtype`). ``exponential_dithering_hook`` reads ``bits`` as its code width
    (default 8).

    ``error_feedback``: the standard dithering, THC, QSGD and exponential hooks keep, per
    parameter, what this rank put in minus its own decoded contribution (exact: every rank's
    quantized values are summed or gathered without further loss) and add it to the next
    step's gradient (:class:`cgx2.ddp.error_feedback.ErrorFeedback`, checkpointed)."""

    process_group: dist.ProcessGroup | None = None
    bits: int | None = None
    bytes_sent: int = 0
    """What this rank sent: allreduces counted as a ring sends them, 2(W-1)/W of the input;
    all-gathers (W-1) times the input; the parameter-server pattern as an allreduce."""
    error_feedback: bool = False
    errors: ErrorFeedback | None = field(default=None, init=False, repr=False, compare=False)
    """The residuals (None: error feedback off)."""
    # Whether the ranks' settings were compared (at the first call); None: a state made for
    # one call (the hook's state was None or a group), whose group remembers it (its GroupState).
    _agreed: bool | None = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bits is not None and (isinstance(self.bits, bool) or not 2 <= self.bits <= 16):
            raise ValueError(f"bits must be in 2..16 (or None for int8 levels), got {self.bits}")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(
                f"error_feedback must be a bool, got {type(self.error_feedback).__name__}"
            )
        if not self.error_feedback:
            self.errors = None
        elif self.errors is None:  # kept when load_state_dict checks the settings again
            self.errors = ErrorFeedback()

    def state_dict(self) -> dict[str, object]:
        """``bits``, the residuals and cgx2's seed stream, so that a resumed run rounds
        identically."""
        errors = None if self.errors is None else self.errors.state_dict()
        return {
            "bits": self.bits,
            "bytes_sent": self.bytes_sent,
            "seed_state": seeding.get_state(),
            "error_feedback": errors,
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.bits = state["bits"]
        self.bytes_sent = int(state.get("bytes_sent", 0))
        residuals = state.get("error_feedback")
        if residuals is None and self.errors is not None:  # none saved: none are owed
            self.errors.clear()  # the parameters keep their keys
        self.error_feedback = self.error_feedback or residuals is not None
        self.__post_init__()
        seeding.set_state(state["seed_state"])
        if residuals is not None:
            self.errors.load_state_dict(residuals)


def _state(state: object) -> GlobalQSGDState:
    if isinstance(state, GlobalQSGDState):
        return state
    if state is None or isinstance(state, dist.ProcessGroup):
        made = GlobalQSGDState(process_group=state)
        made._agreed = None
        return made
    raise TypeError(
        f"a Global-QSGD hook's state must be None, a ProcessGroup or a GlobalQSGDState, got "
        f"{type(state).__name__}"
    )


def _group(state: GlobalQSGDState) -> dist.ProcessGroup:
    return state.process_group if state.process_group is not None else dist.group.WORLD


def _agree(state: GlobalQSGDState, hook: str, g: torch.Tensor) -> None:
    """Raise :class:`cgx2.collectives.agreement.DisagreementError` on every rank unless all
    run the same hook with the same settings: at the state's first call (for a state of None
    or a group, the group's first call of the hook), which every rank makes, on the calling
    thread (DDP raises the error itself)."""
    if state._agreed:
        return
    group = _group(state)
    if state._agreed is None and hook in group_state(group).settings_agreed:
        return
    settings = {
        "hook": hook,
        "bits": state.bits,
        "error_feedback": state.errors is not None,
        "dtype": g.dtype,
    }
    agreement.check_settings(group, "a Global-QSGD hook", settings, g.device)
    if state._agreed is None:
        group_state(group).settings_agreed.add(hook)
    else:
        state._agreed = True


def _rounding_key(group: dist.ProcessGroup) -> int:
    """The key of this rank's stochastic rounding, from cgx2's seed stream and the rank."""
    return derive_key(next_seed(), dist.get_rank(group))


def _global_norm(g: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    norm = g.abs().amax().float().reshape(1)
    dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
    return norm


def linear_levels(
    g: torch.Tensor,
    state: GlobalQSGDState,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """This rank's integer levels of ``g / global norm`` (stochastically rounded, within
    [-L, L]), the global norm, L and W."""
    group = _group(state)
    world = dist.get_world_size(group)
    norm = _global_norm(g, group)
    levels = global_norm.levels_per_side(state.bits, world)
    q = global_norm.quantize(g, norm, levels, _rounding_key(group), level_dtype(levels, world))
    return q, norm, levels, world


def _keep_error(residual: torch.Tensor | None, g: torch.Tensor, decoded: torch.Tensor) -> None:
    """``residual = g − decoded`` (this rank's own contribution, in ``g``'s units); the
    caller's :meth:`~cgx2.ddp.error_feedback.ErrorFeedback.store_` zeroes non-finite values."""
    if residual is not None:
        torch.sub(g, decoded, out=residual)


def _linear_average(
    g: torch.Tensor,
    state: GlobalQSGDState,
    residual: torch.Tensor | None,
    sum_levels: Callable[[torch.Tensor, dist.ProcessGroup], None],
) -> torch.Tensor:
    """The average of ``g`` from global-norm levels summed in place by ``sum_levels``."""
    q, norm, levels, world = linear_levels(g, state)
    _keep_error(residual, g, global_norm.dequantize(q, norm, levels))  # before the sum
    sum_levels(q, _group(state))
    state.bytes_sent += ring_bytes_sent(q.numel() * q.element_size() + 4, world)
    return global_norm.dequantize(q, norm, levels, world)


def _allreduce_levels(q: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(q, group=group)


def _parameter_server_levels(q: torch.Tensor, group: dist.ProcessGroup) -> None:
    server = dist.get_global_rank(group, 0)
    dist.reduce(q, dst=server, group=group)
    dist.broadcast(q, src=server, group=group)


def standard_dithering(
    g: torch.Tensor, state: GlobalQSGDState, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of ``g`` over the group by standard dithering (see the hook); ``residual``,
    when given, receives ``g`` minus this rank's decoded contribution."""
    return _linear_average(g, state, residual, _allreduce_levels)


def thc(
    g: torch.Tensor, state: GlobalQSGDState, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of ``g`` by THC's levels and parameter-server sum (see the hook);
    ``residual`` as in :func:`standard_dithering`."""
    return _linear_average(g, state, residual, _parameter_server_levels)


def qsgd(
    g: torch.Tensor, state: GlobalQSGDState, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of ``g`` by QSGD with local norms and an all-gather (see the hook);
    ``residual`` as in :func:`standard_dithering`."""
    group = _group(state)
    world = dist.get_world_size(group)
    levels = 127 if state.bits is None else 2 ** (state.bits - 1) - 1
    norm = g.abs().amax().float().reshape(1)
    q = global_norm.quantize(g, norm, levels, _rounding_key(group), level_dtype(levels, 1))
    _keep_error(residual, g, global_norm.dequantize(q, norm, levels))
    all_q = torch.empty(world * q.numel(), dtype=q.dtype, device=q.device)
    all_norms = torch.empty(world, dtype=torch.float32, device=g.device)
    all_gather_single(all_q, q, group=group)
    all_q = all_q.view(world, -1)
    state.bytes_sent += (world - 1) * (q.numel() * q.element_size() + 4)
    all_gather_single(all_norms, norm, group=group)
    return global_norm.average_rows(all_q, all_norms, levels)


def exponential_dithering(
    g: torch.Tensor, state: GlobalQSGDState, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of ``g`` by exponential dithering (see the hook); ``residual`` as in
    :func:`standard_dithering`."""
    group = _group(state)
    world = dist.get_world_size(group)
    norm = _global_norm(g, group)
    # The Triton kernels on CUDA (one pass over g), the torch reference elsewhere: same codes.
    codec = exponential_codec(g.device)
    key = derive_key(next_seed(), dist.get_rank(group))
    codes = codec.encode(g, norm, state.bits or 8, key)
    if residual is not None:
        _keep_error(residual, g, codec.decode(codes).view(g.shape) * norm)
    gathered = torch.empty(world * codes.numel(), dtype=codes.dtype, device=codes.device)
    all_gather_single(gathered, codes, group=group)
    gathered_bytes = (world - 1) * codes.numel() * codes.element_size()
    state.bytes_sent += gathered_bytes + ring_bytes_sent(4, world)
    return codec.decode_sum(gathered.view(world, -1), norm / world)


def _reduce_bucket(
    bucket: dist.GradBucket, state: GlobalQSGDState, reduce: Callable[..., torch.Tensor]
) -> torch.futures.Future[torch.Tensor]:
    """A future of the bucket averaged by ``reduce(buffer, state)``, with the state's error
    feedback around it when it is on; on the group's worker thread where the collectives
    would hold DDP's (:func:`cgx2.collectives.policy.runs_on_worker`)."""
    g = bucket.buffer()
    _agree(state, reduce.__name__, g)
    keys = spans = None
    if state.errors is not None:
        # Keyed by parameter, not by bucket position: DDP rebuilds its buckets after the first
        # iteration. Each gradient is a view into the buffer; its offset says where.
        keys = state.errors.keys(bucket.parameters())
        base = g.storage_offset()
        spans = [(grad.storage_offset() - base, grad.numel()) for grad in bucket.gradients()]

    def run() -> torch.Tensor:
        if keys is None:
            return g.copy_(reduce(g, state))
        state.errors.add_many_(keys, [g[start : start + n] for start, n in spans])
        residual = torch.empty_like(g)
        out = reduce(g, state, residual=residual)
        state.errors.store_many_(keys, [residual[start : start + n] for start, n in spans])
        return g.copy_(out)

    group = _group(state)
    if policy.runs_on_worker(g, group):
        return worker.submit(group, run, [g])
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[g.device] if g.is_cuda else None
    )
    future.set_result(run())
    return future


def default_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The plain average (torch's ``allreduce_hook``)."""
    made = _state(state)
    _agree(made, "default", bucket.buffer())
    return allreduce_hook(_group(made), bucket)


def standard_dithering_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Global-QSGD's standard dithering: ``g / max|g|`` over all ranks (one small allreduce),
    stochastically rounded to integer levels that one integer allreduce sums exactly.
    Unbiased."""
    return _reduce_bucket(bucket, _state(state), standard_dithering)


def levels_4bit(
    g: torch.Tensor,
    state: GlobalQSGDState,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """This rank's levels of ``g / global norm`` for the packed 4-bit wire, L = floor(15 / 2W)
    a side: W nibbles of level + L (each 0..2L) add up to at most 2LW <= 15, so a byte-wise
    sum never carries from one nibble into the next. Stochastically rounded, so unbiased:
    E[level] = g L / norm. Returns (int8 levels in [-L, L], the global norm, L, W)."""
    group = _group(state)
    world = dist.get_world_size(group)
    levels = global_norm.offset_levels(world)  # raises before any collective: on every rank
    norm = _global_norm(g, group)
    q = global_norm.quantize(g, norm, levels, _rounding_key(group), torch.int8)
    return q, norm, levels, world


def standard_dithering_4bit(
    g: torch.Tensor, state: GlobalQSGDState, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The average of ``g`` by standard dithering on packed 4-bit levels (see the hook);
    ``residual``, when given, receives ``g`` minus this rank's decoded contribution."""
    q, norm, levels, world = levels_4bit(g, state)
    if residual is not None:
        _keep_error(residual, g, global_norm.dequantize(q, norm, levels))
    packed = global_norm.pack_offset_levels(q, levels)
    # uint8 SUM: gloo and NCCL both reduce it; the nibble sums stay <= 15, so no carries.
    dist.all_reduce(packed, group=_group(state))
    state.bytes_sent += ring_bytes_sent(packed.numel() + 4, world)
    total = global_norm.unpack_offset_sums(packed, q.numel(), levels, world)
    return global_norm.dequantize(total, norm, levels, world).view(g.shape)


def standard_dithering_4bit_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Global-QSGD's 4-bit standard dithering: levels of ``g / max|g|`` over all ranks,
    offset to nibbles and packed two per byte, summed by one uint8 allreduce (half the bytes
    of int8 levels). L = floor(15 / 2W) levels a side per rank (7 for 1 rank, 3 for 2, 2 for
    3, 1 for 4 to 7), so that no nibble sum carries; decoded as (sum - W L) max / (L W).
    Unbiased: stochastic rounding gives E[level] = g L / max, so E[decoded] is the average.
    More than 7 ranks raise ``ValueError``. ``bits`` of the state is not read."""
    return _reduce_bucket(bucket, _state(state), standard_dithering_4bit)


def thc_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """THC (uniform, global norm), summed as a parameter server does: the levels are reduced
    to the group's first rank and broadcast back. Unbiased; the levels of standard
    dithering, another communication pattern."""
    return _reduce_bucket(bucket, _state(state), thc)


def qsgd_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """QSGD with each rank's own norm: int8 levels and the norms are all-gathered, and every
    rank decodes all of them and sums. Unbiased; sends W times what an allreduce would."""
    return _reduce_bucket(bucket, _state(state), qsgd)


def exponential_dithering_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Global-QSGD's exponential dithering: ``g / max|g|`` over all ranks on power-of-two
    levels with stochastic rounding (unbiased). The codes do not add as integers, so they
    are all-gathered and every rank decodes and sums them in the same order."""
    return _reduce_bucket(bucket, _state(state), exponential_dithering)
