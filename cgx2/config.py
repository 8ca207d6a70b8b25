"""The ``CGX_*`` environment variables as one frozen, validated dataclass.

Defaults are CGX's own; explicit arguments (``compression_params``, op arguments) override them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .checks import UNCOMPRESSED_BITS, check_bits, check_bucket_size

__all__ = ["CGXConfig", "compression_from_env"]

MIN_COMPRESSION_SIZE = 16
"""CGX never compresses a buffer of fewer elements than this, whatever the variable says."""

_INNER_COMMUNICATORS = ("SHM", "MPI", "NCCL")
_CROSS_COMMUNICATORS = ("MPI", "NCCL")


def _int(
    env: Mapping[str, str], var: str, default: int, lo: int, hi: int | None, only: str = ""
) -> int:
    """Parse an integer variable in lo..hi; ``only`` narrows the range further (e.g. bits)."""
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return default
    allowed = only or (f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{var}={raw!r} is invalid: expected {allowed}") from None
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{var}={raw!r} is out of range: expected {allowed}")
    return value


def _bool(env: Mapping[str, str], var: str, default: bool) -> bool:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var}={raw!r} is invalid: expected 0 or 1")


def _choice(env: Mapping[str, str], var: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().upper()
    if value not in allowed:
        raise ValueError(f"{var}={raw!r} is invalid: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class CGXConfig:
    """CGX's tuning knobs. ``CGXConfig.from_env()`` reads and validates them once.

    Attributes mirror the variables (``CGX_`` prefix dropped):

    - ``quantization_bits`` (``CGX_COMPRESSION_QUANTIZATION_BITS``, 32): 1..8, or 32 = off.
    - ``bucket_size`` (``CGX_COMPRESSION_BUCKET_SIZE``, 512): elements sharing one min/step.
    - ``skip_incomplete_buckets`` (``CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS``, 0): send the
      last, shorter bucket of a buffer raw instead of quantizing it.
    - ``minimal_size`` (``CGX_COMPRESSION_MINIMAL_SIZE``, 0 raised to 16): smaller buffers are
      sent uncompressed.
    - ``fusion_buffer_size_mb`` (``CGX_FUSION_BUFFER_SIZE_MB``, 64): largest fused batch.
    - ``inner_communicator`` (``CGX_INNER_COMMUNICATOR_TYPE``, SHM): SHM, MPI or NCCL.
    - ``cross_communicator`` (``CGX_CROSS_COMMUNICATOR_TYPE``, MPI): MPI or NCCL.
    - ``intra_broadcast`` (``CGX_INTRA_BROADCAST``, 0): one GPU per node talks across nodes.
    """

    quantization_bits: int = UNCOMPRESSED_BITS
    bucket_size: int = 512
    skip_incomplete_buckets: bool = False
    minimal_size: int = MIN_COMPRESSION_SIZE
    fusion_buffer_size_mb: int = 64
    inner_communicator: str = "SHM"
    cross_communicator: str = "MPI"
    intra_broadcast: bool = False

    def __post_init__(self) -> None:
        check_bits(self.quantization_bits, "quantization_bits")
        check_bucket_size(self.bucket_size)
        if self.minimal_size < MIN_COMPRESSION_SIZE:
            object.__setattr__(self, "minimal_size", MIN_COMPRESSION_SIZE)
        if self.fusion_buffer_size_mb < 0:
            raise ValueError(
                f"fusion_buffer_size_mb must be >= 0, got {self.fusion_buffer_size_mb}"
            )
        if self.inner_communicator not in _INNER_COMMUNICATORS:
            raise ValueError(f"inner_communicator must be one of {_INNER_COMMUNICATORS}")
        if self.cross_communicator not in _CROSS_COMMUNICATORS:
            raise ValueError(f"cross_communicator must be one of {_CROSS_COMMUNICATORS}")

    @property
    def compression_enabled(self) -> bool:
        return self.quantization_bits != UNCOMPRESSED_BITS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CGXConfig:
        """Read the ``CGX_*`` variables (from ``os.environ`` unless given), with CGX's defaults.

        Raises ``ValueError`` naming the variable and its allowed values when one is invalid.
        """
        env = os.environ if environ is None else environ
        bits, bucket_size = compression_from_env(env)
        return cls(
            quantization_bits=bits,
            bucket_size=bucket_size,
            skip_incomplete_buckets=_bool(env, "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", False),
            minimal_size=max(
                MIN_COMPRESSION_SIZE, _int(env, "CGX_COMPRESSION_MINIMAL_SIZE", 0, 0, None)
            ),
            fusion_buffer_size_mb=_int(env, "CGX_FUSION_BUFFER_SIZE_MB", 64, 0, None),
            inner_communicator=_choice(
                env, "CGX_INNER_COMMUNICATOR_TYPE", "SHM", _INNER_COMMUNICATORS
            ),
            cross_communicator=_choice(
                env, "CGX_CROSS_COMMUNICATOR_TYPE", "MPI", _CROSS_COMMUNICATORS
            ),
            intra_broadcast=_bool(env, "CGX_INTRA_BROADCAST", False),
        )


def compression_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(bits, bucket_size)`` from ``CGX_COMPRESSION_QUANTIZATION_BITS`` and
    ``CGX_COMPRESSION_BUCKET_SIZE``: the two variables CGX lets a script change at any time."""
    env = os.environ if environ is None else environ
    bits_allowed = "an integer in 1..8, or 32 for no compression"
    bits = _int(env, "CGX_COMPRESSION_QUANTIZATION_BITS", UNCOMPRESSED_BITS, 1, 32, bits_allowed)
    if not (bits <= 8 or bits == UNCOMPRESSED_BITS):
        raw = env["CGX_COMPRESSION_QUANTIZATION_BITS"]
        raise ValueError(
            f"CGX_COMPRESSION_QUANTIZATION_BITS={raw!r} is out of range: expected {bits_allowed}"
        )
    return bits, _int(env, "CGX_COMPRESSION_BUCKET_SIZE", 512, 1, 2**31 - 1)
