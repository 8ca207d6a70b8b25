"""What the policy has decided for a group (routes, transports, crossovers, the node mesh's
answers, the calibration file): fields of its :class:`~cgx2.comm.GroupState`, kept per settings.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .. import config
from ..comm import GroupState, group_state
from . import regimes

__all__ = ["state"]

# Settings that change a call's route but not what was measured at first use (the crossovers,
# the node mesh's timing): changing only these keeps the measurements, which cost seconds. A
# refresh that finds the launcher's variables changed (tests) decides everything anew.
_MEASUREMENT_NEUTRAL = {"check_agreement": "auto", "comm_worker": True, "crossover_bytes": None}


def state(group: dist.ProcessGroup | None) -> GroupState:
    """``group``'s state, with what was decided under other settings than those in force
    (:func:`cgx2.config.tuning`: a calibration file named elsewhere, graphs turned on)
    dropped."""
    found = group_state(group)
    tuning = config.tuning()
    if found.decided_under is not tuning:
        _settle(found, tuning)
    return found


def _settle(found: GroupState, tuning: config.TuningConfig) -> None:
    """Drop ``found``'s routes and transports, decided under other settings than ``tuning``,
    and its measurements where those settings would change what they find."""
    found.routes.clear()
    found.transports.clear()
    basis = (dataclasses.replace(tuning, **_MEASUREMENT_NEUTRAL), config.launch(), config.cgx())
    if basis != found.measured_under:
        found.calibration = None
        found.crossovers.clear()
        found.mesh_faster.clear()
        found.measured_under = basis
        regimes.forget()  # the launcher's settings may be new too
    found.decided_under = tuning
