"""``python -m cgx2.env`` (or ``cgx2-env``): what cgx2 will do on this machine, for bug reports
and for deciding whether it helps: versions, the compiled extension, GPUs, regimes, crossovers.

Plain text by default, ``--json`` for tools. It starts no process group and sends nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
import textwrap
from typing import Any

import torch

from cgx2 import config, extension
from cgx2.collectives import calibration_file, policy

__all__ = ["build_parser", "format_text", "main", "report"]

WIDTHS = {"fp32": 4, "16bit": 2}
"""The input widths a crossover is kept for (a calibration key's last part), with a value's
bytes."""


def _version(package: str) -> str | None:
    """``package``'s installed version, or None where it is not installed or cannot be
    imported (asked without importing it: Triton's import alone takes seconds)."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
        return importlib.metadata.version(package)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def _nccl_version() -> str | None:
    if torch.version.cuda is None:
        return None
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (RuntimeError, AttributeError):
        return None


def versions() -> dict[str, str | None]:
    """Python, torch (and its CUDA), Triton, NCCL (torch's) and cgx2, None where absent, and
    torch.distributed's backends."""
    import cgx2

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "nccl": _nccl_version(),
        "cgx2": cgx2.__version__,
        "backends": ", ".join(_backends()),
    }


def _backends() -> list[str]:
    """The torch.distributed backends this torch was built with (cgx2 adds ``cgx``)."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    found = [("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())]
    found.append(("mpi", dist.is_mpi_available()))
    return [name for name, there in found if there]


def _setting(variable: str) -> Any:
    """``variable``'s value as cgx2 reads it (:func:`cgx2.config.sources`), or its default
    where the environment's does not parse: the report goes on, and says so under Settings."""
    value, source = config.sources()[variable]
    if source.startswith("environment (invalid"):
        value, _ = config.sources({})[variable]
    return value


def _built() -> tuple[Any, str]:
    """``cgx2._C`` as :func:`cgx2.extension.load` would use it, and why not where it is None."""
    module = extension.load()
    if module is not None:
        return module, ""
    try:
        found = importlib.import_module("cgx2._C")
    except ImportError as e:
        return None, f"not built ({e}): reinstall cgx2 where a C++ compiler is present"
    return None, (
        f"{found.__file__} was built from other sources (ABI "
        f"{getattr(found, 'ABI_VERSION', None)}, this code calls {extension.ABI_VERSION}): "
        "reinstall cgx2 (pip install -e .) to rebuild it"
    )


def compiled() -> dict[str, Any]:
    """What of ``cgx2._C`` is built and used: the CPU codec's C loops, the shared-memory
    transport, the NCCL transport; each with why not, where not."""
    module, why = _built()
    if module is None:
        off = {"on": False, "why": why}
        return {"built": False, "path": None, "why": why, "cpu_codec": off, "shm": off, "nccl": off}
    native = _setting("CGX2_NATIVE")
    simd = bool(module.maxmin_simd()) if hasattr(module, "maxmin_simd") else False
    codec = {
        "on": native,
        "why": (
            "C loops" + (" with AVX2 vector loops" if simd else ", scalar (no AVX2 here)")
            if native
            else "turned off by CGX2_NATIVE=0: the torch code runs"
        ),
    }
    if hasattr(module, "nccl_available"):
        ok, nccl_why = module.nccl_available()
        nccl = {"on": bool(ok), "why": "" if ok else str(nccl_why)}
        if ok:
            version = module.nccl_version() if hasattr(module, "nccl_version") else None
            nccl["why"] = f"NCCL {version} loaded by torch; used with CGX2_TRANSPORT=nccl"
    else:
        nccl = {"on": False, "why": "this build has no NCCL transport"}
    transport = _setting("CGX2_TRANSPORT")
    inner = _setting("CGX_INNER_COMMUNICATOR_TYPE")
    if transport in ("auto", "shm") and (transport == "shm" or inner == "SHM"):
        why = "moves the bytes between the ranks of one host (CPU tensors, CUDA tensors on gloo)"
        shm = {"on": True, "why": why + ("" if transport == "auto" else ": CGX2_TRANSPORT=shm")}
    else:
        why = f"CGX2_TRANSPORT={transport}" if transport != "auto" else ""
        why = why or f"CGX_INNER_COMMUNICATOR_TYPE={inner}"
        shm = {"on": False, "why": f"built, not used: {why}"}
    return {
        "built": True,
        "path": module.__file__,
        "why": "",
        "cpu_codec": codec,
        "shm": shm,
        "nccl": nccl,
    }


def gpus() -> dict[str, Any]:
    """The visible GPUs and, for each ordered pair, whether one reaches the other directly
    (peer-to-peer: NVLink or PCIe), which decides the regime of NCCL's CUDA tensors."""
    if not torch.cuda.is_available():
        why = "torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        return {"count": 0, "why": why, "devices": [], "peer_to_peer": []}
    n = torch.cuda.device_count()
    devices = []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
            }
        )
    pairs = [
        {"from": a, "to": b, "peer": bool(torch.cuda.can_device_access_peer(a, b))}
        for a in range(n)
        for b in range(n)
        if a != b
    ]
    return {"count": n, "why": "", "devices": devices, "peer_to_peer": pairs}


