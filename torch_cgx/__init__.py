"""Drop-in for CGX's ``torch_cgx`` extension: ``import torch_cgx`` then
``dist.init_process_group("cgx")`` runs on cgx2 (see :mod:`cgx2.backend`)."""

import cgx2
from cgx2 import CGXConfig, CGXProcessGroup

__all__ = ["CGXConfig", "CGXProcessGroup", "cgx2"]
