"""What every benchmark result records: date, device, versions, regime and exact command;
how it is written (JSON under ``--out``), printed (a plain table and its legend) and shown
while it runs (progress lines on stderr), and the command-line conventions of the tools."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from cgx2 import config
from cgx2.collectives import policy
from cgx2.config import parse_bytes

__all__ = [
    "DEFAULT_OUT",
    "DTYPES",
    "HelpFormatter",
    "Progress",
    "add_bits_argument",
    "add_bucket_size_argument",
    "add_choice",
    "add_dtypes_argument",
    "add_number",
    "add_out_argument",
    "add_repeat_arguments",
    "add_sizes_argument",
    "bit_widths",
    "dtype_names",
    "environment",
    "format_columns",
    "format_legend",
    "format_table",
    "matplotlib_missing",
    "parse_sizes",
    "parser",
    "refused_single_process",
    "require_processes",
    "size_name",
    "started",
    "write_json",
]

DEFAULT_OUT = "cgx2-results"
"""Where the tools write their JSON unless told (``--out``): relative to the current directory."""

SIZES_HELP = "bytes; K, M, G mean KiB, MiB, GiB"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes the tools time, by the names ``--dtypes`` takes."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default, and the description's paragraphs kept. Flags, and
    options whose default is None, say their default in their own words or need none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A tool's argument parser: its name and description, its help by :class:`HelpFormatter`."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )


def add_choice(
    p: argparse.ArgumentParser, flag: str, choices: Sequence[str], help: str | None = None
) -> None:
    """``flag``: one of ``choices``, the first where it is not given."""
    p.add_argument(flag, choices=choices, default=choices[0], help=help)


def add_sizes_argument(p: argparse.ArgumentParser, default: str | None, more: str = "") -> None:
    """``--sizes``: tensor sizes in bytes, comma-separated (:func:`parse_sizes`), ``default``
    unless given; ``more`` ends its help."""
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=default,
        help=f"tensor sizes, comma-separated, in {SIZES_HELP}{more}",
    )


def add_number(
    p: argparse.ArgumentParser, flag: str, default: float, help: str | None = None
) -> None:
    """``flag``: a number of ``default``'s type (int or float), ``default`` where not given."""
    p.add_argument(flag, type=type(default), default=default, help=help)


def add_dtypes_argument(p: argparse.ArgumentParser, more: str = "") -> None:
    """``--dtypes``: :data:`DTYPES`' names, comma-separated (fp32 and bf16 unless given);
    ``more`` ends its help. :func:`dtype_names` checks it."""
    p.add_argument(
        "--dtypes", default="fp32,bf16", help=f"comma-separated: {', '.join(DTYPES)}{more}"
    )


def dtype_names(p: argparse.ArgumentParser, text: str) -> list[str]:
    """``--dtypes``' names, each checked against :data:`DTYPES` (``p`` exits where one is not)."""
    names = text.split(",")
    for name in names:
        if name not in DTYPES:
            p.error(f"--dtypes: unknown {name!r}; choose from {', '.join(DTYPES)}")
    return names


def add_bits_argument(p: argparse.ArgumentParser) -> None:
    """``--bits``: widths from 1 to 8, comma-separated (2, 4 and 8 unless given);
    :func:`bit_widths` checks it."""
    p.add_argument("--bits", default="2,4,8", help="bits per value, comma-separated, 1 to 8")


def bit_widths(p: argparse.ArgumentParser, text: str) -> list[int]:
    """``--bits``' widths, each an integer from 1 to 8 (``p`` exits where one is not)."""
    try:
        bits = [int(b) for b in text.split(",")]
    except ValueError:
        p.error(f"--bits: {text!r} is not a comma-separated list of integers")
    if any(not 1 <= b <= 8 for b in bits):
        p.error(f"--bits: {bits} must each be in 1..8")
    return bits


def add_bucket_size_argument(p: argparse.ArgumentParser) -> None:
    """``--bucket-size``: the max-min codec's values a scale (512 unless given)."""
    p.add_argument(
        "--bucket-size", type=int, default=512, help="values sharing one scale (max-min bucket)"
    )


def add_repeat_arguments(p: argparse.ArgumentParser, *, warmup: int, iters: int, what: str) -> None:
    """``--warmup`` (untimed ``what`` first) and ``--iters`` (timed ``what``, the median
    taken), with these defaults."""
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed {what} first")
    p.add_argument("--iters", type=int, default=iters, help=f"timed {what} (the median is taken)")


def parse_sizes(text: str) -> list[int]:
    """``"64K,1M"`` -> ``[65536, 1048576]``: positive byte counts, K/M/G = KiB/MiB/GiB; an
    ``argparse.ArgumentTypeError`` naming the bad item otherwise."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        value = parse_bytes(item)
        if not value:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a positive byte count (e.g. 65536, 64K, 4M, 1G)"
            )
        sizes.append(value)
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def size_name(nbytes: int) -> str:
    """65536 -> ``"64K"``: the largest binary unit that divides it, as ``--sizes`` reads it."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def require_processes(prog: str, world_size: int | None, at_least: int = 2) -> str | None:
    """The message to exit with (code 2) when ``prog`` runs on fewer than ``at_least``
    processes (``world_size`` None: no launcher set ``WORLD_SIZE``), else None."""
    if world_size is not None and world_size >= at_least:
        return None
    found = "one process" if world_size in (None, 1) else f"{world_size} processes"
    module = prog.removeprefix("python ").strip()
    return (
        f"{prog}: it measures communication between processes, and this is {found}. "
        f"Start {at_least} or more with torchrun, e.g. "
        f"torchrun --nproc-per-node {at_least} {module}"
    )


