"""Markdown tables for BENCHMARKS.md from the raw JSON results, so every quoted number traces
to a file: ``python bench/tables.py bench/results/allreduce_*.json``; ``--sweep A B`` puts one
regime's runs on several GPU counts side by side, ``--summary FILES`` one row per file and size,
``--by-bits FILE`` a kernel timing file with one row per kernel and dtype."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kernel_profile import summary  # bench/ is this script's folder, first on sys.path


def _timing(report: dict) -> str:
    """How the bench timed its calls (``--calls``; results before it timed one call a window)."""
    calls = report["args"].get("calls", 1)
    return "one call per window" if calls == 1 else f"{calls} calls back to back per window"


def _plain(report: dict) -> str:
    """Whose allreduce "plain" is: gloo's for CPU tensors and ``--backend gloo``, else NCCL's."""
    cpu = report["env"]["regime"].startswith("cpu")
    return "gloo" if cpu or report["args"].get("backend") == "gloo" else "NCCL"


def _title(path: Path, *parts: object) -> str:
    """A table's first line: its file's name, then ``parts``, comma-separated."""
    return f"`{path.name}` — " + ", ".join(map(str, parts))


def _row(*cells: object) -> str:
    """A markdown table's row of ``cells``."""
    return "| " + " | ".join(map(str, cells)) + " |"


def allreduce_table(path: Path, bits: int | None = None) -> str:
    report = json.loads(path.read_text())
    env = report["env"]
    plain = _plain(report)
    auto = "auto_ms" in report["rows"][0]  # results since the automatic fallback
    a2a = "sol_all_to_all_ms" in report["rows"][0]  # since two ranks swap by all-gather
    lines = [
        _title(
            path,
            f"{env['device']} ×{env['world_size']}",
            f"regime **{env['regime']}**",
            f"torch {env['torch']}",
            f"NCCL {env.get('nccl', '-')}",
            env["date"],
            _timing(report),
        ),
        "",
        f"| dtype | size | bits | {plain} ms | cgx2 ms | bf16-cast ms | speed of light ms "
        + ("| all_to_all light ms " if a2a else "")
        + f"| cgx2 vs {plain} | cgx2 / speed of light |"
        + (f" auto: path, ms | auto vs {plain} |" if auto else ""),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if a2a else "")
        + (" --- | ---: |" if auto else ""),
    ]
    for r in report["rows"]:
        if bits is not None and r["bits"] != bits:
            continue
        cast = "-" if r["cast_bf16_ms"] is None else f"{r['cast_bf16_ms']:.3f}"
        line = (
            f"| {r['dtype']} | {r['size']} | {r['bits']} | {r['plain_ms']:.3f} | "
            f"{r['cgx2_ms']:.3f} | {cast} | {r['sol_ms']:.3f} | "
            + (f"{r['sol_all_to_all_ms']:.3f} | " if a2a else "")
            + f"**{r['speedup_vs_plain']:.2f}×** | {r['fraction_of_sol']:.0%} |"
        )
        if auto:
            line += f" {r['auto_path']}, {r['auto_ms']:.3f} | **{r['auto_vs_plain']:.2f}×** |"
        lines.append(line)
    return "\n".join(lines)


