#!/usr/bin/env bash
# One device call: check the kernels and the allreduce on the GPUs, time the kernels, and
# benchmark the allreduce in DESIGN.md's three regimes (nvlink, shm, socket) when there are
# several GPUs. Raw results land in bench/results/ (and as one tarball in $OUT).
# Usage (repo root): bash bench/device_run.sh [gpu_check args]; BENCH_ARGS for cgx2.bench.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
LOGS=$OUT/logs; mkdir -p "$LOGS"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
if [ -z "${SKIP_KERNELS:-}" ]; then
  python3 bench/gpu_check.py "$@" 2>"$LOGS/gpu_check.err" | tail -n 45 || status=1
fi
if [ "$NGPU" -ge 2 ]; then
  torchrun --nproc-per-node "$NGPU" bench/gpu_allreduce_check.py 2>"$LOGS/ar_check.err" \
    | tail -n 30 || status=1
  for regime in nvlink shm socket; do
    case $regime in
      nvlink) vars=() ;;
      shm) vars=(NCCL_P2P_DISABLE=1) ;;
      socket) vars=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
    esac
    echo "== allreduce, $NGPU GPUs, regime $regime"
    env "${vars[@]}" torchrun --nproc-per-node "$NGPU" -m cgx2.bench ${BENCH_ARGS:-} \
      2>>"$LOGS/bench_$regime.err" || status=1
  done
fi
tar czf "$OUT/results.tgz" bench/results/*.json 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $status
