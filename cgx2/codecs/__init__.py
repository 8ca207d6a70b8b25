"""Codecs: flat float tensors to packed ``uint8`` payloads and back.

:func:`maxmin_codec` picks the implementation for a device: the Triton kernels for CUDA
tensors (when Triton is installed), the torch reference everywhere else. Both write the
same bytes.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from . import maxmin
from .layout import ChunkedLayout, MaxMinLayout

__all__ = [
    "ChunkedLayout", "MaxMinLayout", "codec_for", "maxmin_codec", "triton_kernels",
    "triton_maxmin",
]  # fmt: skip

log = logging.getLogger("cgx2")


@functools.cache
def triton_kernels(module: str) -> ModuleType | None:
    """``cgx2.codecs.<module>``, a module of Triton kernels, or None where Triton cannot be
    imported."""
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:  # CPU-only installs have no Triton
        log.info("Triton kernels unavailable (%s); using the torch reference codec", e)
        return None


def codec_for(device: torch.device, kernels: str, reference: ModuleType) -> ModuleType:
    """The Triton ``kernels`` module for CUDA tensors where Triton imports, else
    ``reference`` (both write the same bytes)."""
    if device.type == "cuda":
        module = triton_kernels(kernels)
        if module is not None:
            return module
    return reference


def triton_maxmin() -> ModuleType | None:
    """The Triton max-min kernels, or None where Triton cannot be imported."""
    return triton_kernels("maxmin_triton")


def maxmin_codec(device: torch.device) -> ModuleType:
    """The max-min implementation for tensors on ``device``."""
    return codec_for(device, "maxmin_triton", maxmin)
