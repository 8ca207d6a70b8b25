"""The ``cgx`` torch.distributed backend, as in CGX: ``dist.init_process_group("cgx")`` with the
``CGX_*`` variables quantizes every float allreduce (:mod:`.process_group`).
"""

from ..comm import CompletedWork
from .process_group import BACKEND_NAME, CGXProcessGroup, register_backend

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "CompletedWork", "register_backend"]
