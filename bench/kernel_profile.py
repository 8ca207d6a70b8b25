"""Why a max-min kernel runs at the speed it does: Nsight Compute's issue rate, memory throughput,
occupancy, warp stall reasons and instructions per value, as a table and a JSON file.

Run on a GPU with ncu: ``python bench/kernel_profile.py [KERNEL:DTYPE:BITS ...]`` (default
``dse:fp32:4 dse:bf16:4 encode:fp32:4 encode:bf16:4``), on bench/kernel_ab.py's workloads (64M
values; decode-sum-encode sums 4 rows of 16M). ncu leaves the clocks as they are
(``--clock-control none``). ``run`` is the child that ncu profiles: one launch, after a warm-up,
between cudaProfilerStart and Stop.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = {"encode": "encode", "decode": "decode", "dse": "dse(K=4)"}
# ncu -k: the Triton kernel's function name.
KERNEL_NAMES = {
    "encode": "regex:^_encode_kernel",
    "decode": "regex:^_decode_kernel",
    "dse": "regex:^_decode_sum_encode_kernel",
}
DEFAULT_SPECS = ("dse:fp32:4", "dse:bf16:4", "encode:fp32:4", "encode:bf16:4")
# (section, metric name) -> key in the report.
DETAILS = {
    ("GPU Speed Of Light Throughput", "Duration"): "duration",
    ("GPU Speed Of Light Throughput", "SM Frequency"): "sm_frequency",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_pct",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_pct",
    ("Compute Workload Analysis", "Issue Slots Busy"): "issue_busy_pct",
    ("Compute Workload Analysis", "Issued Ipc Active"): "issued_ipc",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "cycles_per_issue",
    ("Occupancy", "Theoretical Occupancy"): "theoretical_occupancy_pct",
    ("Occupancy", "Achieved Occupancy"): "achieved_occupancy_pct",
    ("Launch Statistics", "Registers Per Thread"): "registers",
    ("Launch Statistics", "Grid Size"): "grid",
}


def parse_spec(spec: str) -> tuple[str, str, int]:
    """``KERNEL:DTYPE:BITS`` -> its parts, or ValueError naming what is wrong."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in KERNELS or parts[1] not in ("fp32", "bf16"):
        raise ValueError(
            f"a kernel is KERNEL:DTYPE:BITS ({'|'.join(KERNELS)}:fp32|bf16:1-8), got {spec!r}"
        )
    if not parts[2].isdigit() or not 1 <= int(parts[2]) <= 8:
        raise ValueError(f"bits must be 1-8, got {parts[2]!r} in {spec!r}")
    return parts[0], parts[1], int(parts[2])


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_details(text: str) -> dict[str, float]:
    """The metrics of :data:`DETAILS` from ``ncu --page details --csv`` of one kernel."""
    out: dict[str, float] = {}
    for row in csv.DictReader(io.StringIO(text)):
        key = DETAILS.get((row.get("Section Name", ""), row.get("Metric Name", "")))
        value = _number(row.get("Metric Value", ""))
        if key is not None and value is not None:
            unit = row.get("Metric Unit", "")
            scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "Mhz": 1e-3, "Ghz": 1.0}.get(unit, 1.0)
            out[key] = value * scale  # durations in us, frequencies in GHz
    return out


def parse_source(text: str, values: int) -> dict[str, Any]:
    """From ``ncu --page source --csv --print-source sass`` of one kernel: the share of warp
    samples per stall reason, and thread instructions per value, in all and per opcode (the
    opcode's full name, e.g. ``IMAD.WIDE.U32``; a predicate guard is skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no SASS table (a header starting with 'Address') in ncu's output")
    rows = list(csv.DictReader(lines[start:]))
    stall_columns = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    stalls: Counter[str] = Counter()
    opcodes: Counter[str] = Counter()
    for row in rows:
        for c in stall_columns:
            stalls[c.removeprefix("stall_")] += _number(row[c]) or 0.0
        words = row["Source"].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            opcodes[words[0]] += _number(row["Thread Instructions Executed"]) or 0.0
    samples = sum(stalls.values()) or 1.0
    return {
        "stalls": {k: v / samples for k, v in stalls.most_common() if v},
        "instructions_per_value": sum(opcodes.values()) / values,
        "opcodes_per_value": {k: v / values for k, v in opcodes.most_common() if v},
    }


def summary(result: dict[str, Any]) -> tuple[str, str]:
    """A result's four commonest stall reasons and six commonest opcodes, as table cells."""
    stalls = list(result["stalls"].items())[:4]
    opcodes = list(result["opcodes_per_value"].items())[:6]
    return (
        ", ".join(f"{k} {v:.0%}" for k, v in stalls),
        ", ".join(f"{k} {v:.1f}" for k, v in opcodes),
    )


