"""The CUDA streams cgx2 codes and communicates on beside the training's own: one maker, so that
every such stream has the priority the backward pass's overlap needs.

A bucket's coding kernels (encode, decode-sum-encode, decode) sit between its collectives: while
they wait behind the backward pass's kernels for the GPU's multiprocessors, the link idles. On a
stream of high priority the GPU schedules their blocks first, as FSDP2 does for its
reduce-scatter and all-gather streams.
"""

from __future__ import annotations

import torch

__all__ = ["CODING_PRIORITY", "coding_stream"]

CODING_PRIORITY = -1
"""The priority of :func:`coding_stream`'s streams: high (lower numbers come first; CUDA maps
one beyond its range to its highest), as FSDP2's collective streams."""


def coding_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream on CUDA ``device`` for cgx2's coding and collectives, of
    :data:`CODING_PRIORITY`."""
    return torch.cuda.Stream(device, priority=CODING_PRIORITY)
