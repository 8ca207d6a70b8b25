"""DDP communication hooks: CGX's ``CGXState``/``cgx_hook`` (Global-QSGD's family to come).

``model.register_comm_hook(CGXState(group, compression_params={"bits": 4}), cgx_hook)``.
"""

from .cgx_hook import CGXState, cgx_hook

__all__ = ["CGXState", "cgx_hook"]
