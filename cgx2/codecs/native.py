"""The max-min codec's C loops for CPU tensors (``maxmin_native.c``), built on first use with
the system's C compiler and loaded by ctypes; None where that fails (the torch code runs).

The library is cached per source and compiler under ``cgx2.config.tuning().cache_dir``
(``CGX2_CACHE_DIR``), built with its ``c_compiler`` (``CC``); ``native_codec`` false
(``CGX2_NATIVE=0``, or ``cgx2.config.tuned(native_codec=False)``) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..config import tuning

__all__ = ["decode_rows", "encode_rows", "library"]

log = logging.getLogger("cgx2")

_SOURCE = Path(__file__).with_name("maxmin_native.c")
# -ffp-contract=off: no fused multiply-adds, which round differently from the reference.
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]


_COMPILE_TIMEOUT_S = 30  # the file builds in about a second; a compiler that hangs is given up


class _Unsafe(Exception):
    """A cached library or its folder that someone else could have written."""


def _compiler() -> str | None:
    """The C compiler: ``CC`` where it is set (an error where it names no executable: the
    user chose it), else the first of cc, gcc, clang on the ``PATH``."""
    chosen = tuning().c_compiler
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise FileNotFoundError(f"CC={chosen!r} is not an executable on the PATH")
        return found
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    return Path(tuning().cache_dir)


def _check_private(path: Path, kind: str) -> None:
    """Raise :class:`_Unsafe` unless ``path`` is a ``kind`` ("file" or "folder", not a
    symbolic link) owned by this user and writable by no one else: only then can no other
    user have put code in it."""
    info = os.lstat(path)
    is_kind = stat.S_ISREG(info.st_mode) if kind == "file" else stat.S_ISDIR(info.st_mode)
    if not is_kind:
        raise _Unsafe(f"{path} is not a {kind} (a symbolic link?)")
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise _Unsafe(f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Unsafe(f"{path} is writable by its group or by others "
                      f"(mode {stat.filemode(info.st_mode)})")  # fmt: skip


def _library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` from this source is cached."""
    tag = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join([compiler, *_FLAGS, platform.machine()]).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"maxmin_native_{tag}.so"


def _build(compiler: str) -> Path:
    """The built library: from the cache, or compiled into it (atomically, so that ranks
    building at once each load a whole file). The cache folder is made private (0700); a
    folder or file in it that another user could have written raises :class:`_Unsafe`."""
    target = _library_path(compiler)
    folder = target.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder, "folder")
    if os.path.lexists(target):
        _check_private(target, "file")
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)  # fmt: skip
        os.chmod(tmp, 0o700)  # the compiler's umask may have left it writable by the group
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded library, or None: turned off (asked at every call, so that
    ``cgx2.config.tuned(native_codec=False)`` takes effect at once), no C compiler, or the
    build failed (logged)."""
    return _built_library() if tuning().native_codec else None


@functools.cache
def _built_library() -> ctypes.CDLL | None:
    """The library built (once a process) with the compiler and cache of the configuration
    at the first call; ``_built_library.cache_clear()`` builds again. Any failure (no
    compiler, a build that fails or hangs, a cached file someone else could have written, a
    library without the codec's functions) logs why and leaves the torch code to run."""
    try:
        compiler = _compiler()
        if compiler is None:
            log.info("cgx2: no C compiler; the CPU codec runs in torch")
            return None
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.cgx2_maxmin_encode.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ctypes.c_uint64,
                                           ctypes.c_uint64, i64, ptr, ptr, i64]  # fmt: skip
        lib.cgx2_maxmin_encode.restype = None
        lib.cgx2_maxmin_decode.argtypes = [ptr, ptr, i64, i64, i64, i64, ctypes.c_int, i64,
                                           ptr, ptr, ctypes.c_int]  # fmt: skip
        lib.cgx2_maxmin_decode.restype = None
    except _Unsafe as e:
        log.warning("cgx2: not loading the CPU codec's C loops: %s; using torch (remove it, "
                    "or set CGX2_CACHE_DIR to a folder of your own)", e)  # fmt: skip
        return None
    except subprocess.TimeoutExpired:
        log.warning("cgx2: the C compiler took over %d s; the CPU codec runs in torch",
                    _COMPILE_TIMEOUT_S)  # fmt: skip
        return None
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("cgx2: the CPU codec's C loops are unusable (%s); using torch", detail)
        return None
    log.info("cgx2: the CPU codec's C loops: %s", path)
    return lib


# Buckets per thread at least: below, a thread's start costs more than it saves.
_MIN_BUCKETS_PER_THREAD = 256


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="cgx2-codec")


# A forked child has none of its parent's threads: it starts pools of its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _over_threads(fn: Callable[[int, int], None], nq: int) -> None:
    """``fn(begin, end)`` over ranges of the ``nq`` buckets, in as many threads as torch
    uses (ctypes releases the GIL for the call)."""
    parts = max(1, min(torch.get_num_threads(), nq // _MIN_BUCKETS_PER_THREAD))
    if parts == 1:
        fn(0, nq)
        return
    bounds = [nq * i // parts for i in range(parts + 1)]
    futures = [_pool(parts).submit(fn, a, b) for a, b in itertools.pairwise(bounds)]
    for future in futures:
        future.result()


def _usable(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and (
        sys.byteorder == "little"
    )


def encode_rows(rows: torch.Tensor, bits: int, key: int, stream: int, covered: int,
                meta: torch.Tensor, levels: torch.Tensor) -> bool:  # fmt: skip
    """Encode fp32 ``rows`` ``[nq, B]`` into ``meta`` (the payload's ``8 nq`` bytes of
    (lo, step) fp32 pairs) and ``levels`` (its levels region), both uint8, as
    :func:`cgx2.codecs.maxmin.encode` does; False (nothing written) where the C loops are
    unavailable or the tensors do not suit them."""
    lib = library()
    if lib is None or not _usable(rows, meta, levels) or rows.dtype != torch.float32:
        return False
    nq, bucket = rows.shape
    args = (bucket, bits, key & (2**64 - 1), stream & (2**64 - 1), covered, meta.data_ptr(),
            levels.data_ptr(), levels.numel())  # fmt: skip
    _over_threads(lambda a, b: lib.cgx2_maxmin_encode(rows.data_ptr(), a, b, *args), nq)
    return True


def decode_rows(meta: torch.Tensor, levels: torch.Tensor, nq: int, bucket: int, bits: int,
                out: torch.Tensor, base: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Decode ``nq`` buckets into ``out`` (its ``numel`` values; fp32, or bf16 rounded as
    :func:`cgx2.codecs.maxmin._cast` does) as the reference does, each added to ``base``'s
    value where given (fp32 ``base`` and ``out`` of one size; ``out`` itself accumulates);
    False (nothing written) where the C loops are unavailable."""
    lib = library()
    if base is None:
        suits = out.dtype in (torch.float32, torch.bfloat16)
    else:
        suits = out.dtype == base.dtype == torch.float32
    tensors = (meta, levels, out) if base is None else (meta, levels, out, base)
    if lib is None or not suits or not _usable(*tensors):
        return False
    head = (meta.data_ptr(), levels.data_ptr(), levels.numel())
    tail = (bucket, bits, out.numel(), None if base is None else base.data_ptr(), out.data_ptr(),
            int(out.dtype == torch.bfloat16))  # fmt: skip
    _over_threads(lambda a, b: lib.cgx2_maxmin_decode(*head, a, b, *tail), nq)
    return True
