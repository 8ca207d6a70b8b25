"""Global-QSGD's ``lgreco_hook`` module: PowerSGD with per-layer ranks chosen by L-GreCo,
served by :mod:`cgx2.ddp.lgreco` under Global-QSGD's names and arguments."""

import math
from typing import Any

from cgx2.ddp.lgreco import LGreCoState, powersgd_arguments, powerSGD_hook

__all__ = ["LGreCoState", "PowerSGDState", "powerSGD_hook"]


class PowerSGDState(LGreCoState):
    """:class:`~cgx2.ddp.lgreco.LGreCoState` with Global-QSGD's arguments: re-planned every
    ``adjust_freq`` steps, over every rank from floor(rank * ``adjust_gamma``) (at least 1) to
    ceil(rank * ``adjust_beta``)."""

    __slots__ = ()

    @powersgd_arguments(adjust_freq=(int, 100), adjust_beta=(float, 2), adjust_gamma=(float, 0.5))
    def __init__(
        self, settings: dict[str, Any], adjust_freq: int, adjust_beta: float, adjust_gamma: float
    ) -> None:
        rank = settings["matrix_approximation_rank"]
        low = max(1, math.floor(rank * adjust_gamma))
        high = max(rank, math.ceil(rank * adjust_beta))
        super().__init__(**settings, ranks=range(low, high + 1), replan_every=adjust_freq)
