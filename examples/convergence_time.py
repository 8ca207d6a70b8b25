"""Held-out loss against time to train, for every compressor of a convergence study
(examples/convergence.py's folder): the frontier users choose from, beside loss against bytes.

    python examples/convergence_time.py bench/results/convergence
    python examples/convergence_time.py bench/results/convergence --step-times FOLDER

The time axis is steps x a step's time. By default each run's own ``step_ms`` (the median wall
time of its training steps, as convergence.py measured it: for the committed study 4 ranks
sharing one GPU over gloo, two lanes a GPU, so a time of that machine's contention, not of a
link). ``--step-times FOLDER`` takes each compressor's step from another folder of
convergence.py runs of the same model (e.g. a short run of each across two GPU hosts at
10 Gbit/s, where time is bytes): the median of its runs' ``step_ms`` there; compressors it
lacks are left out, and named. Writes ``loss_by_time.json`` and, with matplotlib,
``loss_by_time.png`` (held-out loss against time, a line a run; and each compressor's final
loss against its time to train, the frontier joined); prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import summarize

from cgx2.bench.report import HelpFormatter


def step_times(folder: Path) -> dict[str, float]:
    """Each compressor's median ``step_ms`` over its runs in ``folder`` or below it (as
    bench/nccl_hosts.sh's conv_* runs lie, a folder a run)."""
    by: dict[str, list[float]] = {}
    for path in sorted(folder.rglob("run_*.json")):
        run = json.loads(path.read_text())
        by.setdefault(run["compressor"], []).append(run["step_ms"])
    return {name: statistics.median(ms) for name, ms in by.items()}


def frontier(points: list[dict]) -> list[str]:
    """The compressors no other beats on both time and loss (faster or as fast, and lower or
    as low, one of them strictly), fastest first."""
    kept = []
    best = math.inf
    for p in sorted(points, key=lambda p: (p["time_s"], p["held_out_loss"])):
        if p["held_out_loss"] < best:
            kept.append(p["compressor"])
            best = p["held_out_loss"]
    return kept


def time_to_train(summary: dict, times: dict[str, float] | None) -> dict:
    """Per compressor: bits a value, step ms, time to train (s), final held-out loss (mean over
    seeds), against plain's; per run its curve of (seconds, held-out loss). ``times``: step ms
    by compressor (None: each run's own)."""
    rows, curves, missing = [], [], []
    for row in summary["rows"]:
        name = row["compressor"]
        if times is not None and name not in times:
            missing.append(name)
            continue
        runs = [r for r in summary["runs"] if r["compressor"] == name]
        ms = [times[name] if times is not None else r["step_ms"] for r in runs]
        steps = runs[0]["evals"][-1]["step"]
        for r, step_ms in zip(runs, ms, strict=True):
            curves.append(
                {
                    "compressor": name,
                    "what": row["what"],
                    "seed": r["seed"],
                    "points": [(e["step"] * step_ms / 1e3, e["loss"]) for e in r["evals"]],
                }
            )
        rows.append(
            {
                "compressor": name,
                "what": row["what"],
                "seeds": row["seeds"],
                "bits_per_value": row.get("bits_per_value"),
                "step_ms": sum(ms) / len(ms),
                "time_s": steps * sum(ms) / len(ms) / 1e3,
                "held_out_loss": row["held_out_loss"],
                "vs_plain": row["vs_plain"],
            }
        )
    on = frontier(rows)
    for r in rows:
        r["on_frontier"] = r["compressor"] in on
    return {"rows": rows, "curves": curves, "frontier": on, "left_out": missing}


def table(result: dict) -> str:
    lines = [
        "| compressor | seeds | bits a value | step ms | time to train s | held-out loss "
        "| vs plain | frontier |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in sorted(result["rows"], key=lambda r: r["time_s"]):
        bits = "-" if r["bits_per_value"] is None else f"{r['bits_per_value']:.2f}"
        vs = "-" if r["vs_plain"] is None else f"{100 * r['vs_plain']:+.2f}%"
        lines.append(
            f"| {r['what']} | {r['seeds']} | {bits} | {r['step_ms']:.1f} | {r['time_s']:.0f} | "
            f"{r['held_out_loss']:.4f} | {vs} | {'*' if r['on_frontier'] else ''} |"
        )
    if result["left_out"]:
        lines.append(f"\nno step time for: {', '.join(result['left_out'])} (left out)")
    return "\n".join(lines)


def plot(result: dict, path: Path, source: str) -> None:
    """Left: held-out loss against seconds, a line a run (a colour a compressor, a style a
    seed). Right: each compressor's final loss against its time to train, the frontier
    joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["compressor"] for r in result["rows"]]
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, (curves, final) = plt.subplots(1, 2, figsize=(14, 5.5))
    for c in result["curves"]:
        xs, ys = zip(*c["points"], strict=True)
        curves.plot(
            xs,
            ys,
            color=colours[c["compressor"]],
            linestyle=("-", "--", ":", "-.")[c["seed"] % 4],
            linewidth=1.1,
            label=f"{c['what']} (seed {c['seed']})",
        )
    curves.set(xlabel="time to train, s", ylabel="held-out loss", title="held-out loss by time")
    for r in result["rows"]:
        final.scatter(r["time_s"], r["held_out_loss"], color=colours[r["compressor"]], zorder=3)
        final.annotate(
            r["what"],
            (r["time_s"], r["held_out_loss"]),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    best = sorted((r for r in result["rows"] if r["on_frontier"]), key=lambda r: r["time_s"])
    final.step(
        [r["time_s"] for r in best],
        [r["held_out_loss"] for r in best],
        where="post",
        color="black",
        linewidth=0.8,
        label="frontier",
    )
    final.set(xlabel="time to train, s", ylabel="final held-out loss", title="final loss by time")
    for ax in (curves, final):
        ax.grid(alpha=0.3)
    curves.legend(fontsize=6)
    final.legend(fontsize=7)
    fig.suptitle(f"step times: {source}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("folder", type=Path, help="a folder of convergence.py's run_*.json")
    p.add_argument(
        "--step-times",
        type=Path,
        metavar="FOLDER",
        help="each compressor's step from the runs in FOLDER or below it (default: each run's own)",
    )
    p.add_argument("--out", type=Path, help="where the JSON and plot go (default: the folder)")
    p.add_argument("--no-plot", action="store_true", help="the table and JSON only")
    args = p.parse_args(argv)
    for folder, runs in ((args.folder, "glob"), (args.step_times, "rglob")):
        if folder is not None and not list(getattr(folder, runs)("run_*.json")):
            p.error(f"{folder}: no run_*.json (examples/convergence.py --out writes them)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    times = None if args.step_times is None else step_times(args.step_times)
    source = "each run's own" if times is None else f"the runs in {args.step_times}"
    result = time_to_train(summarize(args.folder), times)
    result["step_times"] = source
    print(table(result))
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_by_time.json").write_text(json.dumps(result, indent=1))
    if args.no_plot:
        return result
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot, the JSON only")
        return result
    plot(result, out / "loss_by_time.png", source)
    print(f"-> {out / 'loss_by_time.png'}, {out / 'loss_by_time.json'}")
    return result


if __name__ == "__main__":
    main()
