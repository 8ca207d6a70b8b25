"""The tables of a bench/nccl_hosts.sh run, from its folder's raw files: per layout (hosts x GPUs)
and link rate, headed by the link's delivered rate (NCCL's fp32 allreduce bus bandwidth).

Usage: python bench/nccl_hosts_summary.py bench/results/nccl_hosts_<gpu>_<date>/
Writes summary.md and summary.json there, and prints the markdown.
"""

from __future__ import annotations

import glob
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

MLP_RUNS = [
    ("mlp_plain", "plain DDP"),
    ("mlp_cgx4", "cgx_hook 4-bit"),
    ("mlp_cgx4_flat", "cgx_hook 4-bit, flat (CGX2_NODE_MESH=0)"),
    ("mlp_cgx4_mesh", "cgx_hook 4-bit, node mesh (CGX2_NODE_MESH=1)"),
    ("mlp_cgx8", "cgx_hook 8-bit"),
    ("mlp_plain_big", "plain DDP, 100 MB buckets"),
    ("mlp_cgx4_big", "cgx_hook 4-bit, 100 MB buckets"),
    ("mlp_bf16", "torch bf16_compress_hook"),
    ("mlp_powersgd", "torch PowerSGD, rank 4"),
    ("mlp_compress", "cgx2.ddp.compress 4-bit"),
    ("mlp_cgx4o", "cgx2.ddp.compress 4-bit, AdamW in the backward pass"),
    ("mlp_cgx3r", "cgx_hook 3-bit, rotated"),
    ("mlp_cgx2r", "cgx_hook 2-bit, rotated"),
    ("mlp_cgx25ar", "cgx_hook 2/3/4/8-bit within 2.28 bits a value, rotated"),
    ("mlp_allreduce", "torch allreduce_hook"),
]
FSDP_ROWS = [
    (f"{kind}_{dtype}", f"{'HSDP 2 x 2' if kind == 'hsdp' else 'FSDP2'}, {dtype} params")
    for kind in ("fsdp", "hsdp")
    for dtype in ("fp32", "bf16")
]
FSDP_RUNS = ("b32", "b4", "b4p8", "b4p8k")  # own, 4-bit gradients, + 8-bit parameters, kept
_RATE = re.compile(r"^(\d+)(bit|kbit|mbit|gbit)$")


def bits_per_second(rate: str) -> float | None:
    match = _RATE.match(rate)
    if not match:
        return None
    return int(match.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)]


def load(folder: Path, pattern: str) -> dict[str, Any] | None:
    """The newest JSON file matching ``pattern`` in ``folder``, or None."""
    found = sorted(folder.glob(pattern)) if folder.is_dir() else []
    return json.loads(found[-1].read_text()) if found else None


def rounds_of(folder: Path, name: str) -> list[Path]:
    """The folders of run ``name``'s rounds in ``folder`` (nccl_hosts.sh's NCCL_HOST_ROUNDS:
    round 1 is NAME, round r NAME@r), in round order; those that exist."""
    later = folder.glob(f"{glob.escape(name)}@*")
    found = [folder / name, *sorted(later, key=lambda p: int(p.name.rpartition("@")[2]))]
    return [p for p in found if p.is_dir()]


