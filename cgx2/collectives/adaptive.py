"""Layer-wise bit widths (L-GreCo's dynamic program): from measured gradient statistics, the
bits per layer that send the fewest bytes while the total quantization error stays within the
error of a uniform width, or the least error within a number of bits a value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch
import torch.distributed as dist

from ..checks import UNCOMPRESSED_BITS, check_bits
from ..codecs.rotation import hadamard_rotate

__all__ = [
    "check_average_bits",
    "check_options",
    "check_replan_every",
    "layer_errors",
    "plan_bits",
    "plan_bits_within_bytes",
    "plan_widths",
]

_ESTIMATE_KEY = 0
"""The signs :func:`layer_errors` rotates with: the codec draws fresh ones every call, and any
draw's ranges estimate theirs; one key makes the estimate the same on every rank and call."""


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


def check_average_bits(average_bits: object, options: Sequence[int] | None) -> float | None:
    """``average_bits`` checked against the widths ``options`` (``adaptive_bits``, checked):
    None, or a finite number from min(options) to max(options), the payload bits a value the
    planner may spend. Raises ``ValueError``/``TypeError`` naming it."""
    if average_bits is None:
        return None
    if options is None:
        raise ValueError(
            "average_bits needs adaptive_bits: the widths a plan within it chooses from"
        )
    average_bits = _finite(average_bits)
    if not min(options) <= average_bits <= max(options):
        raise ValueError(
            f"average_bits must lie between the narrowest and the widest of adaptive_bits "
            f"{tuple(options)} ({min(options)}..{max(options)}), got {average_bits}"
        )
    return average_bits


def _finite(average_bits: object) -> float:
    """``average_bits`` as a float, or a ``TypeError``/``ValueError`` naming it."""
    if isinstance(average_bits, bool) or not isinstance(average_bits, (int, float)):
        raise TypeError(f"average_bits must be a number, got {type(average_bits).__name__}")
    if not math.isfinite(average_bits):
        raise ValueError(f"average_bits must be finite, got {average_bits}")
    return float(average_bits)


def plan_widths(
    errors: Sequence[torch.Tensor],
    numels: Sequence[int],
    options: Sequence[int],
    bits: int,
    group: dist.ProcessGroup,
    average_bits: float | None = None,
) -> tuple[int, ...]:
    """Widths for layers whose :func:`layer_errors` rows are ``errors``: the rows summed over
    ``group`` (one small allreduce, so that every rank plans the same widths: a rank with
    another plan would misread its peers' payloads), then :func:`plan_bits` within the error
    of ``bits`` everywhere, or, given ``average_bits``, :func:`plan_bits_within_bytes` within
    that many payload bits a value over these layers. One host transfer per plan."""
    table = torch.stack(list(errors))
    dist.all_reduce(table, group=group)
    table = table.cpu()
    if average_bits is not None:
        return tuple(plan_bits_within_bytes(table.tolist(), numels, options, average_bits))
    budget = float(table[:, list(options).index(bits)].sum())
    return tuple(plan_bits(table.tolist(), numels, options, budget, baseline=bits))


def layer_errors(
    layer: torch.Tensor,
    bucket_size: int,
    options: Sequence[int],
    rotation_block: int | None = None,
) -> torch.Tensor:
    """Expected squared error of max-min stochastic rounding of ``layer`` at each width in
    ``options``, as a float64 tensor on the layer's device (no host round-trip): per bucket of
    n values and range R, n * (R / (2^b - 1))^2 / 6 (a value's rounding variance p(1-p)
    step^2, averaged over a uniform p). With ``rotation_block`` the ranges are those of the
    values the rotated codec codes: the layer padded with its last value to whole buckets,
    then rotated in blocks of ``rotation_block`` from its start (the rotation is orthogonal:
    the error rotated back is as large)."""
    flat = layer.detach().reshape(-1).float()
    pad = -flat.numel() % bucket_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    if rotation_block is not None:
        flat = hadamard_rotate(flat, _ESTIMATE_KEY, rotation_block)
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
    chosen = _knapsack(steps, cost, resolution)
    if chosen is None:
        return [max(options)] * len(errors)
    return [options[o] for o in chosen]


