"""What every benchmark result records: date, device, versions, regime and exact command;
and how it is written (JSON under ``bench/results/``) and printed (a plain table)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "format_table", "regime", "write_json"]

_NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_IB_DISABLE",
              "NCCL_SOCKET_IFNAME", "NCCL_ALGO", "NCCL_PROTO")  # fmt: skip


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


def regime() -> str:
    """DESIGN.md's regimes, read from NCCL's variables: nvlink, shm or socket."""
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0") == "1"
    shm_off = os.environ.get("NCCL_SHM_DISABLE", "0") == "1"
    if p2p_off and shm_off:
        return "socket"
    if p2p_off:
        return "shm"
    return "nvlink" if torch.cuda.is_available() else "cpu"


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
        "regime": regime(),
        "nccl_env": {k: os.environ[k] for k in _NCCL_VARS if k in os.environ},
        "cgx2_env": _cgx2_vars(),
        "command": _command(world_size),
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "python",
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def write_json(kind: str, report: dict[str, Any], out_dir: str | Path = "bench/results") -> Path:
    """Write ``report`` to ``out_dir/<kind>_<device>_<regime>_w<W>_<date>.json``."""
    env = report["env"]
    device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    name = f"{kind}_{device}_{env['regime']}_w{env['world_size']}_{stamp}.json"
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A plain right-aligned table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([
            "-" if row.get(k) is None else format(row[k], spec) for k, _, spec in columns
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
