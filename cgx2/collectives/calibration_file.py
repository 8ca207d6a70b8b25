"""Reading the calibration file safely: a small regular file of this user's that no one else can
write, opened without blocking, parsed with bounds, its schema checked before the policy uses it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

__all__ = ["FORMAT", "MAX_BYTES", "MAX_DEPTH", "CalibrationFileError", "check", "load"]

FORMAT = "cgx2-calibration/1"
"""The ``format`` of a calibration file (``python -m cgx2.bench calibrate``)."""

MAX_BYTES = 256 << 10
"""The largest calibration file read, in bytes. ``calibrate`` writes a few KiB; the limit keeps
what rank 0 passes to the other ranks through the store far below its 8 MiB values."""

MAX_DEPTH = 8
"""The deepest nesting of JSON arrays and objects read (the format needs three)."""

_MAX_DIGITS = 20  # a crossover in bytes fits in 64 bits
_KEY = re.compile(r"[a-z0-9_-]{1,32}/[a-z0-9_-]{1,32}/(fp32|16bit)")
_TABLES = ("crossover_bytes", "beside_crossover_bytes")


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used; the message says why (the path is the caller's
    to name)."""


def load(path: str) -> dict[str, Any] | None:
    """The checked contents of the calibration file at ``path``, or None where there is none.
    Raises :class:`CalibrationFileError` when the path is not a regular file, is writable by
    others or owned by another user, is larger than :data:`MAX_BYTES`, nests deeper than
    :data:`MAX_DEPTH`, is not JSON or not the :data:`FORMAT` schema (:func:`check`)."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CalibrationFileError(f"cannot be read: {e.strerror or e}") from None
    _check_file(before)
    # O_NONBLOCK: a FIFO swapped in after the stat must not block the open (nor the read).
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CalibrationFileError(f"cannot be read: {e.strerror or e}") from None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise CalibrationFileError("was replaced while it was being opened")
        _check_file(opened)
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise CalibrationFileError(f"cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if size > MAX_BYTES:
        raise CalibrationFileError(f"is larger than the {MAX_BYTES} bytes a calibration file takes")
    return check(_parse(b"".join(chunks)))


def _check_file(st: os.stat_result) -> None:
    """Refuse what is not a regular file, or what another user could have written."""
    if not stat.S_ISREG(st.st_mode):
        raise CalibrationFileError(
            "is not a regular file (a directory, FIFO, socket or device): it is not read"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CalibrationFileError(
            f"is writable by users other than its owner (mode {stat.S_IMODE(st.st_mode):o}): "
            "anyone could steer every job's routes; `chmod go-w` it"
        )
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    # Root's files are trusted as sshd trusts them: root could change this user's anyway.
    if uid is not None and st.st_uid not in (uid, 0):
        raise CalibrationFileError(
            f"is owned by user id {st.st_uid}, not by this user ({uid}) nor root"
        )
    if st.st_size > MAX_BYTES:
        raise CalibrationFileError(
            f"is {st.st_size} bytes, larger than the {MAX_BYTES} a calibration file takes"
        )


def _parse(raw: bytes) -> object:
    """JSON of at most :data:`MAX_DEPTH` levels, without NaN, infinities, duplicate keys or
    integers longer than 64 bits."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationFileError(f"is not UTF-8 text ({e.reason} at byte {e.start})") from None
    depth, deepest, in_string, escaped = 0, 0, False, False
    for char in text:  # before json, whose recursion a deep file would exhaust
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                raise CalibrationFileError(f"nests deeper than {MAX_DEPTH} levels")
        elif char in "]}":
            depth -= 1

    def constant(name: str) -> None:
        raise ValueError(f"{name} is not a value a calibration file holds")

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > _MAX_DIGITS:
            raise ValueError(f"the integer {digits[:24]}... is too large")
        return int(digits)

    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out = dict(pairs)
        if len(out) != len(pairs):
            raise ValueError("an object names a key twice")
        return out

    try:
        return json.loads(
            text, parse_constant=constant, parse_int=integer, object_pairs_hook=unique
        )
    except ValueError as e:  # json.JSONDecodeError is one
        raise CalibrationFileError(f"is not JSON of a calibration file: {e}") from None


def check(data: object) -> dict[str, Any]:
    """``data`` if it is a calibration file's contents: an object of :data:`FORMAT` whose
    ``crossover_bytes`` (and ``beside_crossover_bytes``, if given) map keys such as
    ``"cpu/gloo/fp32"`` to a size in bytes or null, and whose ``node_mesh_faster`` (if given)
    maps such keys to objects of sizes (decimal strings) to booleans; else a
    :class:`CalibrationFileError` naming what is wrong."""
    if not isinstance(data, dict):
        raise CalibrationFileError(f"holds a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        raise CalibrationFileError(f"is not a {FORMAT} file (its format: {data.get('format')!r})")
    if "crossover_bytes" not in data:
        raise CalibrationFileError("has no 'crossover_bytes'")
    for name in _TABLES:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise CalibrationFileError(f"'{name}' is not an object")
        for key, value in table.items():
            _check_key(name, key)
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 0
            ):
                raise CalibrationFileError(
                    f"'{name}' gives {key!r} {value!r}, not a size in bytes (an integer >= 0) "
                    "nor null"
                )
    mesh = data.get("node_mesh_faster", {})
    if not isinstance(mesh, dict):
        raise CalibrationFileError("'node_mesh_faster' is not an object")
    for key, table in mesh.items():
        _check_key("node_mesh_faster", key)
        if not isinstance(table, dict) or not all(
            isinstance(size, str)
            and size.isdigit()
            and len(size) <= _MAX_DIGITS
            and isinstance(won, bool)
            for size, won in table.items()
        ):
            raise CalibrationFileError(
                f"'node_mesh_faster' gives {key!r} something other than sizes (decimal "
                "strings) to booleans"
            )
    return data


def _check_key(table: str, key: str) -> None:
    if not _KEY.fullmatch(key):
        raise CalibrationFileError(
            f"'{table}' has the key {key[:40]!r}, not device/backend/width (e.g. 'cpu/gloo/fp32')"
        )
