"""The CUDA streams cgx2 codes and communicates on beside the training's own: one maker, so that
every such stream (DDP's hook, the optimizer stepped in it, the cgx backend, the comm worker, the
CUDA graphs' capture) is alike.

Their priority is the default one, as the process group's own NCCL stream's: coding streams of high
priority (as FSDP2's collective streams are) made DDP's step across hosts slower, not faster
(bench/results/hook_streams_ab_20261128T0217/).
"""

from __future__ import annotations

import torch

__all__ = ["CODING_PRIORITY", "coding_stream"]

CODING_PRIORITY = 0
"""The priority of :func:`coding_stream`'s streams: the default, that of NCCL's own stream unless
``TORCH_NCCL_HIGH_PRIORITY`` raises it (lower numbers come first)."""


def coding_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream on CUDA ``device`` for cgx2's coding and collectives, of
    :data:`CODING_PRIORITY`."""
    return torch.cuda.Stream(device, priority=CODING_PRIORITY)
