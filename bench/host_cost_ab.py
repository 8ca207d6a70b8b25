"""bench/host_cost_ab.sh's tables: each call's host time in one cgx2 tree against another's,
from the runs the script made, timed alternately on one machine.

Usage: python bench/host_cost_ab.py OUT NAME=PATH... [--command TEXT]. OUT holds the runs as
OUT/<name>/<round>/{host_cost,allreduce_host_cost}_*.json. For each call, a tree's host µs over
the first tree's in the same round (the two runs adjacent in time), the median over rounds: the
machine's speed drifts from round to round, and a ratio of runs a minute apart cancels what
moved both. Beside it each tree's own median µs and its median ratio to its own run's clone
(the codec ops) or plain allreduce (the allreduce), which also moves with that one call's noise.
Prints the tables (markdown) and writes host_cost_ab_<device>_..._<date>.json in OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from cgx2.bench import report

# Each run's table, and the ratio it holds to a call of its own run.
KINDS = {"host_cost": "x_clone", "allreduce_host_cost": "x_plain"}


def _commit(path: str) -> str | None:
    """The tree's git commit, ``+`` where its files differ from it; None where it is no
    checkout (a ``git archive``'s files)."""
    git = ["git", "-C", path]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _runs(out: Path, tree: str, kind: str) -> dict[int, dict[str, Any]]:
    """``kind``'s run of ``tree`` in each round that made one, by round."""
    runs = {}
    for path in (out / tree).glob(f"*/{kind}_*.json"):
        if path.parent.name.isdigit():
            runs[int(path.parent.name)] = json.loads(path.read_text())
    return runs


def compare(out: Path, trees: list[str], kind: str) -> list[dict[str, Any]]:
    """A row a call of ``kind``'s runs: each tree's median host µs (``<tree>_us``) and ratio
    to its own run's clone or plain allreduce (``<tree>_<ratio>``), over the rounds; for each
    tree after the first, ``<tree>/<first>``: the median over rounds of its host µs over the
    first tree's in the same round, and ``<tree>/<first>_rounds``, each round's."""
    ratio = KINDS[kind]
    runs = {tree: _runs(out, tree, kind) for tree in trees}
    us: dict[tuple[str, str], dict[int, float]] = {}  # (call, tree) -> round -> µs
    ratios: dict[tuple[str, str], list[float]] = {}
    for tree, by_round in runs.items():
        for r, run in sorted(by_round.items()):
            for row in run["rows"]:
                us.setdefault((row["call"], tree), {})[r] = row["host_us"]
                ratios.setdefault((row["call"], tree), []).append(row[ratio])
    base = trees[0]
    rows = []
    for call in dict.fromkeys(call for call, _ in us):
        row: dict[str, Any] = {"call": call}
        for tree in trees:
            got = us.get((call, tree), {})
            row[f"{tree}_us"] = statistics.median(got.values()) if got else None
            row[f"{tree}_{ratio}"] = statistics.median(ratios[call, tree]) if got else None
        for tree in trees[1:]:
            mine, theirs = us.get((call, tree), {}), us.get((call, base), {})
            paired = [mine[r] / theirs[r] for r in sorted(mine) if r in theirs]
            row[f"{tree}/{base}"] = statistics.median(paired) if paired else None
            row[f"{tree}/{base}_rounds"] = paired
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], trees: list[str], ratio: str) -> str:
    """The rows as a markdown table: each later tree's ratio to the first (median over
    rounds, then each round's in brackets), each tree's µs, then each tree's ``ratio``."""
    base = trees[0]
    head = ["call"] + [f"{t}/{base}" for t in trees[1:]] + [f"{t} µs" for t in trees]
    head += [f"{t} {ratio}" for t in trees]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for row in rows:
        cells = [row["call"]]
        for tree in trees[1:]:
            each = ", ".join(f"{r:.3f}" for r in row[f"{tree}/{base}_rounds"])
            cells.append(f"{num(row[f'{tree}/{base}'], '.3f')} [{each}]")
        cells += [num(row[f"{t}_us"], ".1f") for t in trees]
        cells += [num(row[f"{t}_{ratio}"], ".2f") for t in trees]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("out", type=Path, help="the runs' folder (host_cost_ab.sh's OUT)")
    p.add_argument("trees", nargs="+", metavar="NAME=PATH", help="the first is the baseline")
    p.add_argument("--command", default="", help="the A/B's command, for the JSON")
    args = p.parse_args()
    trees = [word.split("=", 1)[0] for word in args.trees]
    base = trees[0]
    tables, env = {}, None
    for kind, ratio in KINDS.items():
        rows = compare(args.out, trees, kind)
        if not rows:
            continue
        tables[kind] = rows
        runs = _runs(args.out, base, kind) or _runs(args.out, trees[-1], kind)
        first = runs[min(runs)]["env"]
        env = env or dict(first)  # where and with what (the codec ops' run first)
        rounds = max(len(row[f"{t}/{base}_rounds"]) for row in rows for t in trees[1:])
        print(
            f"\n{kind} on {first['device']}, {first['world_size']} process(es): host µs a call, "
            f"each tree's over {base}'s in the same round, median of {rounds} round(s) "
            f"[each round's]; then each tree's median µs and {ratio} (its own run's "
            f"{'clone' if ratio == 'x_clone' else 'plain allreduce'})"
        )
        print(markdown(rows, trees, ratio))
    if env is None:
        raise SystemExit(f"host_cost_ab: no runs under {args.out}")
    env.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=args.command,
        trees={
            name: {"path": path, "commit": _commit(path)}
            for name, path in (word.split("=", 1) for word in args.trees)
        },
    )
    for name in ("numel", "bits", "calls", "rounds", "tree", "cgx2_file"):
        env.pop(name, None)  # the runs' own, in their files
    path = report.write_json("host_cost_ab", {"env": env, "tables": tables}, args.out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