def refused_single_process(prog: str) -> bool:
    """Whether ``prog`` must refuse to run: fewer than two processes, as the launcher says
    (:func:`require_processes`'s message, on stderr); the caller exits 2."""
    refusal = require_processes(prog, config.launch().world_size)
    if refusal:
        print(refusal, file=sys.stderr)
    return refusal is not None


def started(
    prog: str,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    argv: list[str] | None,
) -> argparse.Namespace | None:
    """A distributed tool's start: its arguments parsed, warnings logged, or None where it must
    refuse to run (:func:`refused_single_process`; the caller exits 2)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return None if refused_single_process(prog) else args


def add_out_argument(p: argparse.ArgumentParser) -> None:
    """``--out DIR`` (and its old name ``--out-dir``): where a tool writes its JSON."""
    p.add_argument(
        "--out",
        "--out-dir",
        dest="out",
        metavar="DIR",
        default=DEFAULT_OUT,
        help="directory for the JSON results, created if missing; '' writes none",
    )


class Progress:
    """Progress on stderr: on a terminal one line rewritten in place; elsewhere (a log file,
    a pipe) plain lines, since a carriage return there leaves one unreadable line."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.in_place = self.stream.isatty()
        self._width = 0

    def __call__(self, line: str) -> None:
        if self.in_place:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line being rewritten (nothing to do for plain lines)."""
        if self.in_place and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


_NCCL_VARS = (
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_IB_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_HOSTID",
    "NCCL_ALGO",
    "NCCL_PROTO",
)


def _cgx2_vars() -> dict[str, str]:
    """The environment's cgx2 and CGX variables (``CGX2_*``, ``CGX_*``)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("CGX2_", "CGX_"))}


def _command(world_size: int) -> str:
    """The command that reproduces this run, launcher, NCCL and cgx2 variables included."""
    names = [*_NCCL_VARS, *sorted(_cgx2_vars())]
    nccl = " ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ)
    argv = getattr(sys, "orig_argv", sys.argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        nproc = os.environ.get("LOCAL_WORLD_SIZE", world_size)
        target = f"-m {argv[argv.index('-m') + 1]}" if "-m" in argv else sys.argv[0]
        launch = f"torchrun --nproc-per-node {nproc} {target} {' '.join(sys.argv[1:])}"
    else:
        launch = " ".join(argv)
    return f"{nccl} {launch}".strip()


def environment(device: torch.device, world_size: int = 1) -> dict[str, Any]:
    """Metadata of a run: when, where, with what, and how to run it again."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "world_size": world_size,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "regime": policy.group_regime(device),
        "nccl_env": {k: os.environ[k] for k in _NCCL_VARS if k in os.environ},
        "cgx2_env": _cgx2_vars(),
        "command": _command(world_size),
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "python",
    }
    if "LINK_RATE" in os.environ:  # across cgx2.testing.netlab's hosts: their links
        env["link"] = {
            "rate": os.environ["LINK_RATE"],
            "burst": os.environ.get("LINK_BURST", ""),
            "hosts": int(os.environ["NHOSTS"]),
            "driver": os.environ.get("LINK_DRIVER", ""),
        }  # the command around it
    if device.type == "cpu":  # what a CPU run's codec had to work with
        env["cpus"] = os.cpu_count()
        env["threads"] = torch.get_num_threads()
        env["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def write_json(kind: str, report: dict[str, Any], out_dir: str | Path = DEFAULT_OUT) -> Path:
    """Write ``report`` to ``out_dir/<kind>_<device>_<regime>_w<W>_<date>.json``."""
    env = report["env"]
    device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    link = env.get("link")
    regime = env["regime"] if not link else f"{env['regime']}-{link['rate']}-h{link['hosts']}"
    name = f"{kind}_{device}_{regime}_w{env['world_size']}_{stamp}.json"
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str] | str]) -> str:
    """A plain right-aligned table; columns are (key, header, format spec), or a key alone:
    its values as they are, under the key."""
    columns = [(c, c, "") if isinstance(c, str) else c for c in columns]
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append(
            ["-" if row.get(k) is None else format(row[k], spec) for k, _, spec in columns]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_columns(
    rows: list[dict[str, Any]],
    columns: list[tuple[str, str, str, str | None]],
    more: Sequence[tuple[str, str]] = (),
) -> tuple[str, str]:
    """The table of ``rows`` and its legend, from columns that are (key, header, format spec,
    meaning); a column whose meaning is None goes without a legend line, and ``more``'s
    (name, meaning) lines follow the columns'."""
    table = format_table(rows, [(key, head, spec) for key, head, spec, _ in columns])
    said = [(head, meaning) for _, head, _, meaning in columns if meaning is not None]
    return table, format_legend([*said, *more])


def format_legend(columns: list[tuple[str, str]]) -> str:
    """What each column means: ``header: meaning`` lines, the meanings wrapped and aligned."""
    width = max(len(header) for header, _ in columns) + 1
    return "\n".join(
        textwrap.fill(
            meaning,
            100,
            initial_indent=f"  {(header + ':').ljust(width)} ",
            subsequent_indent=" " * (width + 3),
        )
        for header, meaning in columns
    )


def matplotlib_missing(flag: str) -> str | None:
    """Why ``flag`` cannot draw here (matplotlib cannot be imported), or None where it can.
    Imported only when asked: cgx2 needs matplotlib for nothing else."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return (
            f"{flag} draws with matplotlib, which cannot be imported here ({e}): "
            "pip install matplotlib (or pip install -e '.[test]'), or leave out "
            f"{flag}; the JSON results hold the same numbers"
        )
    return None
