#!/usr/bin/env bash
# Host time a call, one cgx2 tree against another on the same machine in one call: this tree's
# bench/host_cost.py (the codec ops) and bench/allreduce_host_cost.py (2 processes), run ROUNDS
# times with the trees alternating, then bench/host_cost_ab.py's tables: each call's host time
# over the first tree's in the same round, the median over rounds, beside each tree's own µs and
# ratio to its run's clone / plain allreduce; and their JSON in OUT.
# Usage (repo root): TREES="old=/tmp/old new=$PWD" bash bench/host_cost_ab.sh
#   TREES: NAME=PATH words, each PATH a cgx2 checkout (its cgx2._C built, or left to build here);
#     the first is the baseline.
#   ROUNDS (3); OUT (bench/results/host_cost_ab_<date>): the runs' JSON, by tree and round;
#   HOST_COST_ARGS: more arguments for both scripts (e.g. "--numel 1024 --calls 500").
#   ALLREDUCE (auto): the allreduce's device: cuda (2 GPUs, NCCL), cpu (gloo), auto (cuda where
#     there are 2 GPUs, else cpu) or none.
set -uo pipefail
export PYTHONUNBUFFERED=1
TREES=${TREES:?NAME=PATH words, e.g. TREES="old=/tmp/old new=$PWD"}
ROUNDS=${ROUNDS:-3}
ALLREDUCE=${ALLREDUCE:-auto}
COMMAND="TREES=\"$TREES\" ROUNDS=$ROUNDS ALLREDUCE=$ALLREDUCE"
COMMAND+="${HOST_COST_ARGS:+ HOST_COST_ARGS=\"$HOST_COST_ARGS\"} bash bench/host_cost_ab.sh"
OUT=${OUT:-bench/results/host_cost_ab_$(date -u +%Y%m%dT%H%M%S)}
if [ "$ALLREDUCE" = auto ]; then
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$NGPU" -ge 2 ]; then ALLREDUCE=cuda; else ALLREDUCE=cpu; fi
fi
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
    if [ "$ALLREDUCE" != none ]; then
      # shellcheck disable=SC2086
      PYTHONPATH=$path torchrun --standalone --nproc-per-node 2 bench/allreduce_host_cost.py \
        --device "$ALLREDUCE" --label "$name" ${HOST_COST_ARGS:-} --out "$dir" \
        >"$dir/allreduce_host_cost.out" 2>&1 || tail -n 5 "$dir/allreduce_host_cost.out"
    fi
  done
done
# shellcheck disable=SC2086  # TREES: one tree a word
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 bench/host_cost_ab.py "$OUT" $TREES \
  --command "$COMMAND"
