"""Global-QSGD's ``lgreco_hook`` module: PowerSGD with per-layer ranks chosen by L-GreCo,
served by :mod:`cgx2.ddp.lgreco` under Global-QSGD's names and arguments."""

import math

import torch.distributed as dist

from cgx2.ddp.lgreco import LGreCoState, powerSGD_hook

__all__ = ["LGreCoState", "PowerSGDState", "powerSGD_hook"]


class PowerSGDState(LGreCoState):
    """:class:`~cgx2.ddp.lgreco.LGreCoState` with Global-QSGD's arguments: re-planned every
    ``adjust_freq`` steps, over every rank from floor(rank * ``adjust_gamma``) (at least 1) to
    ceil(rank * ``adjust_beta``)."""

    __slots__ = ()

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
        adjust_freq: int = 100,
        adjust_beta: float = 2,
        adjust_gamma: float = 0.5,
    ) -> None:
        rank = matrix_approximation_rank
        low = max(1, math.floor(rank * adjust_gamma))
        high = max(rank, math.ceil(rank * adjust_beta))
        super().__init__(
            process_group,
            rank,
            start_powerSGD_iter,
            min_compression_rate,
            use_error_feedback,
            warm_start,
            orthogonalization_epsilon,
            random_seed,
            compression_stats_logging_frequency,
            ranks=range(low, high + 1),
            replan_every=adjust_freq,
        )