def plan_bits_within_bytes(
    errors: Sequence[Sequence[float]],
    numels: Sequence[int],
    options: Sequence[int],
    average_bits: float,
    resolution: int = 10_000,
) -> list[int]:
    """Bits per layer minimising the summed ``errors[layer][option]`` subject to the payload
    staying within ``average_bits`` bits a value over the layers together
    (sum of numel * bits <= average_bits * sum of numels): :func:`plan_bits` turned around,
    its budget the bytes. A layer's cost is what it pays above the narrowest option,
    numel * (bits - min(options)), an integer; the dynamic program runs over the room above
    the narrowest plan, exactly when the costs' common divisor cuts it into at most
    ``resolution`` units (or when every plan fits), else in ``resolution`` units with each
    cost rounded up: the plan never exceeds the budget, and has no more error than the best
    plan within a budget smaller by one unit a layer. Of plans with equal error, the one with
    the fewest units. ``average_bits`` is read as the decimal
    it prints as (2.4 is 12/5), so that a budget that is met exactly stays feasible."""
    widths = [int(b) for b in options]
    if not widths or len(set(widths)) != len(widths):
        raise ValueError(f"options must be distinct widths, at least one, got {tuple(options)}")
    average_bits = _finite(average_bits)
    narrowest = min(widths)
    if average_bits < narrowest:
        raise ValueError(
            f"average_bits {average_bits} is below the narrowest option ({narrowest} bits): "
            "no plan fits"
        )
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ValueError(f"resolution must be a positive int, got {resolution!r}")
    if len(errors) != len(numels):
        raise ValueError(f"{len(errors)} rows of errors for {len(numels)} numels")
    if any(len(row) != len(widths) for row in errors):
        raise ValueError(f"every row of errors must hold one error per option ({len(widths)})")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numels):
        raise ValueError(f"numels must be positive ints, got {list(numels)}")
    if not errors:
        return []
    total = sum(numels)
    room = math.floor(Fraction(str(average_bits)) * total) - narrowest * total
    extra = np.array([[n * (b - narrowest) for b in widths] for n in numels], dtype=np.int64)
    divisor = int(np.gcd.reduce(extra.reshape(-1)))
    if room >= int(extra.max(axis=1).sum()):  # every plan fits: each layer's least error
        return [widths[int(np.argmin(row))] for row in errors]
    if room // divisor <= resolution:
        weights, capacity = extra // divisor, room // divisor
    else:
        weights, capacity = -(-extra * resolution // room), resolution
    chosen = _knapsack(weights, np.array(errors, dtype=float), capacity)
    return [widths[o] for o in chosen]  # never None: the narrowest plan weighs nothing


def _knapsack(weights: np.ndarray, values: np.ndarray, capacity: int) -> list[int] | None:
    """The option (column) per layer (row) minimising the summed ``values`` subject to the
    summed integer ``weights`` staying within ``capacity``: a dynamic program over the
    weights' axis; of equal sums, the smallest weight. None where nothing fits."""
    inf = float("inf")
    best = np.full(capacity + 1, inf)
    best[0] = 0.0
    choices = []
    for layer in range(len(weights)):
        best_with_layer = np.full(capacity + 1, inf)
        option_taken = np.full(capacity + 1, -1)
        for o in range(weights.shape[1]):
            s = weights[layer, o]
            if s > capacity:
                continue
            shifted = np.full(capacity + 1, inf)
            shifted[s:] = best[: capacity + 1 - s] + values[layer, o]
            better = shifted < best_with_layer
            best_with_layer[better], option_taken[better] = shifted[better], o
        best = best_with_layer
        choices.append(option_taken)
    if not np.isfinite(best).any():
        return None
    j = int(np.argmin(best))
    chosen = []
    for layer in range(len(weights) - 1, -1, -1):
        o = int(choices[layer][j])
        chosen.append(o)
        j -= weights[layer, o]
    return chosen[::-1]
