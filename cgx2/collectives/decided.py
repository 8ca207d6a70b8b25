"""What the policy has decided for each group (routes, crossovers, the node mesh's answers,
calibration files), kept until the group goes or the settings change.
"""

from __future__ import annotations

import dataclasses

from .. import config
from . import decision
from .regimes import regime

__all__ = ["CALIBRATIONS", "MEASURED", "MESH_FASTER", "ROUTES", "clear", "fresh"]

ROUTES: dict[tuple, decision.Routes] = {}
"""The routes decided per group (by id), device, dtype and bucket size."""

CALIBRATIONS: dict[int, dict[str, dict]] = {}
"""Rank 0's calibration file, as read for the policy, per group (by id; None: no group)."""

MEASURED: dict[tuple, tuple[int | None, int | None]] = {}
"""The crossovers (alone, beside the training step) per device, dtype, group and graphs."""

MESH_FASTER: dict[tuple, dict[int, bool]] = {}
"""Whether the node mesh beat the flat allreduce, by measured size, per group and settings."""


class _FilledUnder:
    """The settings the caches were filled under (:func:`fresh`)."""

    tuning: config.TuningConfig | None = None
    basis: tuple[config.TuningConfig, config.LaunchConfig] | None = None


# Settings that change a call's route but not what was measured at first use (the crossovers,
# the node mesh's timing): changing only these keeps the measurements, which cost seconds. A
# reload that finds the launcher's variables changed (tests) decides everything anew.
_MEASUREMENT_NEUTRAL = {"check_agreement": "auto", "comm_worker": True, "crossover_bytes": None}


def fresh() -> config.TuningConfig:
    """The settings in force, dropping what was decided under others (a calibration file
    named elsewhere, graphs turned on)."""
    tuning = config.tuning()
    if tuning is not _FilledUnder.tuning:
        ROUTES.clear()
        basis = (dataclasses.replace(tuning, **_MEASUREMENT_NEUTRAL), config.launch())
        if basis != _FilledUnder.basis:
            clear()
            _FilledUnder.basis = basis
        _FilledUnder.tuning = tuning
    return tuning


def clear() -> None:
    """Forget the regimes, calibrations and crossovers decided so far (they are decided once
    per device or group, as NCCL reads its variables once); the next call decides anew."""
    regime.cache_clear()
    CALIBRATIONS.clear()
    MEASURED.clear()
    MESH_FASTER.clear()
    ROUTES.clear()
