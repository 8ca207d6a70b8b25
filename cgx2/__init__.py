"""cgx2: quantized (1-8 bit) gradient communication for PyTorch.

``import cgx2`` registers the ``torch.ops.cgx`` ops and the ``cgx`` backend of
``dist.init_process_group`` and, under ``mpirun``, fills in the ``env://`` variables
(:mod:`cgx2.launch`). Start with :func:`cgx2.quantized_allreduce`.
"""

import logging

from . import ops
from .backend import CGXProcessGroup, register_backend
from .collectives import hierarchical_allreduce
from .config import CGXConfig
from .launch import setup_mpi_env
from .ops import (
    dequantize,
    quantize,
    quantized_allreduce,
    quantized_allreduce_,
    quantized_reduce_scatter,
)
from .seeding import manual_seed

__all__ = [
    "CGXConfig",
    "CGXProcessGroup",
    "dequantize",
    "hierarchical_allreduce",
    "manual_seed",
    "ops",
    "quantize",
    "quantized_allreduce",
    "quantized_allreduce_",
    "quantized_reduce_scatter",
    "register_backend",
    "setup_mpi_env",
]
__version__ = "0.1.0"

logging.getLogger("cgx2").addHandler(logging.NullHandler())
setup_mpi_env()
register_backend()
