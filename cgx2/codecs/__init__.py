"""Codecs: flat float tensors to packed ``uint8`` payloads and back.

What the collectives call is the :class:`~.base.Codec` protocol; :func:`maxmin_codec` picks its
implementation for a device: the Triton kernels for CUDA tensors (when Triton is installed),
the torch reference (:mod:`.maxmin`, C loops on the CPU) everywhere else. All write the same
bytes; levels are packed by :mod:`.packing`. Global-QSGD's codecs: :mod:`.global_norm`,
:mod:`.exponential`. Max-min's optional randomized Hadamard rotation: :mod:`.rotation`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import TypeVar, cast

import torch

from . import maxmin
from .base import Codec, GlobalNormCodec
from .layout import ChunkedLayout, MaxMinLayout
from .rotation import Rotation, rotation_for

__all__ = [
    "ChunkedLayout",
    "Codec",
    "GlobalNormCodec",
    "MaxMinLayout",
    "Rotation",
    "codec_for",
    "maxmin",
    "maxmin_codec",
    "rotation_for",
    "triton_kernels",
]

log = logging.getLogger("cgx2")

_C = TypeVar("_C", Codec, GlobalNormCodec)
_CPU = torch.device("cpu")


@functools.cache
def triton_kernels(module: str) -> ModuleType | None:
    """``cgx2.codecs.<module>``, a module of Triton kernels, or None where Triton cannot be
    imported."""
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:  # CPU-only installs have no Triton
        log.info("Triton kernels unavailable (%s); using the torch reference codec", e)
        return None


# The kernels module (or None) of each other device and kernels' name, found at its first call.
_KERNELS_FOR: dict[tuple[torch.device, str], ModuleType | None] = {}


def codec_for(device: torch.device, kernels: str, reference: _C) -> _C:
    """The Triton ``kernels`` module for CUDA tensors where Triton imports, else
    ``reference`` (both write the same bytes: the kernels implement its protocol)."""
    # CPU first, compared whole; other devices' answers kept by device: device.type builds its
    # string through a C++ stream, at each of the ops' calls on a GPU (issue 43).
    if device == _CPU:
        return reference
    try:
        module = _KERNELS_FOR[device, kernels]
    except KeyError:
        module = triton_kernels(kernels) if device.type == "cuda" else None
        _KERNELS_FOR[device, kernels] = module
    return reference if module is None else cast(_C, module)


def maxmin_codec(device: torch.device) -> Codec:
    """The max-min implementation for tensors on ``device``."""
    return codec_for(device, "maxmin_triton", cast(Codec, maxmin))