def calibration() -> dict[str, Any]:
    """The calibration file (``CGX2_CALIBRATION_FILE``): where, whether it is used, and the
    crossovers and node mesh answers it holds."""
    path = _setting("CGX2_CALIBRATION_FILE")
    found: dict[str, Any] = {"path": path, "status": "absent", "why": ""}
    try:
        data = calibration_file.load(path)
    except calibration_file.CalibrationFileError as e:
        return {**found, "status": "ignored", "why": str(e)}
    if data is None:
        found["why"] = "the built-in crossovers apply; python -m cgx2.bench calibrate writes one"
        return found
    return {
        **found,
        "status": "used",
        "crossover_bytes": data["crossover_bytes"],
        "beside_crossover_bytes": data.get("beside_crossover_bytes", {}),
        "node_mesh_faster": data.get("node_mesh_faster", {}),
    }


def _carriers(cuda: bool) -> list[tuple[str, str, bool]]:
    """(device, backend, whether NCCL carries its CUDA tensors) that this machine can run."""
    found = [("cpu", "gloo", False)]
    if cuda:
        found += [("cuda", "nccl", True), ("cuda", "gloo", False)]
    return found


def regimes(calibrated: dict[str, Any], cuda: bool) -> list[dict[str, Any]]:
    """For each device and backend this machine can run, the regime the policy assumes (as
    :func:`cgx2.collectives.policy.detect_regime` names it without a process group) and the
    smallest tensor it compresses, per input width, with where that number comes from."""
    override = _setting("CGX2_CROSSOVER_BYTES")
    table = calibrated.get("crossover_bytes", {})
    rows = []
    for device, backend, on_nccl in _carriers(cuda):
        regime = policy.detect_regime(torch.device(device), backend, on_nccl)
        crossovers = {}
        for width, itemsize in WIDTHS.items():
            key = f"{device}/{backend}/{width}"
            if override is not None:
                value, source = override, "environment: CGX2_CROSSOVER_BYTES"
            elif key in table:
                value, source = table[key], f"calibration file: {key}"
            else:
                value = policy.CROSSOVER_BYTES[regime][0 if itemsize >= 4 else 1]
                source = "built-in table"
                if config.launch().spans_nodes and (device == "cpu" or on_nccl):
                    source += " (a group across hosts measures its link at first use instead)"
            crossovers[width] = {"bytes": value, "source": source}
        rows.append(
            {"device": device, "backend": backend, "regime": regime, "crossover": crossovers}
        )
    return rows


def _why_regime(cuda: bool) -> str:
    """One sentence on what the CUDA regime was decided by."""
    if not cuda:
        return (
            "CPU tensors are in the cpu regime, where the built-in crossover compresses every "
            "size: the link between CPU hosts is unknown here (calibrate to measure it)."
        )
    launch = config.launch()
    if launch.spans_nodes:
        return "WORLD_SIZE is above LOCAL_WORLD_SIZE: the job spans nodes (socket)."
    if launch.nccl_p2p_disabled:
        shm = "NCCL_SHM_DISABLE=1 too: sockets" if launch.nccl_shm_disabled else "shared memory"
        return f"NCCL_P2P_DISABLE=1: NCCL goes through {shm}."
    return (
        "every GPU reaches every other directly (nvlink), else shm; one GPU a process is "
        "assumed nvlink, where compression pays least."
    )