def values_of(kernel: str, numel: int) -> int:
    """Values a kernel codes: decode-sum-encode sums rows of numel / 4."""
    return numel // 4 if kernel == "dse" else numel


def run_child(kernel: str, dtype: str, bits: int, numel: int) -> None:
    """One profiled launch of ``kernel``, after a warm-up (compiles, loads)."""
    import torch
    from kernel_ab import workloads

    from cgx2.codecs import maxmin_triton

    x = torch.randn(numel, device="cuda").to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    fn = workloads(maxmin_triton, x, bits)[KERNELS[kernel]][0]
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile(ncu: str, spec: str, numel: int, tmp: str) -> dict[str, Any]:
    kernel, dtype, bits = parse_spec(spec)
    rep = os.path.join(tmp, spec.replace(":", "_"))
    child = [sys.executable, os.path.abspath(__file__), "run", spec, "--numel", str(numel)]
    options = "--clock-control none --set full --import-source yes --profile-from-start off"
    only = ["-k", KERNEL_NAMES[kernel], "-c", "1", "-f", "-o", rep]
    subprocess.run([ncu, *options.split(), *only, *child], check=True, stdout=subprocess.DEVNULL)

    def page(*args: str) -> str:
        cmd = [ncu, "--import", rep + ".ncu-rep", "--csv", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    result: dict[str, Any] = {"kernel": kernel, "dtype": dtype, "bits": bits, "spec": spec}
    result.update(parse_details(page("--page", "details")))
    result.update(
        parse_source(page("--page", "source", "--print-source", "sass"), values_of(kernel, numel))
    )
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        p = argparse.ArgumentParser()
        p.add_argument("spec")
        p.add_argument("--numel", type=int, default=64 << 20)
        a = p.parse_args(sys.argv[2:])
        run_child(*parse_spec(a.spec), a.numel)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="*", default=list(DEFAULT_SPECS), help="KERNEL:DTYPE:BITS")
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    for spec in args.specs:
        parse_spec(spec)
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        p.error("Nsight Compute (ncu) is not installed")
    import torch

    from cgx2.bench.report import environment, format_table, write_json

    env = environment(torch.device("cuda"))
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout
    env["ncu"] = version.strip().splitlines()[-1]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(args.specs):
            print(f"profiling {spec} ({i + 1} of {len(args.specs)})", file=sys.stderr)
            results.append(profile(ncu, spec, args.numel, tmp))
    rows = [dict(zip(("top_stalls", "top_opcodes"), summary(r), strict=True), **r) for r in results]
    keys = ["kernel", "dtype", "bits"]  # a row's, shown as they are
    columns = [
        *keys,
        ("duration", "us", ".1f"),
        ("issued_ipc", "IPC", ".2f"),
        ("issue_busy_pct", "issue %", ".0f"),
        ("dram_pct", "DRAM %", ".0f"),
        ("achieved_occupancy_pct", "occup. %", ".0f"),
        ("registers", "regs", ".0f"),
        ("instructions_per_value", "instr/value", ".1f"),
        ("top_stalls", "warp samples", ""),
    ]
    print(format_table(rows, columns))
    per_value = [("spec", "kernel", ""), ("top_opcodes", "thread instructions per value", "")]
    print(format_table(rows, per_value))
    print(f"{env['device']}, {env['ncu']}; ncu's clocks left as they were", file=sys.stderr)
    if args.out_dir:
        report = {"env": env, "args": vars(args), "kernels": results}
        print(f"raw results: {write_json('kernel_profile', report, args.out_dir)}")


if __name__ == "__main__":
    main()
