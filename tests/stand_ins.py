"""Stand-ins for what the CPU suite cannot make: a CUDA event whose answer the test gives."""

from __future__ import annotations


class CudaEvent:
    """A CUDA event's stand-in: ``query()`` is True once the test sets ``done``; recording it
    again makes it pending."""

    def __init__(self) -> None:
        self.done, self.records = False, 0

    def record(self, stream: object = None) -> None:
        self.done, self.records = False, self.records + 1

    def query(self) -> bool:
        return self.done
