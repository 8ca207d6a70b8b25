"""Drop-in for Global-QSGD's ``gqsgd``: ``from gqsgd.ddphook import *`` and
``from gqsgd import lgreco_hook, powerSGD_hook`` run unchanged against cgx2 (:mod:`cgx2.ddp`)."""

from . import ddphook, lgreco_hook, powerSGD_hook

__all__ = ["ddphook", "lgreco_hook", "powerSGD_hook"]
