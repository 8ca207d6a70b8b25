"""L-GreCo's PowerSGD (Global-QSGD's ``lgreco_hook``): every layer its own rank, chosen by the
knapsack of :mod:`cgx2.collectives.adaptive` so the fewest floats travel at a uniform rank's
error.

``model.register_comm_hook(LGreCoState(group, 4, start_powerSGD_iter=10), lgreco_hook)``:
at the first compressed step and every ``replan_every`` steps after, each compressed layer's
error at every rank in ``ranks`` is measured (the best rank-r approximation's squared error,
summed over ranks so all plan alike), and the ranks that send the fewest P and Q floats while
the bucket's total error stays within that of ``matrix_approximation_rank`` everywhere are
chosen. Between re-plans
the hook is torch's PowerSGD per layer: error feedback, warm-started Q, one power iteration;
with one rank in ``ranks`` it reproduces torch's ``powerSGD_hook`` bit for bit.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import functools
import inspect
import itertools
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize,
    _should_compress,
)

from ..collectives import agreement
from ..collectives.adaptive import plan_bits
from ..collectives.fusion import ring_bytes_sent
from .param_numbers import ParamNumbers

__all__ = ["LGreCoState", "PowerSGDState", "lgreco_hook", "powerSGD_hook", "rank_errors"]

_OVERSAMPLE = 8  # extra columns of the randomized SVD: its top singular values come out tighter


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check(rank: object, ranks: Sequence[int] | None, replan_every: object) -> tuple[int, ...]:
    if not _is_int(rank) or rank < 1:
        raise ValueError(f"matrix_approximation_rank must be a positive int, got {rank!r}")
    rank = int(rank)  # a numpy integer has no bit_length
    if ranks is None:  # powers of two up to twice the baseline, and the baseline
        ranks = [2**k for k in range(rank.bit_length() + 1)] + [rank]
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
        raise ValueError(f"ranks must be a non-empty sequence of positive ints, got {ranks!r}")
    if not all(_is_int(r) and r >= 1 for r in ranks):
        raise ValueError(f"ranks must be positive ints, got {tuple(ranks)}")
    options = tuple(sorted({int(r) for r in ranks}))
    if rank not in options:
        raise ValueError(
            f"ranks {options} must include matrix_approximation_rank ({rank}): "
            "the error budget is that rank's, everywhere"
        )
    if not _is_int(replan_every) or replan_every < 1:
        raise ValueError(f"replan_every must be a positive int, got {replan_every!r}")
    return options


def rank_errors(matrix: torch.Tensor, ranks: Sequence[int], seed: int = 0) -> torch.Tensor:
    """Squared Frobenius error of the best rank-r approximation of ``matrix`` for each r in
    ``ranks`` (||M||^2 minus the top r squared singular values; 0 from r = min(shape) on), as
    float64 on the matrix's device. Small matrices get exact singular values, large ones
    torch's randomized ``svd_lowrank`` (seeded by ``seed``, the global RNG left untouched):
    only the top max(ranks) are needed. Non-finite values count as 0, so that every rank
    reaches the collective that follows (an SVD of a NaN matrix raises on the CPU)."""
    m = matrix.detach().float().nan_to_num(0.0, 0.0, 0.0)
    total = m.square().sum(dtype=torch.float64)
    top = min(max(ranks), *m.shape)
    q = min(top + _OVERSAMPLE, *m.shape)
    if min(m.shape) <= 4 * q:
        s = torch.linalg.svdvals(m)
    else:
        # manual_seed reseeds every device's generator: fork them all (the user's streams)
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            torch.manual_seed(seed)
            _, s, _ = torch.svd_lowrank(m, q=q, niter=4)
    captured = torch.cumsum(s[:top].double().square(), 0)
    return (total - captured[[min(r, top) - 1 for r in ranks]]).clamp(min=0)


class LGreCoState(torch_powersgd.PowerSGDState):
    """torch's ``PowerSGDState`` plus per-layer ranks. ``matrix_approximation_rank`` is the
    baseline: it decides which layers are compressed (torch's ``min_compression_rate`` test)
    and its error, everywhere, is the budget. ``ranks`` are the candidates (default powers of
    two up to twice the baseline, e.g. 1, 2, 4, 8), capped by each layer's shape; plans are
    made at the first compressed step and every ``replan_every`` steps after.

    Unlike torch's state, the residuals (``error_dict``), P and Q (``p/q_memory_dict``) and
    ranks (``layer_ranks``) are kept per parameter, under a number given in the order the
    hook first meets them: the first step's buckets, which the model fixes. So they survive
    DDP's bucket rebuild after the first step and a resumed run's freshly built model, whose
    first step has the original layout again. ``bytes_sent`` counts this rank's sends as a
    ring allreduce does (2(W-1)/W of each input), planning's error table included.
    ``state_dict()``/``load_state_dict()`` carry the settings, counters, seed generator,
    ranks, P, Q and residuals: a resumed run continues identically."""

    __slots__ = [
        "_agreed",
        "_numbers",
        "bytes_sent",
        "layer_ranks",
        "plan_errors",
        "ranks",
        "replan_every",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        ranks: Sequence[int] | None = None,
        replan_every: int = 100,
    ) -> None:
        self.ranks = _check(matrix_approximation_rank, ranks, replan_every)
        self.replan_every = int(replan_every)
        super().__init__(
            process_group,
            matrix_approximation_rank,
            start_powerSGD_iter,
            min_compression_rate,
            use_error_feedback,
            warm_start,
            orthogonalization_epsilon,
            random_seed,
            compression_stats_logging_frequency,
        )
        self.bytes_sent = 0
        self.layer_ranks: dict[int, int] = {}  # parameter number -> its planned rank
        # bucket -> (planned error, the baseline's error) at its last plan, for inspection
        self.plan_errors: dict[int, tuple[float, float]] = {}
        self._numbers = ParamNumbers()
        self._agreed = False  # whether the ranks' settings were compared (at the first call)

    def __getstate__(self) -> dict[str, Any]:
        # torch's reads ``self.__slots__``: here this class's alone, so gather the MRO's. The
        # parameter numbers are held weakly and not pickled: they are given again in order.
        slots = [s for cls in type(self).__mro__ for s in getattr(cls, "__slots__", ())]
        state = {s: getattr(self, s) for s in slots if s not in ("process_group", "_numbers")}
        return state | {"_agreed": False}  # compared again where it is loaded

    def __setstate__(self, state: dict[str, Any]) -> None:
        # "_next_key": what states pickled before ParamNumbers held their numbers carry
        super().__setstate__({k: v for k, v in state.items() if k != "_next_key"})
        self._numbers = ParamNumbers()

    def keys(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Each parameter's number (a new one, in order, the first time it is seen)."""
        return self._numbers.numbers(params)

    def plan(
        self,
        index: int,
        keys: Sequence[int],
        matrices: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
    ) -> list[int]:
        """The rank of each matrix of bucket ``index``: planned at the first compressed step
        (or for a layer without one) and every ``replan_every`` steps, from the error table
        summed over the group (one small allreduce), so that every rank plans the same."""
        due = (self.iter - self.start_powerSGD_iter) % self.replan_every == 0
        if not due and all(k in self.layer_ranks for k in keys):
            return [self.layer_ranks[k] for k in keys]
        shapes = [(m.shape[0], m.shape[1]) for m in matrices]
        if len(self.ranks) == 1:
            chosen = [self.ranks[0]] * len(matrices)
        else:
            seed = 1_000_003 * index + self.iter  # the same sketch on every rank, run to run
            errors = torch.stack(
                [rank_errors(m, self.ranks, seed + i) for i, m in enumerate(matrices)]
            )
            dist.all_reduce(errors, group=group)
            self.bytes_sent += ring_bytes_sent(
                errors.numel() * errors.element_size(), dist.get_world_size(group)
            )
            errors = errors.cpu()
            base = self.ranks.index(self.matrix_approximation_rank)
            budget = float(errors[:, base].sum())
            # floats one rank sends per layer: P (n x r) and Q (m x r), r capped as torch does
            costs = [[(n + m) * min(r, n, m) for r in self.ranks] for n, m in shapes]
            chosen = plan_bits(
                errors.tolist(),
                [n * m for n, m in shapes],
                self.ranks,
                budget,
                baseline=self.matrix_approximation_rank,
                costs=costs,
            )
            planned = sum(float(errors[i, self.ranks.index(r)]) for i, r in enumerate(chosen))
            self.plan_errors[index] = (planned, budget)
        ranks = [min(r, *s) for r, s in zip(chosen, shapes, strict=True)]
        self.layer_ranks.update(zip(keys, ranks, strict=True))
        return ranks

    def state_dict(self) -> dict[str, Any]:
        """Settings, counters, the seed generator, and per parameter number the rank, P, Q
        and residual (cloned). Tensors and plain Python values only: ``torch.load`` reads it
        with ``weights_only=True``."""
        _, keys, pos, has_gauss, gauss = self.rng.get_state()
        return {
            "matrix_approximation_rank": self.matrix_approximation_rank,
            "ranks": self.ranks,
            "replan_every": self.replan_every,
            "start_powerSGD_iter": self.start_powerSGD_iter,
            "min_compression_rate": self.min_compression_rate,
            "use_error_feedback": self.use_error_feedback,
            "warm_start": self.warm_start,
            "orthogonalization_epsilon": self.orthogonalization_epsilon,
            "iter": self.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "layer_ranks": dict(self.layer_ranks),
            "error": {k: v.detach().clone() for k, v in self.error_dict.items()},
            "p": {k: v.detach().clone() for k, v in self.p_memory_dict.items()},
            "q": {k: v.detach().clone() for k, v in self.q_memory_dict.items()},
            "bytes_sent": self.bytes_sent,
            "numel_before": self.total_numel_before_compression,
            "numel_after": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, into the model it was saved from (the
        parameter numbers are given again at the next step). Tensors move to the gradients'
        device when first used."""
        self.ranks = _check(
            state["matrix_approximation_rank"], list(state["ranks"]), state["replan_every"]
        )
        for key in (
            "matrix_approximation_rank",
            "replan_every",
            "start_powerSGD_iter",
            "min_compression_rate",
            "use_error_feedback",
            "warm_start",
            "orthogonalization_epsilon",
            "iter",
            "bytes_sent",
            "next_stats_report",
        ):
            setattr(self, key, state[key])
        rng = state["rng"]
        self.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["gauss"],
            )
        )
        self.layer_ranks = dict(state["layer_ranks"])
        self.error_dict = {k: v.clone() for k, v in state["error"].items()}
        self.p_memory_dict = {k: v.clone() for k, v in state["p"].items()}
        self.q_memory_dict = {k: v.clone() for k, v in state["q"].items()}
        self.total_numel_before_compression = state["numel_before"]
        self.total_numel_after_compression = state["numel_after"]


def powersgd_arguments(
    **options: tuple[Any, Any],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate the ``__init__(self, settings, **options)`` of a state compatible with torch's
    ``PowerSGDState``: it is called with torch's arguments (``process_group`` to
    ``compression_stats_logging_frequency``, as :class:`LGreCoState` spells them) and then
    ``options`` (name: (annotation, default)), positionally or by name, and receives torch's
    by name in ``settings``. Its signature shows them all, as if written out."""
    inherited = inspect.signature(LGreCoState.__init__).parameters.values()
    torch_arguments = list(itertools.takewhile(lambda p: p.name != "ranks", inherited))
    own = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=a)
        for name, (a, d) in options.items()
    ]
    signature = inspect.Signature([*torch_arguments, *own], return_annotation=None)

    def decorate(init: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(init)
        def __init__(self: LGreCoState, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            settings = dict(bound.arguments)
            del settings["self"]
            init(self, settings, **{name: settings.pop(name) for name in options})

        __init__.__signature__ = signature  # type: ignore[attr-defined]
        return __init__

    return decorate


class PowerSGDState(LGreCoState):
    """torch's ``PowerSGDState``, one rank for every layer: with :func:`powerSGD_hook` it is
    torch's PowerSGD bit for bit (the same P, Q, residuals and random Q), but its state is
    kept per parameter (see :class:`LGreCoState`), so it survives DDP's bucket rebuild and a
    checkpoint (``state_dict``/``load_state_dict``), and it counts ``bytes_sent``. torch's own
    keys residuals and P/Q by bucket index, which a resumed run's first step, laid out afresh
    by DDP, does not match. ``batch_tensors_with_same_shape`` is accepted and has no effect:
    layers are compressed one by one."""

    __slots__ = ()

    @powersgd_arguments(batch_tensors_with_same_shape=(bool, False))
    def __init__(self, settings: dict[str, Any], batch_tensors_with_same_shape: bool) -> None:
        super().__init__(**settings, ranks=(settings["matrix_approximation_rank"],))
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape


def _views(flat: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset : offset + rows * cols].view(1, rows, cols))
        offset += rows * cols
    return out


def _start_qs(state: LGreCoState, keys: Sequence[int], qs: Sequence[torch.Tensor]) -> None:
    """Fill each Q (1 x m x r): with warm start the columns its layer kept from the last
    step, the rest (all, at the first step or without warm start) drawn at random from one
    seed of ``state.rng`` per bucket and step, so every rank draws the same, in torch's
    order."""
    missing = []
    for key, q in zip(keys, qs, strict=True):
        old = state.q_memory_dict.get(key) if state.warm_start else None
        keep = 0 if old is None or old.shape[0] != q.shape[1] else min(old.shape[1], q.shape[2])
        if keep:
            q[0, :, :keep] = old[:, :keep]
        if keep < q.shape[2]:
            missing.append((q, keep))
    if missing:
        with torch.random.fork_rng(devices=[]):  # as torch: the global RNG is left as it was
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q, keep in missing:
                draw = torch.randn(q.shape[1], q.shape[2] - keep, device="cpu", dtype=q.dtype)
                q[0, :, keep:] = draw


def _agree(state: LGreCoState, group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    """Raise :class:`cgx2.collectives.agreement.DisagreementError` on every rank unless all
    hold the settings that decide what the hook sends, and the same random generator (every
    rank must draw the same Q): once, at the hook's first call, which every rank makes."""
    _, keys, pos, _, _ = state.rng.get_state()
    settings = {
        "matrix_approximation_rank": state.matrix_approximation_rank,
        "ranks": state.ranks,
        "replan_every": state.replan_every,
        "start_powerSGD_iter": state.start_powerSGD_iter,
        "min_compression_rate": state.min_compression_rate,
        "use_error_feedback": state.use_error_feedback,
        "warm_start": state.warm_start,
        "orthogonalization_epsilon": state.orthogonalization_epsilon,
        "iter": state.iter,
        "random_seed": f"the generator at {zlib.crc32(keys.tobytes()):08x}/{pos}",
        "dtype": buffer.dtype,
    }
    agreement.check_settings(group, "powerSGD_hook", settings, buffer.device)
    state._agreed = True


def powerSGD_hook(
    state: torch_powersgd.PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD with L-GreCo's per-layer ranks (see the module). Plain allreduce for the first
    ``state.start_powerSGD_iter`` steps; then per bucket: add the residuals, allreduce the
    layers torch would not compress, and for the others P = M Q, allreduce P, orthogonalize,
    Q = M^T P, allreduce Q, M = P Q^T / W, keeping the new residuals. Biased, like PowerSGD;
    identical on every rank. Given torch's own ``PowerSGDState``, it is torch's hook."""
    if not isinstance(state, LGreCoState):
        return torch_powersgd.powerSGD_hook(state, bucket)
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    if not state._agreed:
        _agree(state, group, buffer)
    keys = state.keys(bucket.parameters())  # numbered at the first step, in its layout
    if state.iter < state.start_powerSGD_iter:
        state.bytes_sent += ring_bytes_sent(buffer.numel() * buffer.element_size(), world)
        state.maybe_increase_iter(bucket)
        return default_hooks._allreduce_fut(group, buffer)

    grads = bucket.gradients()
    local = None
    if state.use_error_feedback:
        for key, grad in zip(keys, grads, strict=True):
            residual = state.error_dict.get(key)
            if residual is not None:
                if residual.numel() != grad.numel():
                    raise ValueError(
                        f"PowerSGD: the residual of parameter {key} has {residual.numel()} "
                        f"values, its gradient {grad.numel()}; load a checkpoint into the model "
                        "it came from, built the same way"
                    )
                grad.add_(residual.to(grad.device).view_as(grad))
        local = buffer.clone()

    # torch's split and order (layers grouped by shape), so that one rank reproduces it.
    by_shape: dict[torch.Size, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    raw = []
    for key, grad in zip(keys, grads, strict=True):
        n = grad.shape[0] if grad.dim() else 1
        m = grad.numel() // max(n, 1)
        rank = min(n, m, state.matrix_approximation_rank)
        compress, before, _ = _should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += before
        if grad.dim() > 1 and compress:
            by_shape[torch.Size((n, m))].append((key, grad.view(n, m)))
        else:
            raw.append(grad)
            state.total_numel_after_compression += before
    layers = [layer for same in by_shape.values() for layer in same]
    matrix_keys = [key for key, _ in layers]
    matrices = [matrix for _, matrix in layers]

    flat_raw = torch.cat([t.reshape(-1) for t in raw]) if raw else buffer.new_empty(0)
    raw_work = dist.all_reduce(flat_raw, group=group, async_op=True)
    sent = flat_raw.numel()
    if matrices:
        ranks = state.plan(bucket.index(), matrix_keys, matrices, group)
        shapes = [(m.shape[0], m.shape[1]) for m in matrices]
        p_flat = buffer.new_empty(sum(n * r for (n, _), r in zip(shapes, ranks, strict=True)))
        q_flat = buffer.new_empty(sum(m * r for (_, m), r in zip(shapes, ranks, strict=True)))
        ps = _views(p_flat, [(n, r) for (n, _), r in zip(shapes, ranks, strict=True)])
        qs = _views(q_flat, [(m, r) for (_, m), r in zip(shapes, ranks, strict=True)])
        _start_qs(state, matrix_keys, qs)
        eps = state.orthogonalization_epsilon
        for q in qs:
            _orthogonalize(q, eps)
        for m, q, p in zip(matrices, qs, ps, strict=True):
            torch.bmm(m.unsqueeze(0), q, out=p)
    raw_work.wait()
    flat_raw.div_(world)
    offset = 0
    for t in raw:
        t.copy_(flat_raw[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    if matrices:
        dist.all_reduce(p_flat, group=group)  # no division: P is orthogonalized next
        for p in ps:
            _orthogonalize(p, eps)
        for m, p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(m.unsqueeze(0).transpose(1, 2), p, out=q)
        dist.all_reduce(q_flat, group=group)
        q_flat.div_(world)
        for m, p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=m.unsqueeze(0))
        sent += p_flat.numel() + q_flat.numel()
        state.total_numel_after_compression += p_flat.numel() + q_flat.numel()
        if state.warm_start:  # torch keeps them only for warm start, too
            for key, p, q in zip(matrix_keys, ps, qs, strict=True):
                state.p_memory_dict[key], state.q_memory_dict[key] = p[0], q[0]
    if local is not None:
        # Zero what is not finite: one overflowing step (fp16 with a GradScaler, which skips
        # it) must not carry inf or NaN into every later one. torch's hook would.
        error = (local - buffer).nan_to_num_(0.0, 0.0, 0.0)
        offset = 0
        for key, grad in zip(keys, grads, strict=True):
            state.error_dict[key] = error[offset : offset + grad.numel()]
            offset += grad.numel()
    state.bytes_sent += ring_bytes_sent(sent * buffer.element_size(), world)
    state.maybe_increase_iter(bucket)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    future.set_result(buffer)
    return future


lgreco_hook = powerSGD_hook  # cgx2's name; Global-QSGD's module calls it powerSGD_hook