def load_run(folder: Path, name: str, pattern: str) -> dict[str, Any] | None:
    """Run ``name``'s result (its JSON matching ``pattern``): with several rounds, every number
    the median over the rounds that have one (:func:`median_of`); None where none has."""
    results = [r for r in (load(p, pattern) for p in rounds_of(folder, name)) if r is not None]
    return median_of(results) if results else None


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``results`` with each number that every one holds (their rows' too, where
    they hold as many) replaced by its median over them, and ``rounds``: how many."""
    if len(results) == 1:
        return results[0]
    merged = dict(results[0])
    for key in results[0]:
        values = [r.get(key) for r in results]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = statistics.median(values)
    rows = [r.get("rows") for r in results]
    if all(isinstance(x, list) for x in rows) and len({len(x) for x in rows}) == 1:
        merged["rows"] = [
            median_of([x[i] for x in rows]) if isinstance(rows[0][i], dict) else rows[0][i]
            for i in range(len(rows[0]))
        ]
    merged["rounds"] = len(results)
    return merged


def round_rows(folder: Path, runs: dict[str, dict]) -> list[str]:
    """A row a run timed in several rounds: each round's time (a DDP or training step, ms),
    their median and spread (the slowest over the fastest)."""
    rows = []
    for name in runs:
        if "@" in name:
            continue
        times = []
        for path in rounds_of(folder, name):
            got = load(path, "*.json") or {}
            value = got.get("median_ms", got.get("step_ms"))
            times.append(value if isinstance(value, (int, float)) else None)
        if len(times) < 2:
            continue
        known = [t for t in times if t is not None]
        if not known:  # no step timed (an allreduce table, a timeline, failed rounds)
            continue
        each = ", ".join(ms(t) for t in times)
        spread = f"{max(known) / min(known):.3f}"
        rows.append(f"| {name} | {each} | {statistics.median(known):.1f} | {spread} |")
    return rows


def delivered(bench: dict[str, Any] | None, rate: str, hosts: int) -> dict[str, Any] | None:
    """What NCCL's fp32 allreduce at the largest size moved over each host's link, against the
    link's rate: an allreduce of B bytes among H hosts sends at least 2 (H - 1) / H B over each
    host's link (reduced inside a host first), so B / t times that; with one GPU a host this is
    NCCL's bus bandwidth, with several it leaves out the hops over NVLink inside a host."""
    rows = [r for r in (bench or {}).get("rows", []) if r.get("dtype") == "fp32"]
    if not rows or hosts < 2:
        return None
    row = max(rows, key=lambda r: (r["bytes"], -r["plain_ms"]))
    link_gbs = row["bytes"] / (row["plain_ms"] * 1e-3) * 2 * (hosts - 1) / hosts / 1e9
    gbit = link_gbs * 8
    link = bits_per_second(rate)
    return {
        "size": row["size"],
        "busbw_gbs": link_gbs,
        "nccl_busbw_gbs": row["plain_busbw"],
        "gbit_s": gbit,
        "of_rate": None if not link else gbit * 1e9 / link,
    }


def wire_ms(
    run: dict[str, Any], sent: float | None, link: dict[str, Any] | None, hosts: int
) -> float | None:
    """A DDP step's bytes over the link, ms: what an allreduce of the fp32 gradients times
    ``sent`` must send over each host's link (2 (H - 1) / H of it) at the rate NCCL's allreduce
    delivered there. None where a part is unknown, or with several GPUs a host (``sent``
    counts the bytes that stay inside a host too)."""
    if sent is None or not link or not run.get("params") or not run.get("hosts"):
        return None
    if run.get("gpus_per_host") not in (None, "1"):
        return None  # several GPUs a host: part of the bytes stays inside it, over NVLink
    wire = run["params"] * 4 * sent * 2 * (hosts - 1) / hosts
    return wire / (link["busbw_gbs"] * 1e9) * 1e3


def light(
    run: dict[str, Any], sent: float | None, link: dict[str, Any] | None, hosts: int
) -> float | None:
    """A DDP step's speed of light, ms: the longer of its compute (the step under no_sync) and
    its bytes over the link (:func:`wire_ms`). None where a part is unknown."""
    compute, wire = run.get("compute_ms"), wire_ms(run, sent, link, hosts)
    return None if compute is None or wire is None else max(compute, wire)


def ddp_light(
    run: dict[str, Any], sent: float | None, link: dict[str, Any] | None, hosts: int
) -> float | None:
    """The same, as DDP can at best overlap: a gradient leaves only during the backward pass,
    so the forward pass and the optimizer's step add to the longer of the backward pass and
    the bytes; an optimizer stepping in the backward pass (``optimizer_in_backward_ms``, its
    ``optimizer_ms`` 0) adds to the backward pass's compute instead. None where the phases
    were not timed apart."""
    phases = [run.get(k) for k in ("forward_ms", "backward_ms", "optimizer_ms")]
    wire = wire_ms(run, sent, link, hosts)
    if wire is None or None in phases:
        return None
    forward, backward, optimizer = phases
    in_backward = run.get("optimizer_in_backward_ms") or 0.0
    return forward + optimizer + max(backward + in_backward, wire)


