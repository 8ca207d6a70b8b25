"""Layer-wise bit widths (L-GreCo's dynamic program): from measured gradient statistics, the
bits per layer that send the fewest bytes while the total quantization error stays within the
error of a uniform width.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..checks import UNCOMPRESSED_BITS, check_bits

__all__ = ["check_options", "check_replan_every", "layer_errors", "plan_bits", "plan_widths"]


def check_options(
    options: Sequence[int], bits: int, name: str = "adaptive_bits"
) -> tuple[int, ...]:
    """``options`` as a sorted tuple of distinct widths, checked: at least one, each in 1..8,
    ``bits`` among them (the planner's budget is the error of ``bits`` everywhere, and that
    plan must be one it can choose). Raises ``ValueError``/``TypeError`` naming ``name``."""
    if isinstance(options, (str, bytes)) or not isinstance(options, Sequence):
        raise TypeError(f"{name} must be a sequence of widths, got {type(options).__name__}")
    if not options:
        raise ValueError(f"{name} must list at least one width in 1..8")
    widths = tuple(sorted({check_bits(b, name) for b in options}))
    if UNCOMPRESSED_BITS in widths:
        raise ValueError(f"{name} must be widths in 1..8, got {tuple(options)}")
    if bits not in widths:
        raise ValueError(f"{name} {widths} must include bits ({bits}), the budget's width")
    return widths


def check_replan_every(replan_every: object) -> int:
    """``replan_every`` checked: a positive int (a plan is made every that many calls)."""
    if isinstance(replan_every, bool) or not isinstance(replan_every, int) or replan_every < 1:
        raise ValueError(f"replan_every must be a positive int, got {replan_every!r}")
    return replan_every


def plan_widths(
    errors: Sequence[torch.Tensor],
    numels: Sequence[int],
    options: Sequence[int],
    bits: int,
    group: dist.ProcessGroup,
) -> tuple[int, ...]:
    """Widths for layers whose :func:`layer_errors` rows are ``errors``: the rows summed over
    ``group`` (one small allreduce, so that every rank plans the same widths: a rank with
    another plan would misread its peers' payloads), then :func:`plan_bits` within the error
    of ``bits`` everywhere. One host transfer per plan."""
    table = torch.stack(list(errors))
    dist.all_reduce(table, group=group)
    table = table.cpu()
    budget = float(table[:, list(options).index(bits)].sum())
    return tuple(plan_bits(table.tolist(), numels, options, budget, baseline=bits))


def layer_errors(layer: torch.Tensor, bucket_size: int, options: Sequence[int]) -> torch.Tensor:
    """Expected squared error of max-min stochastic rounding of ``layer`` at each width in
    ``options``, as a float64 tensor on the layer's device (no host round-trip): per bucket of
    n values and range R, n * (R / (2^b - 1))^2 / 6 (a value's rounding variance p(1-p)
    step^2, averaged over a uniform p)."""
    flat = layer.detach().reshape(-1).float()
    pad = -flat.numel() % bucket_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    buckets = flat.view(-1, bucket_size)
    ranges = (buckets.amax(1) - buckets.amin(1)).double()
    spread = (ranges**2).sum() * (bucket_size / 6)
    steps = torch.tensor([(2**b - 1) ** 2 for b in options], dtype=torch.float64)
    return spread / steps.to(flat.device)


def plan_bits(
    errors: Sequence[Sequence[float]],
    numels: Sequence[int],
    options: Sequence[int],
    budget: float,
    resolution: int = 1000,
    baseline: int | None = None,
    *,
    costs: Sequence[Sequence[float]] | None = None,
) -> list[int]:
    """Bits per layer minimising the bytes sent (numel * bits / 8) subject to the sum of the
    chosen ``errors[layer][option]`` staying within ``budget``: a knapsack dynamic program
    over the budget cut into ``resolution`` steps, errors rounded up. ``baseline`` (a width
    in ``options``, everywhere) is kept feasible although rounding up may push it over: the
    plan then costs no more than it, and exceeds the budget by less than one step per layer.
    Falls back to the widest option where nothing fits. ``costs[layer][option]`` replaces
    the bytes where an option is not a width (PowerSGD's ranks: (rows + columns) * rank)."""
    if not errors:
        return []
    if costs is None:
        costs = [[n * b / 8 for b in options] for n in numels]
    cost = np.array(costs, dtype=float)
    unit = budget / resolution if budget > 0 else 0.0

    def units(e: float) -> int:
        if unit > 0:
            return int(np.ceil(e / unit))
        return 0 if e == 0 else resolution + 1

    steps = np.array([[units(e) for e in row] for row in errors])
    if baseline is not None:
        resolution = max(resolution, int(steps[:, list(options).index(baseline)].sum()))
    inf = float("inf")
    best = np.full(resolution + 1, inf)
    best[0] = 0.0
    choices = []
    for layer in range(len(errors)):
        best_with_layer = np.full(resolution + 1, inf)
        option_taken = np.full(resolution + 1, -1)
        for o in range(len(options)):
            s = steps[layer, o]
            if s > resolution:
                continue
            shifted = np.full(resolution + 1, inf)
            shifted[s:] = best[: resolution + 1 - s] + cost[layer, o]
            better = shifted < best_with_layer
            best_with_layer[better], option_taken[better] = shifted[better], o
        best = best_with_layer
        choices.append(option_taken)
    if not np.isfinite(best).any():
        return [max(options)] * len(errors)
    j = int(np.argmin(best))
    plan = []
    for layer in range(len(errors) - 1, -1, -1):
        o = int(choices[layer][j])
        plan.append(options[o])
        j -= steps[layer, o]
    return plan[::-1]
