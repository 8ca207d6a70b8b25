#!/usr/bin/env bash
# The convergence study (BENCHMARKS.md, "Convergence"): examples/convergence.py, 4 ranks sharing
# one GPU over gloo, in LANES lanes (default: one a GPU; lane i on GPU i mod the GPUs), each
# running its share of the runs. Runs are taken in RUNS' order ("name", or "name@K" for seed K
# of plain and cgx4; most wanted first), dealt round-robin to the lanes; each lands in DIR as it
# ends, and a later call skips it, so a study longer than one call (TIMEOUT seconds, default
# 540) runs over several: keep DIR between them.
# Usage (repo root): DIR=bench/results/convergence bash bench/convergence_study.sh
# (ARGS: the model and schedule flags; every call and lane must pass the same ones).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
DIR=${DIR:?the runs\' folder}
ARGS=${ARGS:---dim 512 --layers 6 --heads 8 --context 256 --batch-size 16 --steps 2000}
RUNS=${RUNS:-plain cgx4 cgx2 cgx8 cgx4-ef fsdp4 plain@1 cgx4@1 plain@2 cgx4@2 cgx2-ef sd8 sd4 thc
  qsgd exp powersgd lgreco}
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
LANES=${LANES:-$NGPU}
# shellcheck disable=SC2206  # RUNS: one spec a word, over lines
specs=($RUNS)
mkdir -p "$DIR"
deadline=$(($(date +%s) + ${TIMEOUT:-540}))
lane() {  # lane $1 on GPU $1 mod NGPU: specs $1, $1 + LANES, ...
  local i spec name seed left
  for ((i = $1; i < ${#specs[@]}; i += LANES)); do
    spec=${specs[i]}; name=${spec%%@*}; seed=0
    [[ $spec == *@* ]] && seed=${spec#*@}
    [ -e "$DIR/run_${name}_seed$seed.json" ] && continue  # finished: start nothing
    left=$((deadline - $(date +%s)))
    ((left > 30)) || return 0
    # shellcheck disable=SC2086  # ARGS: one flag a word
    CUDA_VISIBLE_DEVICES=$(($1 % NGPU)) timeout "$left" torchrun --nproc-per-node 4 \
      --master-port $((29600 + $1)) examples/convergence.py --device cuda --backend gloo \
      $ARGS --compressors "$name" --seeds $((seed + 1)) --only-seed "$seed" --out "$DIR" \
      >/dev/null \
      2>>"$DIR/lane$1.err" || echo "lane $1: $spec failed or was cut off (see $DIR/lane$1.err)"
  done
}
for ((g = 0; g < LANES; g++)); do lane "$g" & done
wait
echo "finished runs in $DIR: $(find "$DIR" -name 'run_*.json' | wc -l)"