def params(results: object) -> str:
    """The model's size, from the first result that has one."""
    for r in results:  # type: ignore[attr-defined]
        if r and r.get("params"):
            return f" ({r['params'] / 1e6:.2f}M parameters)"
    return ""


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def section(folder: Path, layout: str, rate: str, runs: dict[str, dict]) -> tuple[str, dict]:
    hosts, per_host = layout.split("x")
    bench = load_run(folder, "bench", "allreduce_*.json")
    link = delivered(bench, rate, int(hosts))
    head = f"### {hosts} hosts x {per_host} GPU{'s' if per_host != '1' else ''}, {rate} links"
    if link:
        share = f", {link['of_rate']:.0%} of the rate" if link["of_rate"] else ""
        head += (
            f": delivered {link['gbit_s']:.1f} Gbit/s{share} (NCCL's fp32 "
            f"allreduce at {link['size']}: {link['busbw_gbs']:.2f} GB/s over each host's link)"
        )
    else:
        head += ": delivered rate unknown (no allreduce table)"
    lines, data = [head, ""], {"layout": layout, "rate": rate, "delivered": link}

    def failed(name: str) -> str:
        run = runs.get(name)
        if run is None:
            return "not run"
        if run["rc"] is None:
            return "skipped (budget)"
        return f"failed (exit {run['rc']})" if run["rc"] else "no result"

    if bench:
        lines += [
            "| allreduce, fp32 | NCCL ms | cgx2 ms | bits | speedup | of light |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in bench["rows"]:
            lines.append(
                f"| {r['size']} {r['dtype']} | {r['plain_ms']:.2f} | {r['cgx2_ms']:.2f} "
                f"| {r['bits']} | {r['speedup_vs_plain']:.2f}x "
                f"| {r['fraction_of_sol']:.0%} |"
            )
        data["allreduce"] = bench["rows"]
    else:
        lines.append(f"allreduce table: {failed('bench')}")
    if any(n.startswith("mlp_") for n in runs):
        mlp = {name: load_run(folder, name, "ddp_*.json") for name, _ in MLP_RUNS}
        lines += [
            "",
            f"| DDP step, MLP{params(mlp.values())} | median ms | vs plain DDP | bytes vs plain "
            "| of light | of DDP's light |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        plain = (mlp["mlp_plain"] or {}).get("median_ms")
        data["mlp"] = {}
        for name, label in MLP_RUNS:
            r = mlp[name]
            if r is None and name not in runs:
                continue  # not asked for
            if r is None:
                lines.append(f"| {label} | {failed(name)} | | | | |")
                continue
            sent = r.get("bytes_sent_ratio")
            if name in ("mlp_plain", "mlp_allreduce"):
                sent = 1.0
            elif name == "mlp_bf16":
                sent = 0.5
            bound = light(r, sent, link, int(hosts))
            ddp_bound = ddp_light(r, sent, link, int(hosts))
            of_light, of_ddp_light = (
                "-" if b is None else f"{b / r['median_ms']:.0%}" for b in (bound, ddp_bound)
            )
            lines.append(
                f"| {label} | {r['median_ms']:.1f} | {ratio(plain, r['median_ms'])} "
                f"| {'-' if sent is None else f'{sent:.3f}'} "
                f"| {of_light} | {of_ddp_light} |"
            )
            data["mlp"][name] = {
                "median_ms": r["median_ms"],
                "compute_ms": r.get("compute_ms"),
                "bytes_sent_ratio": sent,
                "light_ms": bound,
                "ddp_light_ms": ddp_bound,
                **{
                    k: r.get(k)
                    for k in (
                        "forward_ms",
                        "backward_ms",
                        "optimizer_ms",
                        "optimizer_in_backward_ms",
                    )
                },
            }
    if any(n.startswith("ddp_") for n in runs):
        rows = [("eager", "ddp_b32", "ddp_b4"), ("--compile", "ddp_b32_compile", "ddp_b4_compile")]
        for run, label in (
            ("ddp_c4", "eager, cgx2.ddp.compress 4-bit (the hook where it pays)"),
            ("ddp_b4o", "eager, 4-bit with AdamW in the backward pass"),
            ("ddp_b3r", "eager, 3-bit rotated"),
            ("ddp_b3ro", "eager, 3-bit rotated with AdamW in the backward pass"),
        ):
            if run in runs:  # beside plain DDP's eager run, AdamW after the backward pass
                rows.append((label, "ddp_b32", run))
        ddp = {name: load_run(folder, name, "*.json") for row in rows for name in row[1:]}
        lines += [
            "",
            f"| train_ddp.py{params(ddp.values())} | plain DDP ms "
            "| cgx_hook ms (4-bit unless said) | speedup |",
            "| --- | ---: | ---: | ---: |",
        ]
        data["train_ddp"] = {}
        for label, plain_run, cgx_run in rows:
            b32, b4 = ddp[plain_run], ddp[cgx_run]
            p, q = (b32 or {}).get("step_ms"), (b4 or {}).get("step_ms")
            p_text = ms(p) if b32 else failed(plain_run)
            q_text = ms(q) if b4 else failed(cgx_run)
            lines.append(f"| {label} | {p_text} | {q_text} | {ratio(p, q)} |")
            data["train_ddp"][label] = {"plain_ms": p, "cgx4_ms": q}
    if any(n.startswith(("fsdp_", "hsdp_")) for n in runs):
        fsdp = {
            (prefix, b): load_run(folder, f"{prefix}_{b}", "*.json")
            for prefix, _ in FSDP_ROWS
            for b in FSDP_RUNS
        }
        lines += [
            "",
            f"| train_fsdp.py{params(fsdp.values())} | FSDP2's own ms "
            "| 4-bit reduce-scatter ms | + 8-bit parameters ms | the same, kept for the backward "
            "| sent vs uncompressed (+ 8-bit, kept) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        data["train_fsdp"] = {}
        for prefix, label in FSDP_ROWS:
            got = {b: fsdp[(prefix, b)] for b in FSDP_RUNS}
            if prefix.startswith("hsdp") and not any(n.startswith(prefix) for n in runs):
                continue
            own = (got["b32"] or {}).get("step_ms")
            cells = [ms(own) if got["b32"] else failed(f"{prefix}_b32")]
            for b in FSDP_RUNS[1:]:
                r = got[b]
                cells.append(
                    f"{r['step_ms']:.1f} ({ratio(own, r['step_ms'])})"
                    if r
                    else failed(f"{prefix}_{b}")
                )
            sent = [
                ratio(r["bytes_uncompressed"], r["bytes_sent"]) + " less"
                for r in (got[b] for b in FSDP_RUNS[1:])
                if r and r.get("bytes_sent")
            ]
            lines.append(f"| {label} | {' | '.join(cells)} | {' / '.join(sent) or '-'} |")
            data["train_fsdp"][prefix] = {
                b: r
                and {
                    k: r.get(k)
                    for k in (
                        "step_ms",
                        "bytes_sent",
                        "bytes_uncompressed",
                        "all_gather_bytes_sent",
                        "all_gather_bytes_uncompressed",
                    )
                }
                for b, r in got.items()
            }
    conv = {
        n: load_run(folder, n, "run_*.json")
        for n in runs
        if n.startswith("conv_") and "+" not in n and "@" not in n
    }
    if conv:
        plain, four = ((conv.get(n) or {}).get("step_ms") for n in ("conv_plain", "conv_cgx4"))
        lines += [
            "",
            "| convergence.py's model, a step | ms | bits a value | vs plain DDP | vs CGX 4-bit |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        data["convergence_step"] = {}
        for name, r in conv.items():
            if r is None:
                lines.append(f"| {name[5:]} | {failed(name)} | | | |")
                continue
            bits = r.get("bits_per_value")
            lines.append(
                f"| {name[5:]} | {r['step_ms']:.1f} | {'-' if bits is None else f'{bits:.2f}'} "
                f"| {ratio(plain, r['step_ms'])} | {ratio(four, r['step_ms'])} |"
            )
            data["convergence_step"][name[5:]] = {"step_ms": r["step_ms"], "bits_per_value": bits}
    variants = variant_rows(folder, runs, mlp_plain=load_run(folder, "mlp_plain", "ddp_*.json"))
    if variants:
        lines += [
            "",
            "| variant (run+variables) | what | ms | vs its run |",
            "| --- | --- | ---: | ---: |",
            *variants,
        ]
    repeated = round_rows(folder, runs)
    if repeated:
        lines += [
            "",
            "| run, in rounds (each number above: their median) | each round's ms | median ms "
            "| slowest / fastest |",
            "| --- | --- | ---: | ---: |",
            *repeated,
        ]
    return "\n".join(lines), data


def variant_rows(folder: Path, runs: dict[str, dict], mlp_plain: dict | None) -> list[str]:
    """Rows for runs named RUN+VAR=VALUE (nccl_hosts.sh's A/B): each beside RUN's own result."""
    rows = []
    for name in runs:
        if "+" not in name or "@" in name:
            continue
        base = name.split("+", 1)[0]
        if base == "bench":
            got, own = (
                load_run(folder, name, "allreduce_*.json"),
                load_run(folder, base, "allreduce_*.json"),
            )
            if got is None:
                rows.append(f"| {name} | allreduce | no result | |")
                continue
            mine = {
                (r["size"], r["dtype"], r["bits"]): r["cgx2_ms"]
                for r in (own or {}).get("rows", [])
            }
            for r in got.get("rows", []):  # a variant may be another version's JSON
                key = (r.get("size"), r.get("dtype"), r.get("bits"))
                light = r.get("fraction_of_sol")
                rows.append(
                    f"| {name} | {key[0]} {key[1]} {key[2]}-bit "
                    f"({'?' if light is None else f'{light:.0%}'} of light) "
                    f"| {ms(r.get('cgx2_ms'))} | {ratio(mine.get(key), r.get('cgx2_ms'))} |"
                )
        elif base.startswith(("mlp_", "ddp_")):
            # pattern of the run's JSON, its step's key, and what the step is
            pattern, key, what = (
                ("ddp_*.json", "median_ms", "DDP step")
                if base.startswith("mlp_")
                else ("*.json", "step_ms", "train_ddp.py step")
            )
            got, own = load_run(folder, name, pattern), load_run(folder, base, pattern)
            if got is None:
                rows.append(f"| {name} | {what} | no result | |")
                continue
            step = got[key]
            if base.startswith("mlp_"):
                what += f" ({ratio((mlp_plain or {}).get('median_ms'), step)} plain DDP)"
            rows.append(f"| {name} | {what} | {step:.1f} | {ratio((own or {}).get(key), step)} |")
    return rows


def gpus(machine: dict[str, Any]) -> str:
    """The machine's GPUs in a few words ("4 x NVIDIA H100 80GB HBM3, driver 580.159.04")."""
    rows = [r.split(",") for r in (machine.get("gpus") or "").splitlines() if r.strip()]
    if not rows:
        return f"{machine.get('ngpu')} GPUs"
    driver = f", driver {rows[0][1].strip()}" if len(rows[0]) > 1 else ""
    return f"{len(rows)} x {rows[0][0].strip()}{driver}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    top = Path(argv[0])
    machine = json.loads((top / "machine.json").read_text())
    runs_file = top / "runs.jsonl"
    runs = (
        [json.loads(line) for line in runs_file.read_text().splitlines()]
        if runs_file.exists()
        else []
    )
    by_place: dict[tuple[str, str], dict[str, dict]] = {}
    for run in runs:
        by_place.setdefault((run["layout"], run["rate"]), {})[run["run"]] = run
    parts = [
        f"## GPU servers over Ethernet: {gpus(machine)}, "
        f"torch {machine.get('torch')}, NCCL {machine.get('nccl')}, {machine['date']}",
        "",
        f"`{machine['command']}`; the lab's hosts are network namespaces of one machine "
        "(NCCL's sockets over veth top out near 20 Gbit/s: faster links are stood for by "
        "the shm and NVLink regimes). One host's sections name its regime (nvlink, shm, "
        "socket) in place of a rate. Of light: the step's speed of light (its compute, timed "
        "under DDP's no_sync, or its bytes over the delivered rate, the longer) over its time; "
        "of DDP's light: the same where the bytes overlap only the backward pass (forward + "
        "optimizer + the longer of backward and the bytes), as DDP can at best.",
        "",
    ]
    summary = {"machine": machine, "sections": []}
    for (layout, rate), place in by_place.items():  # in the order they ran
        text, data = section(top / f"{layout}_{rate}", layout, rate, place)
        parts += [text, ""]
        summary["sections"].append(data)
    failed = [f"{r['layout']} {r['rate']} {r['run']}" for r in runs if r["rc"]]
    skipped = [f"{r['layout']} {r['rate']} {r['run']}" for r in runs if r["rc"] is None]
    if failed:
        parts.append(f"Failed: {', '.join(failed)} (their run.log).")
    if skipped:
        parts.append(f"Skipped past the time budget: {', '.join(skipped)}.")
    text = "\n".join(parts).rstrip() + "\n"
    (top / "summary.md").write_text(text)
    summary["failed"], summary["skipped"] = failed, skipped
    (top / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
