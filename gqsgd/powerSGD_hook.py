"""Global-QSGD's ``powerSGD_hook`` module (``gqsgd`` shipped a copy of torch's): cgx2's
checkpointable PowerSGD (:class:`cgx2.ddp.lgreco.PowerSGDState`, torch's numerics), and
torch's batched variant."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch

from cgx2.ddp.lgreco import LGreCoState, PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]


def batched_powerSGD_hook(
    state: _torch.PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``batched_powerSGD_hook`` (one matrix per bucket), which needs torch's own
    ``PowerSGDState``: cgx2's keeps its matrices per parameter, not per bucket."""
    if isinstance(state, LGreCoState):
        raise TypeError(
            "batched_powerSGD_hook needs torch's PowerSGDState (torch.distributed.algorithms."
            "ddp_comm_hooks.powerSGD_hook.PowerSGDState); cgx2's keeps its state per layer"
        )
    return _torch.batched_powerSGD_hook(state, bucket)