def graphs_table(path: Path) -> str:
    """cgx2 launched eagerly and replaying CUDA graphs (``python -m cgx2.bench --cuda-graphs``),
    in one run: times, ratios to NCCL, and "auto" (in place, plain below the crossover)."""
    report = json.loads(path.read_text())
    env = report["env"]
    lines = [
        _title(
            path,
            f"{env['device']} ×{env['world_size']}",
            f"regime **{env['regime']}**",
            env["date"],
            _timing(report),
        ),
        "",
        "| dtype | size | NCCL ms | cgx2 ms | graphs ms | light ms | cgx2 vs NCCL | cgx2 / light "
        "| graphs vs NCCL | graphs / light | graphs auto: path, vs NCCL |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report["rows"]:
        auto = "-"
        if r.get("graphs_auto_path") is not None:
            auto = f"{r['graphs_auto_path']}, {r['graphs_auto_vs_plain']:.2f}×"
        lines.append(
            _row(
                r["dtype"],
                r["size"],
                f"{r['plain_ms']:.3f}",
                f"{r['cgx2_ms']:.3f}",
                f"{r['cgx2_graphs_ms']:.3f}",
                f"{r['sol_ms']:.3f}",
                f"{r['speedup_vs_plain']:.2f}×",
                f"{r['fraction_of_sol']:.0%}",
                f"**{r['graphs_speedup_vs_plain']:.2f}×**",
                f"{r['graphs_fraction_of_sol']:.0%}",
                auto,
            )
        )
    return "\n".join(lines)


def train_table(paths: list[Path]) -> str:
    """One row per regime: plain DDP, cgx_hook and the cgx backend (examples/train_ddp.py)."""
    runs: dict[str, dict[str, dict]] = {}
    for path in paths:
        r = json.loads(path.read_text())
        kind = "plain" if r["bits"] == 32 else r.get("mode", "hook")
        row = f"{r['env']['regime']} ×{r['world_size']}"  # no comma: graphs rows split at it
        if kind != "plain" and r["env"].get("cgx2_env", {}).get("CGX2_CUDA_GRAPHS") == "1":
            row += ", CUDA graphs"  # a row of its own, against the regime's plain run
        runs.setdefault(row, {})[kind] = r | {"file": path.stem}
    for row, r in runs.items():
        if "plain" not in r and row.split(",")[0] in runs:
            r["plain"] = runs[row.split(",")[0]].get("plain")
    lines = [
        "| regime ×GPUs | plain ms/step | hook ms/step | hook vs plain | backend ms/step "
        "| backend vs plain | bytes sent, hook / backend / plain (MB) "
        "| loss plain / hook / backend | files (`bench/results/`) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for regime, r in runs.items():
        plain = r["plain"]
        kinds = [kind for kind in ("plain", "hook", "backend") if kind in r]
        files = ", ".join(f"`{r[kind]['file']}`" for kind in kinds)
        cells = {}
        for kind in ("hook", "backend"):  # a row may lack either
            run = r.get(kind)
            cells[kind] = (
                (
                    f"{run['step_ms']:.1f}",
                    f"**{plain['step_ms'] / run['step_ms']:.2f}×**",
                    f"{run['bytes_sent'] / 1e6:.0f}",
                    f"{run['final_loss']:.3f}",
                )
                if run
                else ("-",) * 4
            )
        hook, backend = cells["hook"], cells["backend"]
        counted = r.get("hook") or r.get("backend")  # a plain run counts no bytes
        uncompressed = f"{counted['bytes_uncompressed'] / 1e6:.0f}" if counted else "-"
        lines.append(
            f"| {regime} | {plain['step_ms']:.1f} | {hook[0]} | {hook[1]} | {backend[0]} | "
            f"{backend[1]} | {hook[2]} / {backend[2]} / {uncompressed} | "
            f"{plain['final_loss']:.3f} / {hook[3]} / {backend[3]} | {files} |"
        )
    return "\n".join(lines)


def kernels_by_bits(path: Path) -> str:
    """A gpu_check/kernels JSON with one row per kernel and dtype: ms and % of copy per width."""
    report = json.loads(path.read_text())
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in report["timing"] if "timing" in report else report["rows"]:
        rows.setdefault((r["op"], r["dtype"]), {})[r["bits"]] = r
    widths = sorted({b for by in rows.values() for b in by if b > 0})  # bits 0: the copy
    lines = [
        "| kernel | dtype | " + " | ".join(f"{b} bits: ms, % of copy" for b in widths) + " |",
        "| --- | --- |" + " ---: |" * len(widths),
    ]
    for (op, dtype), by in rows.items():
        if not set(by) & set(widths):
            continue
        cells = [
            f"{by[b]['ms']:.3f}, {by[b]['gbps'] / by[b]['copy_gbps']:.0%}" if b in by else "-"
            for b in widths
        ]
        lines.append(f"| {op} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernels_table(path: Path) -> str:
    report = json.loads(path.read_text())
    env = report["environment"] if "environment" in report else report["env"]
    lines = [
        _title(
            path,
            env.get("device", env.get("device_name")),
            f"torch {env['torch']}",
            f"Triton {env.get('triton')}",
        ),
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


def profile_table(path: Path) -> str:
    """bench/kernel_profile.py's results: what each kernel issues, waits on and is made of."""
    report = json.loads(path.read_text())
    env = report["env"]
    lines = [
        _title(
            path,
            env["device"],
            f"torch {env['torch']}",
            f"Triton {env.get('triton')}",
            env.get("ncu", "ncu"),
        ),
        "",
        "| kernel | dtype | bits | µs | IPC | issue busy | DRAM | occupancy | registers | "
        "instructions a value | warp samples | instructions a value, most common |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in report["kernels"]:
        stalls, ops = summary(r)
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['bits']} | {r['duration']:.1f} | "
            f"{r['issued_ipc']:.2f} | {r['issue_busy_pct']:.0f}% | {r['dram_pct']:.0f}% | "
            f"{r['achieved_occupancy_pct']:.0f}% | {r['registers']:.0f} | "
            f"{r['instructions_per_value']:.1f} | {stalls} | {ops} |"
        )
    return "\n".join(lines)


def _sweep_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return (
        f"**{r['speedup_vs_plain']:.2f}×**, {r['fraction_of_sol']:.0%}, "
        f"{r['auto_path'][0]} {r['auto_vs_plain']:.2f}×"
    )


def sweep_table(paths: list[Path]) -> str:
    """One regime's sweep on several GPU counts side by side (one JSON each): per size, per
    GPU count and dtype, cgx2 vs NCCL, cgx2 / speed of light, and auto (p/q) vs NCCL."""
    reports = [json.loads(p.read_text()) for p in paths]
    dtypes = list(dict.fromkeys(r["dtype"] for r in reports[0]["rows"]))
    keyed = [{(r["dtype"], r["size"]): r for r in rep["rows"]} for rep in reports]
    sizes = list(dict.fromkeys(r["size"] for r in reports[0]["rows"]))
    head = [f"{rep['env']['world_size']} GPUs, {d}" for rep in reports for d in dtypes]
    lines = ["| size | " + " | ".join(head) + " |", "| ---: |" + " ---: |" * len(head)]
    for size in sizes:
        cells = [_sweep_cell(rows.get((d, size))) for rows in keyed for d in dtypes]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(paths: list[Path]) -> str:
    """One row per (file, dtype, size): how it was timed, the ratios, and the file."""
    lines = [
        "| regime | ranks | timed | dtype | size | plain | plain ms | cgx2 ms | cgx2 vs plain "
        "| cgx2 / light | graphs vs plain | file |",
        "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for path in paths:
        rep = json.loads(path.read_text())
        calls = rep["args"].get("calls", 1)
        timed = "one call" if calls == 1 else f"{calls} back to back"
        for r in rep["rows"]:
            graphs = r.get("graphs_speedup_vs_plain")
            lines.append(
                _row(
                    rep["env"]["regime"],
                    rep["env"]["world_size"],
                    timed,
                    r["dtype"],
                    r["size"],
                    _plain(rep),
                    f"{r['plain_ms']:.3f}",
                    f"{r['cgx2_ms']:.3f}",
                    f"**{r['speedup_vs_plain']:.2f}×**",
                    f"{r['fraction_of_sol']:.0%}",
                    "-" if graphs is None else f"{graphs:.2f}×",
                    f"`{path.stem}`",
                )
            )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    missing = [n for n in argv if not n.startswith("--") and not Path(n).is_file()]
    if missing:
        sys.exit(f"tables.py: no such result file: {', '.join(missing)}")
    if argv and argv[0] in ("--sweep", "--summary"):
        table = sweep_table if argv[0] == "--sweep" else summary_table
        print(table([Path(n) for n in argv[1:]]), end="\n\n")
        return
    if argv and argv[0] == "--by-bits":
        for name in argv[1:]:
            print(kernels_by_bits(Path(name)), end="\n\n")
        return
    bits = None
    if argv and argv[0].startswith("--bits="):
        bits, argv = int(argv[0].split("=")[1]), argv[1:]
    for name in argv:
        path = Path(name)
        if path.name.startswith("allreduce_"):
            graphs = json.loads(path.read_text())["rows"][0].get("cgx2_graphs_ms") is not None
            table = graphs_table(path) if graphs else allreduce_table(path, bits)
            print(table, end="\n\n")
        elif path.name.startswith("kernel_profile_"):
            print(profile_table(path), end="\n\n")
        elif not path.name.startswith("train_ddp_"):
            print(kernels_table(path), end="\n\n")
    trains = [Path(n) for n in argv if Path(n).name.startswith("train_ddp_")]
    if trains:
        print(train_table(trains), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
