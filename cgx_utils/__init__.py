"""Drop-in for CGX's ``cgx_utils``: ``from cgx_utils import cgx_hook, CGXState`` runs unchanged
against cgx2 (the hook and its state are :mod:`cgx2.ddp`'s)."""

from cgx2.ddp import CGXState, cgx_hook

__all__ = ["CGXState", "cgx_hook"]
