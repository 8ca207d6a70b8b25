"""Stand-ins for what the CPU suite cannot make: a CUDA event whose answer the test gives."""

from __future__ import annotations


class CudaEvent:
    """A CUDA event's stand-in: ``query()`` is True once the test sets ``done``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done
