"""Global-QSGD's ``powerSGD_hook`` module: torch's PowerSGD (``gqsgd`` shipped a copy)."""

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
