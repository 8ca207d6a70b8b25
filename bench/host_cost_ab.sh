#!/usr/bin/env bash
# Host time a call, one cgx2 tree against another on the same machine in one call: this tree's
# bench/host_cost.py (the codec ops) and, with 2 GPUs, bench/allreduce_host_cost.py, run ROUNDS
# times with the trees alternating, then a table of each call's ratio to its own run's clone
# (codec ops) or NCCL's allreduce (the allreduce), the median over rounds, per tree.
# Usage (repo root): TREES="old=/tmp/old new=$PWD" bash bench/host_cost_ab.sh
#   TREES: NAME=PATH words, each PATH a cgx2 checkout (its cgx2._C built, or left to build here).
#   ROUNDS (3); OUT (bench/results/host_cost_ab_<date>): the runs' JSON, by tree and round;
#   HOST_COST_ARGS: more arguments for both scripts (e.g. "--numel 1024 --calls 500").
set -uo pipefail
export PYTHONUNBUFFERED=1
TREES=${TREES:?NAME=PATH words, e.g. TREES="old=/tmp/old new=$PWD"}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-bench/results/host_cost_ab_$(date -u +%Y%m%dT%H%M%S)}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the builds below run in each tree
for tree in $TREES; do  # cgx2._C of each tree, built in place where missing
  path=${tree#*=}
  ls "$path"/cgx2/_C*.so >/dev/null 2>&1 \
    || (cd "$path" && python3 setup.py -q build_ext --inplace >"$OUT/build_${tree%%=*}.log" 2>&1) \
    || echo "host_cost_ab: ${tree%%=*}'s cgx2._C did not build (see its log)" >&2
done
for ((round = 1; round <= ROUNDS; round++)); do
  for tree in $TREES; do
    name=${tree%%=*}; path=${tree#*=}; dir=$OUT/$name/$round
    mkdir -p "$dir"
    echo "== round $round/$ROUNDS, $name ($path)"
    # shellcheck disable=SC2086  # HOST_COST_ARGS: one argument a word
    PYTHONPATH=$path python3 bench/host_cost.py ${HOST_COST_ARGS:-} --out "$dir" \
      >"$dir/host_cost.out" 2>&1 \
      || tail -n 5 "$dir/host_cost.out"
    if [ "$NGPU" -ge 2 ]; then
      # shellcheck disable=SC2086
      PYTHONPATH=$path torchrun --nproc-per-node 2 bench/allreduce_host_cost.py \
        ${HOST_COST_ARGS:-} --out "$dir" \
        >"$dir/allreduce_host_cost.out" 2>&1 || tail -n 5 "$dir/allreduce_host_cost.out"
    fi
  done
done
python3 - "$OUT" $TREES <<'EOF'
import json, statistics, sys
from pathlib import Path

out, trees = Path(sys.argv[1]), [t.split("=", 1)[0] for t in sys.argv[2:]]
tables = {"host_cost": "x_clone", "allreduce_host_cost": "x_plain"}
for kind, ratio in tables.items():
    got = {}  # (call, tree) -> ratios over rounds
    for tree in trees:
        for path in sorted((out / tree).glob(f"*/{kind}_*.json")):
            for row in json.loads(path.read_text())["rows"]:
                got.setdefault((row["call"], tree), []).append(row[ratio])
    if not got:
        continue
    calls = list(dict.fromkeys(call for call, _ in got))
    print(f"\n{kind}: {ratio} (median of {max(len(v) for v in got.values())} rounds)")
    print("| call | " + " | ".join(trees) + " |")
    print("| --- |" + " ---: |" * len(trees))
    for call in calls:
        cells = [got.get((call, t)) for t in trees]
        text = [f"{statistics.median(c):.2f}" if c else "-" for c in cells]
        print(f"| {call} | " + " | ".join(text) + " |")
EOF
