"""Markdown tables for BENCHMARKS.md from the raw JSON results, so every quoted number traces
to a file: ``python bench/tables.py bench/results/allreduce_*.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def allreduce_table(path: Path, bits: int | None = None) -> str:
    report = json.loads(path.read_text())
    env = report["env"]
    lines = [
        f"`{path.name}` — {env['device']} ×{env['world_size']}, regime **{env['regime']}**, "
        f"torch {env['torch']}, NCCL {env.get('nccl', '-')}, {env['date']}",
        "",
        "| dtype | size | bits | NCCL ms | cgx2 ms | bf16-cast ms | speed of light ms "
        "| cgx2 vs NCCL | cgx2 / speed of light |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if bits is not None and r["bits"] != bits:
            continue
        cast = "-" if r["cast_bf16_ms"] is None else f"{r['cast_bf16_ms']:.3f}"
        lines.append(
            f"| {r['dtype']} | {r['size']} | {r['bits']} | {r['plain_ms']:.3f} | "
            f"{r['cgx2_ms']:.3f} | {cast} | {r['sol_ms']:.3f} | "
            f"**{r['speedup_vs_plain']:.2f}×** | {r['fraction_of_sol']:.0%} |"
        )
    return "\n".join(lines)


def kernels_table(path: Path) -> str:
    report = json.loads(path.read_text())
    env = report["environment"] if "environment" in report else report["env"]
    lines = [
        f"`{path.name}` — {env.get('device', env.get('device_name'))}, torch {env['torch']}, "
        f"Triton {env.get('triton')}",
        "",
        "| kernel | dtype | bits | ms | GB/s (read+written) | copy GB/s, same run | % of copy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["timing"]:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['bits']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
            f"{r['copy_gbps']:.0f} | {r['gbps'] / r['copy_gbps']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    bits = None
    if argv and argv[0].startswith("--bits="):
        bits, argv = int(argv[0].split("=")[1]), argv[1:]
    for name in argv:
        path = Path(name)
        if path.name.startswith("allreduce_"):
            print(allreduce_table(path, bits), end="\n\n")
        else:
            print(kernels_table(path), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
