"""cgx2: quantized (1-8 bit) gradient communication for PyTorch.

``import cgx2`` registers the ``torch.ops.cgx`` ops. Start with
:func:`cgx2.quantized_allreduce`.
"""

import logging

from . import ops
from .config import CGXConfig
from .ops import dequantize, quantize, quantized_allreduce
from .seeding import manual_seed

__all__ = ["CGXConfig", "dequantize", "manual_seed", "ops", "quantize", "quantized_allreduce"]
__version__ = "0.1.0"

logging.getLogger("cgx2").addHandler(logging.NullHandler())
