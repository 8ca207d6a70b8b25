"""The one reader of the environment: ``CGX_*`` (CGX's variables), ``CGX2_*`` (cgx2's own
tuning), and the launcher's and NCCL's variables that decide a call's route, each validated.

Sections are frozen dataclasses with documented fields; explicit arguments override them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .checks import (
    MAX_BUCKET_SIZE,
    UNCOMPRESSED_BITS,
    check_bits,
    check_bool,
    check_bucket_size,
    check_numel,
)

__all__ = [
    "ALGORITHMS",
    "COMPARED_PER_CALL",
    "NOT_COMPARED",
    "TRANSPORTS",
    "WIRE_SETTINGS",
    "CGXConfig",
    "LaunchConfig",
    "TuningConfig",
    "cgx",
    "compression_from_env",
    "crossover_override",
    "env_quantization_bits",
    "launch",
    "parse_bytes",
    "refresh",
    "reload",
    "triton_interpret",
    "tuned",
    "tuning",
    "wire_settings",
]

MIN_COMPRESSION_SIZE = 16
"""CGX never compresses a buffer of fewer elements than this, whatever the variable says."""

_INNER_COMMUNICATORS = ("SHM", "MPI", "NCCL")
_CROSS_COMMUNICATORS = ("MPI", "NCCL")
TRANSPORTS = ("auto", "shm", "nccl", "process_group")
"""The values of ``CGX2_TRANSPORT`` (:class:`TuningConfig`'s ``transport``)."""
ALGORITHMS = ("auto", "sra", "ring", "allgather")
"""The values of ``CGX2_ALGORITHM`` (:class:`TuningConfig`'s ``algorithm``)."""
CHECK_MODES = ("auto", "on", "off", "deferred")
"""The values of ``CGX2_CHECK_AGREEMENT`` (:class:`TuningConfig`'s ``check_agreement``)."""
ROTATIONS = ("none", "hadamard", "hadamard-clipped")
"""The values of ``CGX2_ROTATION`` (:class:`TuningConfig`'s ``rotation``)."""


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
    raise ValueError(f"{var}={raw!r} is invalid: expected 0/1, true/false, yes/no or on/off")


def _bool_or_auto(env: Mapping[str, str], var: str) -> bool | None:
    """:func:`_bool`, or None for ``auto`` (or unset): the library decides."""
    raw = env.get(var)
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    try:
        return _bool(env, var, False)
    except ValueError:
        raise ValueError(
            f"{var}={raw!r} is invalid: expected auto, 0/1, true/false, yes/no or on/off"
        ) from None


def _check_mode(env: Mapping[str, str], var: str) -> str:
    """One of :data:`CHECK_MODES`; the words :func:`_bool` takes name ``on`` and ``off``."""
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return "auto"
    value = raw.strip().lower()
    if value in CHECK_MODES:
        return value
    try:
        return "on" if _bool(env, var, False) else "off"
    except ValueError:
        raise ValueError(
            f"{var}={raw!r} is invalid: expected auto, on, off, deferred, 0/1, true/false or yes/no"
        ) from None


def _choice(
    env: Mapping[str, str], var: str, default: str, allowed: tuple[str, ...], upper: bool = True
) -> str:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().upper() if upper else raw.strip().lower()
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
        check_bool(self.skip_incomplete_buckets, "skip_incomplete_buckets")
        check_bool(self.intra_broadcast, "intra_broadcast")
        check_numel(self.minimal_size, "minimal_size")
        check_numel(self.fusion_buffer_size_mb, "fusion_buffer_size_mb")
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
    return bits, _int(env, "CGX_COMPRESSION_BUCKET_SIZE", 512, 1, MAX_BUCKET_SIZE)


def env_quantization_bits(default: int, environ: Mapping[str, str] | None = None) -> int:
    """``CGX_COMPRESSION_QUANTIZATION_BITS``, or ``default`` where it is not set: for entry
    points that are asked to compress (e.g. :func:`cgx2.fsdp.compress`)."""
    env = os.environ if environ is None else environ
    if env.get("CGX_COMPRESSION_QUANTIZATION_BITS", "").strip() == "":
        return default
    bits, _ = compression_from_env(env)
    return bits


def _bytes(env: Mapping[str, str], var: str, auto: str = "auto") -> int | None:
    """A byte count >= 0 (K/M/G suffixes: KiB/MiB/GiB), or None for unset or ``auto``."""
    raw = env.get(var)
    if raw is None or raw.strip() == "" or raw.strip().lower() == auto:
        return None
    value = parse_bytes(raw)
    if value is None:
        raise ValueError(
            f"{var}={raw!r} is invalid: expected '{auto}' or a byte count >= 0 (K, M, G: KiB...)"
        )
    return value


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int | None:
    """``"64M"`` -> 67108864: bytes with an optional K/M/G (KiB/MiB/GiB) suffix, ``B`` and
    ``iB`` allowed after it; None if ``text`` is not such a count."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in ("K", "M", "G") else ""
    number = raw[: len(raw) - len(unit)].strip()
    if not number.isdigit():
        return None
    return int(number) * _UNITS[unit]


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "cgx2")


def _check_one_of(value: object, choices: tuple, name: str) -> None:
    """A ``ValueError`` naming ``name`` and ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class TuningConfig:
    """cgx2's own knobs (``CGX2_*``), read once per process (:func:`tuning`; :func:`refresh`
    reads them again); :func:`tuned` overrides them for a block of code (benchmarks, tests).

    - ``crossover_bytes`` (``CGX2_CROSSOVER_BYTES``, ``auto``): below this many bytes the
      quantized allreduce runs the plain one; None lets the policy decide (calibration file,
      else the built-in tables: :mod:`cgx2.collectives.policy`); 0 always compresses.
    - ``cuda_graphs`` (``CGX2_CUDA_GRAPHS``, ``auto``): replay GPU allreduces on NCCL as CUDA
      graphs: True (1) for every compressed one, False (0) for none, None (``auto``) for those
      of at most :data:`cgx2.collectives.policy.GRAPHS_AUTO_MAX_BYTES`.
    - ``pipeline_bytes`` (``CGX2_PIPELINE_BYTES``, ``auto``): input bytes per pipeline piece;
      None takes the regime's (:mod:`cgx2.collectives.policy`).
    - ``pair_gather`` (``CGX2_PAIR_GATHER``, 1): two ranks swap their chunks by all-gather
      rather than all-to-all, outside NVLink.
    - ``check_agreement`` (``CGX2_CHECK_AGREEMENT``, ``auto``): before each call of
      ``quantized_allreduce`` and of the ``cgx`` backend's allreduce, the ranks share its
      size, dtype and arguments and raise if they differ (:mod:`cgx2.collectives.agreement`).
      ``on`` (or 1) compares them before the call, ``deferred`` compares them on the GPU in
      stream order (CUDA tensors: a disagreement turns the result into NaN on every rank and
      raises at the next call on the group, or sooner), ``off`` (or 0) not at all; ``auto``
      is ``off`` for CUDA tensors on NCCL, where either check costs a fixed fraction of a
      millisecond a call, else ``on``.
    - ``node_mesh`` (``CGX2_NODE_MESH``, ``auto``): where a job spans nodes of several ranks,
      whether the ``cgx`` backend and the DDP hook with ``mesh="auto"`` reduce over the node
      mesh (plain inside a node, quantized between): True (1) for every compressed call, False
      (0) for none (the flat allreduce), None (``auto``) lets the policy decide
      (:func:`cgx2.collectives.policy.by_node_mesh`: CPU tensors, and CUDA tensors on NCCL, by
      timing both at first use or reading the calibration file; others by the mesh).
    - ``comm_worker`` (``CGX2_COMM_WORKER``, 1): DDP's hooks run collectives that would block
      autograd's thread (gloo's) on a worker thread per group (:mod:`cgx2.comm.worker`); 0
      runs them in the hook, as torch's own hooks do.
    - ``calibration_file`` (``CGX2_CALIBRATION_FILE``, ``<cache_dir>/calibration.json``):
      crossovers measured on this machine by ``python -m cgx2.bench calibrate``.
    - ``direct_launch`` (``CGX2_DIRECT_LAUNCH``, 1): launch compiled Triton kernels without
      Triton's per-call dispatch (0: Triton's own path, to compare them).
    - ``transport`` (``CGX2_TRANSPORT``, ``auto``): what moves the collectives' bytes: ``shm``
      (shared memory between the ranks of one host, :mod:`cgx2.comm.shm`), ``nccl`` (grouped
      send/receive on the NCCL group's communicator, :mod:`cgx2.comm.nccl`), ``process_group``
      (``torch.distributed``'s), or ``auto``: shared memory where ``CGX_INNER_COMMUNICATOR_TYPE``
      is SHM and the process group would itself cross host memory (CPU tensors; CUDA tensors
      on gloo), else the process group (docs/transports.md).
    - ``algorithm`` (``CGX2_ALGORITHM``, ``auto``): the quantized allreduce's algorithm: ``sra``
      (scatter-reduce-allgather: every value quantized twice), ``ring`` (a pipelined ring:
      quantized at every hop, W times), ``allgather`` (every rank's values quantized once,
      gathered and summed by every rank: as many bytes as ``sra`` between two ranks, W / 2
      times as many among W), or ``auto`` (``sra``; docs/transports.md says why).
    - ``native_codec`` (``CGX2_NATIVE``, 1): the CPU codec's compiled loops (``cgx2._C``;
      0: the torch code).
    - ``cache_dir`` (``CGX2_CACHE_DIR``, ``~/.cache/cgx2``): where the calibration file is.
    - ``rotation`` (``CGX2_ROTATION``, ``none``): the ``cgx`` backend's quantized allreduces
      code a randomized Hadamard rotation of the values (``hadamard``, in blocks of 128, which
      must divide the bucket size) or none; the other entry points take ``rotation=``.
    """

    crossover_bytes: int | None = None
    cuda_graphs: bool | None = None
    pipeline_bytes: int | None = None
    pair_gather: bool = True
    check_agreement: str = "auto"
    node_mesh: bool | None = None
    comm_worker: bool = True
    transport: str = "auto"
    algorithm: str = "auto"
    calibration_file: str = ""
    direct_launch: bool = True
    native_codec: bool = True
    cache_dir: str = ""
    rotation: str = "none"

    def __post_init__(self) -> None:
        for name in ("crossover_bytes", "pipeline_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be None or bytes >= 0, got {value!r}")
        if self.pipeline_bytes == 0:
            raise ValueError("pipeline_bytes must be positive (None: the regime's)")
        _check_one_of(self.algorithm, ALGORITHMS, "algorithm")
        _check_one_of(self.check_agreement, CHECK_MODES, "check_agreement")
        _check_one_of(self.rotation, ROTATIONS, "rotation")
        _check_one_of(self.transport, TRANSPORTS, "transport")
        if not self.cache_dir:
            object.__setattr__(self, "cache_dir", _default_cache_dir())
        if not self.calibration_file:
            path = str(Path(self.cache_dir) / "calibration.json")
            object.__setattr__(self, "calibration_file", path)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TuningConfig:
        """Read the ``CGX2_*`` variables; ``ValueError`` naming a bad one."""
        env = os.environ if environ is None else environ
        pipeline_bytes = _bytes(env, "CGX2_PIPELINE_BYTES")
        if pipeline_bytes == 0:
            raw = env["CGX2_PIPELINE_BYTES"]
            raise ValueError(
                f"CGX2_PIPELINE_BYTES={raw!r} is invalid: expected 'auto' or a byte count > 0"
            )
        return cls(
            crossover_bytes=_bytes(env, "CGX2_CROSSOVER_BYTES"),
            cuda_graphs=_bool_or_auto(env, "CGX2_CUDA_GRAPHS"),
            pipeline_bytes=pipeline_bytes,
            pair_gather=_bool(env, "CGX2_PAIR_GATHER", True),
            check_agreement=_check_mode(env, "CGX2_CHECK_AGREEMENT"),
            node_mesh=_bool_or_auto(env, "CGX2_NODE_MESH"),
            comm_worker=_bool(env, "CGX2_COMM_WORKER", True),
            transport=_choice(env, "CGX2_TRANSPORT", "auto", TRANSPORTS, upper=False),
            algorithm=_choice(env, "CGX2_ALGORITHM", "auto", ALGORITHMS, upper=False),
            calibration_file=env.get("CGX2_CALIBRATION_FILE", "").strip(),
            direct_launch=_bool(env, "CGX2_DIRECT_LAUNCH", True),
            native_codec=_bool(env, "CGX2_NATIVE", True),
            cache_dir=env.get("CGX2_CACHE_DIR", "").strip(),
            rotation=_choice(env, "CGX2_ROTATION", "none", ROTATIONS, upper=False),
        )


@dataclass(frozen=True)
class LaunchConfig:
    """What the launcher (torchrun, or mpirun through :mod:`cgx2.launch`) and NCCL's own
    variables say about where this process runs; read once (:func:`launch`).

    - ``world_size`` (``WORLD_SIZE``) and ``local_world_size`` (``LOCAL_WORLD_SIZE``):
      ranks in the job and on this node; None where no launcher set them.
    - ``nccl_p2p_disabled`` (``NCCL_P2P_DISABLE``) and ``nccl_shm_disabled``
      (``NCCL_SHM_DISABLE``): NCCL told to avoid peer-to-peer and shared memory.
    - ``omp_wait_policy`` (``OMP_WAIT_POLICY``, lower case; "" unset): how OpenMP's idle
      threads wait, read by OpenMP when torch loads it (:mod:`cgx2.cpu_threads`).
    - ``gloo_socket_ifname`` (``GLOO_SOCKET_IFNAME``; "" unset): the interfaces gloo binds to,
      comma-separated; cgx2's peer sockets take the first (:mod:`cgx2.comm.peers`).
    """

    world_size: int | None = None
    local_world_size: int | None = None
    nccl_p2p_disabled: bool = False
    nccl_shm_disabled: bool = False
    omp_wait_policy: str = ""
    gloo_socket_ifname: str = ""

    @property
    def spans_nodes(self) -> bool:
        """Whether the job has more ranks than this node (several nodes)."""
        return (
            self.world_size is not None
            and self.local_world_size is not None
            and self.local_world_size < self.world_size
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchConfig:
        env = os.environ if environ is None else environ

        def size(var: str) -> int | None:
            raw = env.get(var, "").strip()
            return None if raw == "" else _int(env, var, 0, 1, None)

        def flag(var: str) -> bool:  # NCCL's reading: anything but unset or 0 turns it on
            return env.get(var, "").strip() not in ("", "0")

        return cls(
            world_size=size("WORLD_SIZE"),
            local_world_size=size("LOCAL_WORLD_SIZE"),
            nccl_p2p_disabled=flag("NCCL_P2P_DISABLE"),
            nccl_shm_disabled=flag("NCCL_SHM_DISABLE"),
            omp_wait_policy=env.get("OMP_WAIT_POLICY", "").strip().lower(),
            gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME", "").strip(),
        )


WIRE_SETTINGS: dict[str, str] = {
    # TuningConfig's fields
    "pipeline_bytes": "CGX2_PIPELINE_BYTES",
    "pair_gather": "CGX2_PAIR_GATHER",
    "node_mesh": "CGX2_NODE_MESH",
    "transport": "CGX2_TRANSPORT",
    "algorithm": "CGX2_ALGORITHM",
    # CGXConfig's
    "skip_incomplete_buckets": "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS",
    "minimal_size": "CGX_COMPRESSION_MINIMAL_SIZE",
    "fusion_buffer_size_mb": "CGX_FUSION_BUFFER_SIZE_MB",
    "inner_communicator": "CGX_INNER_COMMUNICATOR_TYPE",
    "intra_broadcast": "CGX_INTRA_BROADCAST",
}
"""The settings (:class:`TuningConfig`'s and :class:`CGXConfig`'s fields, with their variables)
that change what bytes move between the ranks, which must therefore be alike on every rank:
the agreement check compares them (:func:`wire_settings`, decided with a call's route)."""

COMPARED_PER_CALL: dict[str, str] = {
    "crossover_bytes": "CGX2_CROSSOVER_BYTES",  # tuned() may change it between calls
    "quantization_bits": "CGX_COMPRESSION_QUANTIZATION_BITS",  # the call's bits
    "bucket_size": "CGX_COMPRESSION_BUCKET_SIZE",  # the call's bucket size
    "rotation": "CGX2_ROTATION",  # the cgx backend's call's rotation
}
"""Settings that change the bytes but may change between calls: the agreement check compares
the value each call uses, with the call's arguments."""

NOT_COMPARED: dict[str, str] = {
    "cuda_graphs": "a replayed graph moves the bytes of the eager call",
    "check_agreement": "a rank that does not check takes no part in the comparison",
    "comm_worker": "which thread runs a collective, not what it sends",
    "calibration_file": "every rank routes by the first rank's file",
    "cache_dir": "where the calibration file is",
    "direct_launch": "the same kernels, launched another way: the same bytes",
    "native_codec": "the compiled loops and the torch code give the same bytes",
    "cross_communicator": "read for CGX's scripts: the process group crosses nodes",
}
"""The other settings, and why ranks may differ in them. Every field of :class:`TuningConfig`
and :class:`CGXConfig` is in exactly one of :data:`WIRE_SETTINGS`, :data:`COMPARED_PER_CALL`
and this (a test holds it), so that a new setting is not forgotten by the check."""


def wire_settings() -> dict[str, object]:
    """:data:`WIRE_SETTINGS`' values in force, by variable: :func:`tuning`'s (with
    :func:`tuned`'s overrides) and :func:`cgx`'s."""
    found = {**dataclasses.asdict(cgx()), **dataclasses.asdict(tuning())}
    return {variable: found[name] for name, variable in WIRE_SETTINGS.items()}


class _Snapshot:
    """The settings in force: each section read from the environment at its first use (again
    after :func:`refresh`), :func:`tuned`'s overrides applied to :class:`TuningConfig`'s."""

    __slots__ = ("cgx", "launch", "tuning")

    def __init__(self) -> None:
        self.tuning: TuningConfig | None = None
        self.launch: LaunchConfig | None = None
        self.cgx: CGXConfig | None = None


# The process's settings, read once: the environment is the process's, and nothing reads it per
# call (refresh() reads it again, tuned() changes it for a block).
_SNAPSHOT = _Snapshot()
# tuned()'s overrides, by field, innermost last: changed in place, never rebound (sources()).
_overrides: dict[str, object] = {}


def tuning() -> TuningConfig:
    """The ``CGX2_*`` settings: read from the environment at the first call (or after
    :func:`refresh`), with :func:`tuned`'s overrides applied. The same object until either
    changes it: a cache decided under it stays valid while ``tuning() is`` the one it holds."""
    found = _SNAPSHOT.tuning
    if found is None:
        found = TuningConfig.from_env()
        if _overrides:
            found = dataclasses.replace(found, **_overrides)
        _SNAPSHOT.tuning = found
    return found


def launch() -> LaunchConfig:
    """The launcher's and NCCL's variables (:class:`LaunchConfig`), read at the first call (or
    after :func:`refresh`)."""
    found = _SNAPSHOT.launch
    if found is None:
        found = _SNAPSHOT.launch = LaunchConfig.from_env()
    return found


def cgx() -> CGXConfig:
    """CGX's variables (:class:`CGXConfig`), read at the first call (or after :func:`refresh`).
    The bits and bucket size, which CGX lets a script change at any time, are read where a call
    takes them (:func:`compression_from_env`)."""
    found = _SNAPSHOT.cgx
    if found is None:
        found = _SNAPSHOT.cgx = CGXConfig.from_env()
    return found


def refresh() -> None:
    """Take the settings from the environment again at their next use: the one way to make a
    changed variable count (a script that set one, a test's ``monkeypatch``). A bad value
    raises there, naming the variable. Caches decided under the old settings are dropped at
    their next use (:func:`tuning` is a new object)."""
    _SNAPSHOT.tuning = _SNAPSHOT.launch = _SNAPSHOT.cgx = None


def reload() -> TuningConfig:
    """:func:`refresh`, and read the ``CGX2_*`` variables now (after a script changed them)."""
    refresh()
    return tuning()


@contextlib.contextmanager
def tuned(**changes: object) -> Iterator[TuningConfig]:
    """Override :class:`TuningConfig` fields inside a ``with`` block, e.g.
    ``with cgx2.config.tuned(crossover_bytes=0):`` always compresses. Nests."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(TuningConfig)}
    if unknown:
        raise TypeError(f"TuningConfig has no field {sorted(unknown)}")
    saved = dict(_overrides)
    _overrides.update(changes)
    _SNAPSHOT.tuning = None
    try:
        yield tuning()  # validated here
    finally:
        _overrides.clear()
        _overrides.update(saved)
        _SNAPSHOT.tuning = None


def crossover_override() -> int | None:
    """``CGX2_CROSSOVER_BYTES`` (a byte count, or None for ``auto``/unset), or :func:`tuned`'s
    value: :func:`tuning`'s ``crossover_bytes``."""
    return tuning().crossover_bytes


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels, as Triton reads it (for
    Tritons without ``triton.knobs``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def sources(environ: Mapping[str, str] | None = None) -> dict[str, tuple[object, str]]:
    """Every ``CGX_*`` and ``CGX2_*`` setting, by variable: ``(value, source)``, the value as
    :class:`CGXConfig` and :class:`TuningConfig` read it (from ``os.environ`` unless given)
    and where it came from: ``"environment"``, ``"tuned"`` (:func:`tuned`'s override, for
    ``os.environ`` only) or ``"default"``. A variable that does not parse gives its text and
    ``"environment (invalid: why)"``; a ``CGX_``/``CGX2_`` variable cgx2 does not read, its
    text and ``"environment (not read by cgx2)"``. For ``python -m cgx2.env``."""
    env = os.environ if environ is None else environ
    named = {**WIRE_SETTINGS, **COMPARED_PER_CALL}
    others = {  # NOT_COMPARED's fields, whose table gives reasons, not variables
        "cuda_graphs": "CGX2_CUDA_GRAPHS",
        "check_agreement": "CGX2_CHECK_AGREEMENT",
        "comm_worker": "CGX2_COMM_WORKER",
        "calibration_file": "CGX2_CALIBRATION_FILE",
        "cache_dir": "CGX2_CACHE_DIR",
        "direct_launch": "CGX2_DIRECT_LAUNCH",
        "native_codec": "CGX2_NATIVE",
        "cross_communicator": "CGX_CROSS_COMMUNICATOR_TYPE",
    }
    overrides = _overrides if environ is None else {}
    found: dict[str, tuple[object, str]] = {}
    for section in (CGXConfig, TuningConfig):
        # Defaults, but where one depends on another setting (the calibration file's lies in
        # the cache directory).
        defaults = section.from_env({k: v for k, v in env.items() if k == "CGX2_CACHE_DIR"})
        for field in dataclasses.fields(section):
            prefix = "CGX_" if section is CGXConfig else "CGX2_"
            variable = named.get(field.name) or others.get(field.name)
            variable = variable or prefix + field.name.upper()
            raw = env.get(variable, "")
            if field.name in overrides:
                found[variable] = (overrides[field.name], "tuned")
            elif raw.strip() == "":
                found[variable] = (getattr(defaults, field.name), "default")
            else:
                try:
                    value = getattr(section.from_env({variable: raw}), field.name)
                    found[variable] = (value, "environment")
                except ValueError as e:
                    found[variable] = (raw, f"environment (invalid: {e})")
    for variable in sorted(env):
        if variable.startswith(("CGX_", "CGX2_")) and variable not in found:
            found[variable] = (env[variable], "environment (not read by cgx2)")
    return found
