"""DDP communication hooks: CGX's ``CGXState``/``cgx_hook`` and Global-QSGD's family.

``cgx2.ddp.compress(ddp_model, bits=4)`` registers CGX's hook where compression pays;
``model.register_comm_hook(CGXState(group, compression_params={"bits": 4}), cgx_hook)``
registers it always, ``model.register_comm_hook(None, standard_dithering_hook)`` Global-QSGD's.
``optimizer_in_hook(hook, torch.optim.AdamW, {"lr": 3e-4})`` steps the optimizer in the hook.
"""

from .cgx_hook import CGXState, cgx_hook
from .compress import compress
from .global_qsgd import (
    GlobalQSGDState,
    PowerSGDState,
    default_hook,
    exponential_dithering_hook,
    level_dtype,
    powerSGD_hook,
    qsgd_hook,
    standard_dithering_4bit_hook,
    standard_dithering_hook,
    thc_hook,
)
from .lgreco import LGreCoState, lgreco_hook
from .optimizer_overlap import optimizer_in_hook

__all__ = [
    "CGXState",
    "GlobalQSGDState",
    "LGreCoState",
    "PowerSGDState",
    "cgx_hook",
    "compress",
    "default_hook",
    "exponential_dithering_hook",
    "level_dtype",
    "lgreco_hook",
    "optimizer_in_hook",
    "powerSGD_hook",
    "qsgd_hook",
    "standard_dithering_4bit_hook",
    "standard_dithering_hook",
    "thc_hook",
]
