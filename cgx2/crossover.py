"""Where compression stops paying: below a message size per interconnect ("regime"), the
quantized allreduce falls back to the plain one, which is faster there.

The sizes are the smallest at which 4-bit cgx2 beat NCCL on 2 H200s (BENCHMARKS.md; 2 and 8
bits cross at the same sizes); with CUDA-graph replay (:mod:`cgx2.graphs`), which costs the
host less, smaller ones. ``CGX2_CROSSOVER_BYTES`` overrides them: a byte count (0 = always
compress) or ``auto``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import graphs

__all__ = [
    "CROSSOVER_BYTES", "CROSSOVER_BYTES_GRAPHS", "crossover_bytes", "detect_regime", "regime",
]  # fmt: skip

logger = logging.getLogger("cgx2")

CROSSOVER_BYTES: dict[str, tuple[int | None, int | None]] = {
    # regime: (fp32 input, 16-bit input); None: compression never reliably won (measured up
    # to 1 GiB). 16-bit over NVLink lost at 256 MiB; at 1 GiB it was 0.87-1.31x as fast as NCCL
    # across six runs on different 2-H200 machines (the host's enqueue bounds it there), so
    # it is never compressed rather than sometimes 13% slower.
    # CPU users ask for compression. On one host gloo's plain allreduce was faster at every
    # size (2 ranks, 16-64 MiB: cgx2 0.17-0.37x, the codec bounding it; BENCHMARKS.md, "CPU"),
    # but the link between CPU nodes is unknown here, and over links slower than the codec
    # (about 3.5 Gb/s, by arithmetic; not measured) compression would win.
    "cpu": (0, 0),
    "socket": (4 << 20, 4 << 20),
    "shm": (16 << 20, 16 << 20),
    "nvlink": (256 << 20, None),
}
CROSSOVER_BYTES_GRAPHS: dict[str, tuple[int | None, int | None]] = {
    # With CUDA-graph replay (cgx2.graphs), whose host time is a fraction of the launches':
    # where it beat NCCL by 1.15x or more on 2 H200s (the run of 2026-11-23 07:16 UTC; that
    # of 07:23 agrees; BENCHMARKS.md). 16-bit over NVLink: 1.32-1.50x at 256 MiB and 1 GiB in
    # five runs (07:16-08:24), 1.07-1.24x at 64 MiB, so from 256 MiB.
    "cpu": (0, 0),
    "socket": (4 << 20, 4 << 20),
    "shm": (4 << 20, 16 << 20),
    "nvlink": (64 << 20, 256 << 20),
}
_VARIABLE = "CGX2_CROSSOVER_BYTES"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0")


@functools.cache
def _peers_reachable() -> bool:
    """Whether every visible GPU reaches every other directly (NVLink or PCIe P2P)."""
    n = torch.cuda.device_count()
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b
    )


def detect_regime(device: torch.device) -> str:
    """``cpu``, ``socket`` (several nodes, or NCCL limited to sockets), ``shm`` (NCCL without
    peer-to-peer) or ``nvlink`` (GPUs that reach each other directly; also assumed when only
    one GPU is visible per process, which is the cautious choice: it compresses least)."""
    if device.type != "cuda":
        return "cpu"
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world and local and int(local) < int(world):
        return "socket"
    if _flag("NCCL_P2P_DISABLE"):
        return "socket" if _flag("NCCL_SHM_DISABLE") else "shm"
    return "nvlink" if _peers_reachable() else "shm"


def _getenv(name: str) -> str:
    """``os.environ.get(name, "")`` in a tenth of its time: ``os.environ``'s lookup of a
    missing name raises and catches a KeyError (1.5 us, 3% of a 1 MiB NCCL allreduce), its
    underlying bytes dict does not. Falls back where that dict is not there."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):
        return os.environ.get(name, "")
    value = data.get(os.environ.encodekey(name))
    return "" if value is None else os.environ.decodevalue(value)


def crossover_bytes(device: torch.device, dtype: torch.dtype) -> int | None:
    """The smallest tensor, in bytes, that the quantized allreduce compresses on ``device``
    (None: never). Raises ``ValueError`` naming ``CGX2_CROSSOVER_BYTES`` if it is invalid.

    ``CGX2_CROSSOVER_BYTES`` is read at every call; the regime once per device, as NCCL reads
    its own variables once (this runs before every allreduce, so it must cost next to nothing).
    """
    raw = _getenv(_VARIABLE).strip()
    if raw and raw.lower() != "auto":
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{_VARIABLE}={raw!r} is invalid: expected 'auto' or bytes >= 0")
        return value
    return _measured_crossover(device, dtype, graphs.ENABLED)


@functools.cache
def regime(device: torch.device) -> str:
    """:func:`detect_regime`, once per device: NCCL too reads its variables once."""
    return detect_regime(device)


@functools.cache
def _measured_crossover(device: torch.device, dtype: torch.dtype,
                        with_graphs: bool = False) -> int | None:  # fmt: skip
    found = regime(device)
    full, half = (CROSSOVER_BYTES_GRAPHS if with_graphs else CROSSOVER_BYTES)[found]
    chosen = full if dtype.itemsize >= 4 else half
    logger.info(
        "cgx2: %s regime, %s%s: quantized allreduce from %s (%s=0 always compresses)",
        found, dtype, ", CUDA graphs" if with_graphs else "",
        "never" if chosen is None else f"{chosen} bytes", _VARIABLE,
    )  # fmt: skip
    return chosen
