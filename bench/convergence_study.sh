#!/usr/bin/env bash
# The convergence study (BENCHMARKS.md, "Convergence"): examples/convergence.py, 4 ranks sharing
# one GPU over gloo, in LANES lanes (default: one a GPU; lane i on GPU i mod the GPUs), each
# running its share of the runs. Runs are taken in RUNS' order ("name", or "name@K" for seed K
# of any compressor; most wanted first; default: the committed study's, then LOW_BITS); the
# unfinished ones are dealt round-robin to the lanes; each lands in DIR as it ends, and a later
# call skips it (the committed runs start nothing), so a study longer than one call
# (TIMEOUT seconds, default 540) runs over several: keep DIR between them. A run still going at
# the deadline stops at a held-out evaluation and leaves a checkpoint in DIR/checkpoints, from
# which the next call resumes it (convergence.py --time-limit). A fresh run is not started with
# less than RUN_S seconds left (default 400 with two lanes on a GPU, 230 with one): a lane that
# stops early ends the call sooner (device time saved).
# Usage (repo root): DIR=bench/results/convergence bash bench/convergence_study.sh
# (ARGS: the model and schedule flags; every call and lane must pass the same ones).
# LOW_BITS: issue 44's compressors (2-4 bits rotated, with error feedback, both; names as in
# examples/convergence.py), most wanted first; more seeds of the best: RUNS="cgx2-rot-ef@1
# cgx2-rot-ef@2".
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
DIR=${DIR:?the runs\' folder}
ARGS=${ARGS:---dim 512 --layers 6 --heads 8 --context 256 --batch-size 16 --steps 2000}
LOW_BITS=${LOW_BITS:-cgx2-rot-ef cgx2-rot cgx4-rot cgx3-rot-ef cgx3-rot cgx3 cgx3-ef}
RUNS=${RUNS:-plain cgx4 cgx2 cgx8 cgx4-ef fsdp4 plain@1 cgx4@1 plain@2 cgx4@2 cgx2-ef sd8 sd4 thc
  qsgd exp powersgd lgreco $LOW_BITS}
NGPU=${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
LANES=${LANES:-$NGPU}
RUN_S=${RUN_S:-$((LANES > NGPU ? 400 : 230))}
mkdir -p "$DIR"
specs=()
# shellcheck disable=SC2086  # RUNS: one spec a word, over lines
for spec in $RUNS; do
  name=${spec%%@*}; seed=0
  [[ $spec == *@* ]] && seed=${spec#*@}
  [ -e "$DIR/run_${name}_seed$seed.json" ] || specs+=("$spec")  # finished: start nothing
done
deadline=$(($(date +%s) + ${TIMEOUT:-540}))
lane() {  # lane $1 on GPU $1 mod NGPU: unfinished specs $1, $1 + LANES, ...
  local i spec name seed left
  for ((i = $1; i < ${#specs[@]}; i += LANES)); do
    spec=${specs[i]}; name=${spec%%@*}; seed=0
    [[ $spec == *@* ]] && seed=${spec#*@}
    left=$((deadline - $(date +%s)))
    if ((left < RUN_S)) && [ ! -e "$DIR/checkpoints/${name}_seed${seed}_rank0.pt" ]; then
      echo "lane $1: $spec not started (${left} s left, a run takes ~$RUN_S)"
      return 0
    fi
    ((left > 60)) || return 0
    # shellcheck disable=SC2086  # ARGS: one flag a word
    CUDA_VISIBLE_DEVICES=$(($1 % NGPU)) timeout "$left" torchrun --nproc-per-node 4 \
      --master-port $((29600 + $1)) examples/convergence.py --device cuda --backend gloo \
      $ARGS --compressors "$name" --seeds $((seed + 1)) --only-seed "$seed" --out "$DIR" \
      --time-limit $((left - 45)) \
      >/dev/null \
      2>>"$DIR/lane$1.err" || echo "lane $1: $spec failed or was cut off (see $DIR/lane$1.err)"
  done
}
for ((g = 0; g < LANES; g++)); do lane "$g" & done
wait
echo "finished runs in $DIR: $(find "$DIR" -name 'run_*.json' | wc -l)"
