"""Global-QSGD's hook names, served by :mod:`cgx2.ddp.global_qsgd`."""

from cgx2.ddp.global_qsgd import (
    GlobalQSGDState,
    default_hook,
    exponential_dithering_hook,
    qsgd_hook,
    standard_dithering_4bit_hook,
    standard_dithering_hook,
    thc_hook,
)

THC_uniform_hook = thc_hook  # the name in Global-QSGD's source

__all__ = [
    "GlobalQSGDState",
    "THC_uniform_hook",
    "default_hook",
    "exponential_dithering_hook",
    "qsgd_hook",
    "standard_dithering_4bit_hook",
    "standard_dithering_hook",
    "thc_hook",
]
