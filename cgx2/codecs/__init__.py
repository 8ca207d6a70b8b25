"""Codecs: flat float tensors to packed ``uint8`` payloads and back.

:func:`maxmin_codec` picks the implementation for a device: the Triton kernels for CUDA
tensors (when Triton is installed), the torch reference everywhere else. Both write the
same bytes.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from . import maxmin
from .layout import ChunkedLayout, MaxMinLayout

__all__ = ["ChunkedLayout", "MaxMinLayout", "maxmin_codec", "triton_maxmin"]

log = logging.getLogger("cgx2")


@functools.cache
def triton_maxmin() -> ModuleType | None:
    """The Triton max-min kernels, or None where Triton cannot be imported."""
    try:
        from . import maxmin_triton
    except ImportError as e:  # CPU-only installs have no Triton
        log.info("Triton kernels unavailable (%s); using the torch reference codec", e)
        return None
    return maxmin_triton


def maxmin_codec(device: torch.device) -> ModuleType:
    """The max-min implementation for tensors on ``device``."""
    if device.type == "cuda":
        kernels = triton_maxmin()
        if kernels is not None:
            return kernels
    return maxmin
