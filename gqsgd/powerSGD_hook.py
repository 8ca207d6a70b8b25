"""Global-QSGD's ``powerSGD_hook`` module (``gqsgd`` shipped a copy of torch's): torch's
PowerSGD and its batched variant, unchanged. cgx2's checkpointable PowerSGD, with torch's
numerics and its state kept per parameter, is :class:`cgx2.ddp.PowerSGDState` with
:func:`cgx2.ddp.powerSGD_hook`."""

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