def settings(calibrated: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every ``CGX_*``/``CGX2_*`` setting, its value and source (:func:`cgx2.config.sources`),
    where the policy fills ``auto`` from the calibration file, saying so."""
    found = {}
    for variable, (value, source) in config.sources().items():
        if source == "default" and calibrated["status"] == "used":
            if variable == "CGX2_CROSSOVER_BYTES" and calibrated["crossover_bytes"]:
                source = "calibration file"
            if variable == "CGX2_NODE_MESH" and calibrated["node_mesh_faster"]:
                source = "calibration file"
        found[variable] = {"value": value, "source": source}
    return found


def report() -> dict[str, Any]:
    """Everything ``python -m cgx2.env`` says, as JSON-ready values."""
    calibrated = calibration()
    cuda = torch.cuda.is_available()
    launch = config.launch()
    return {
        "versions": versions(),
        "platform": platform.platform(),
        "cpus": torch.get_num_threads(),
        "extension": compiled(),
        "gpus": gpus(),
        "launch": {
            "world_size": launch.world_size,
            "local_world_size": launch.local_world_size,
            "nccl_p2p_disabled": launch.nccl_p2p_disabled,
            "nccl_shm_disabled": launch.nccl_shm_disabled,
        },
        "regimes": regimes(calibrated, cuda),
        "regime_why": _why_regime(cuda),
        "calibration_file": calibrated,
        "settings": settings(calibrated),
    }


def _bytes(value: int | None) -> str:
    if value is None:
        return "never"
    if value == 0:
        return "every size"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= div and value % div == 0:
            return f"{value // div} {unit}"
    return f"{value} B"


def _shown(value: object) -> str:
    return "auto" if value is None else str(value)


def format_text(found: dict[str, Any]) -> str:
    """:func:`report` as the plain text ``python -m cgx2.env`` prints."""
    v = found["versions"]
    invalid = [name for name, s in found["settings"].items() if "invalid" in s["source"]]
    lines = [
        "cgx2 environment (python -m cgx2.env; --json for tools)",
        "",
        *(
            [f"cgx2 will raise at its first call: invalid {', '.join(invalid)} (see Settings)", ""]
            if invalid
            else []
        ),
        "Versions",
        f"  cgx2 {v['cgx2']}, python {v['python']}, torch {v['torch']} "
        f"(CUDA {v['cuda'] or 'none'}), triton {v['triton'] or 'not installed'}, "
        f"NCCL {v['nccl'] or 'none (torch without CUDA)'}",
        f"  torch.distributed backends: {v['backends'] or 'none'} (and cgx2's cgx)",
        f"  {found['platform']}, {found['cpus']} CPU threads for torch",
        "",
        "Compiled extension cgx2._C",
    ]
    ext = found["extension"]
    lines.append(f"  built: {ext['path']}" if ext["built"] else f"  NOT built: {ext['why']}")
    for key, name in (
        ("cpu_codec", "CPU codec"),
        ("shm", "shared-memory transport"),
        ("nccl", "NCCL transport"),
    ):
        part = ext[key]
        state = "on" if part["on"] else "off"
        lines.append(f"  {name}: {state}" + (f": {part['why']}" if part["why"] else ""))
    g = found["gpus"]
    lines += ["", "GPUs"]
    if not g["count"]:
        lines.append(f"  none: {g['why']}")
    for d in g["devices"]:
        lines.append(
            f"  cuda:{d['index']} {d['name']}, {d['memory_bytes'] / (1 << 30):.0f} GiB, "
            f"compute capability {d['capability']}"
        )
    if g["count"] > 1:
        no = [f"{p['from']}->{p['to']}" for p in g["peer_to_peer"] if not p["peer"]]
        lines.append(
            "  peer-to-peer: every pair" if not no else f"  peer-to-peer: NOT {', '.join(no)}"
        )
    lines += ["", "Regimes, and the smallest tensor the quantized allreduce compresses in each"]
    for r in found["regimes"]:
        crossovers = [
            (f"{width} {_bytes(c['bytes'])}", c["source"]) for width, c in r["crossover"].items()
        ]
        if len({source for _, source in crossovers}) == 1:
            crossover = f"{', '.join(size for size, _ in crossovers)} ({crossovers[0][1]})"
        else:
            crossover = "; ".join(f"{size} ({source})" for size, source in crossovers)
        tensors = f"{r['device']} tensors on {r['backend']}"
        lines.append(f"  {tensors}: regime {r['regime']}; compressed from: {crossover}")
    lines.append(f"  {found['regime_why']}")
    c = found["calibration_file"]
    lines += ["", "Calibration file", f"  {c['path']}: {c['status']}" + _why(c["why"])]
    for table in ("crossover_bytes", "beside_crossover_bytes"):
        for key, value in sorted(c.get(table, {}).items()):
            when = " beside the training step" if table.startswith("beside") else ""
            lines.append(f"    {key}{when}: {_bytes(value)}")
    for key, sizes in sorted(c.get("node_mesh_faster", {}).items()):
        won = [_bytes(int(size)) for size, faster in sorted(sizes.items(), key=_size) if faster]
        lines.append(f"    {key} node mesh faster at: {', '.join(won) or 'no size timed'}")
    lines += ["", "Settings (CGX_*, CGX2_*): value (source)"]
    width = max(len(name) for name in found["settings"])
    for name, s in found["settings"].items():
        lines.append(f"  {name.ljust(width)} {_shown(s['value'])} ({s['source']})")
    return "\n".join(
        textwrap.fill(line, 100, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 4))
        for line in lines
    )


def _why(text: str) -> str:
    return f" ({text})" if text else ""


def _size(item: tuple[str, bool]) -> int:
    return int(item[0])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx2.env",
        description="What cgx2 will do on this machine: versions, the compiled extension, the "
        "GPUs and their peer-to-peer access, the regime and crossovers the policy assumes, the "
        "calibration file, and every CGX_*/CGX2_* setting with its source. Paste it into bug "
        "reports.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    found = report()
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        print(format_text(found))
    return 0


def console() -> None:
    """The ``cgx2-env`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
