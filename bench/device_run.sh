#!/usr/bin/env bash
# One device call: check the kernels (max-min and exponential; max-min past 2**31 values too),
# CUDA tensors on gloo (two ranks on GPU 0: the allreduce, the DDP hooks' worker thread),
# the allreduce, the cgx backend (its hierarchical path too) and FSDP2 on the GPUs, time the
# kernels, and, with several GPUs, benchmark the allreduce and a DDP training step in
# DESIGN.md's three regimes (nvlink, shm, socket) and an FSDP2 step (socket). Raw results land
# in bench/results/ (and as one tarball in $OUT).
# Usage (repo root): bash bench/device_run.sh [gpu_check args]; BENCH_ARGS for cgx2.bench,
# TRAIN_ARGS for examples/train_ddp.py, TRAIN_REGIMES ("socket shm nvlink") and TRAIN_RUNS
# ("32 hook,4 hook,4 backend"; "4 hook graphs" sets CGX2_CUDA_GRAPHS=1, "4 hook eager" 0) to pick runs,
# FSDP_ARGS, FSDP_REGIMES ("socket") and FSDP_RUNS ("32,4,4 8": gradient bits, then parameter
# bits; "32 - hsdp,4 8 hsdp" adds HSDP's 2 replicas) for examples/train_fsdp.py; SKIP_KERNELS, SKIP_CHECKS,
# SKIP_BENCH, SKIP_TRAIN, SKIP_FSDP_TRAIN=1 leave a stage out (a call is limited to 10 minutes
# on our machines). Tuning stages, off unless asked: AB_VERSIONS="name=path ..." times those
# copies of maxmin_triton.py against the tree's (bench/kernel_ab.py); PROFILE_KERNELS="dse:fp32:4
# ..." profiles those kernels with Nsight Compute (bench/kernel_profile.py: issue rate, stalls,
# instructions per value); TIMELINE_REGIMES="shm ..." prints a 256 MiB allreduce's GPU timeline;
# GLOO_DDP_RATES="10gbit 1gbit" times DDP steps of two hosts sharing GPU 0 over gloo, and
# LINK_RATES="1gbit 10gbit 25gbit" the allreduce between them (LINK_ARGS for cgx2.bench; carry
# .iproute, Debian's iproute2 .debs: bench/gloo_cuda_ddp.sh's header says how to fetch them).
# NCCL_HOST_RATES="10gbit 25gbit" runs GPU servers over Ethernet (bench/nccl_hosts.sh, its header
# says what and how long: about 8 minutes for 2 rates on 2 GPUs, so SKIP_* the rest): netlab hosts
# of GPUs (2: 2 x 1; 4: 2 x 2 and 4 x 1), NCCL across them over the shaped link, the allreduce,
# DDP steps of the 134M MLP per hook, train_ddp.py, train_fsdp.py and HSDP; its folder comes back
# as nccl_hosts.tgz (NCCL_HOST_RUNS, NCCL_HOSTS_BUDGET_S (420) pass through; DRY_RUN=1
# NCCL_HOSTS_NGPU=4 echoes its commands on a machine without GPUs).
# CPU_LINK_RATES="1gbit 10gbit" runs the CPU hosts on this machine's own cores (no GPU): the
# allreduce of two hosts and of two hosts of two ranks (the node mesh beside the flat allreduce;
# CPU_LINK_ARGS for cgx2.bench), and DDP training across them (bench/train_links.sh).
# CONVERGENCE=1 runs the convergence study (bench/convergence_study.sh; CONVERGENCE_TIMEOUT 540 s,
# CONVERGENCE_LANES; its RUNS and RUN_S pass through), resuming from bench/results/convergence/
# (returned as convergence.tgz in $OUT; on a machine kept warm, /tmp/convergence carries the
# runs between calls too, and the checkpoints of runs stopped at the deadline, which the next
# call resumes); ERROR_BY_LAYER=1 runs examples/error_by_layer.py on the study's model.
# SKIP_COMPAT=1 leaves out the CPU tests of DTensor, FSDP2 and the cgx backend under this image's
# torch.
# SKIP_HOST_COST=1 leaves out bench/host_cost.py (the codec ops' host time, eager and compiled),
# bench/allreduce_host_cost.py (2 GPUs: the allreduce's, profiled) and bench/agreement_cost.py
# (two ranks on GPU 0 over gloo; with several GPUs, over NCCL too).
# SKIP_TRANSPORTS=1 leaves out bench/transports.py (two ranks on GPU 0, CUDA and CPU tensors:
# shared memory against gloo; TRANSPORT_ARGS for it). With several GPUs, cgx2.bench's table
# has shared memory's columns (CGX2_TRANSPORT=shm for CUDA tensors on NCCL) beside NCCL's.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
LOGS=$OUT/logs; mkdir -p "$LOGS"
# cgx2._C (csrc/): built in place with the image's pybind11 and setuptools (nothing is fetched).
python3 setup.py -q build_ext --inplace >"$LOGS/build_ext.log" 2>&1 \
  || { echo "cgx2._C did not build:"; tail -n 20 "$LOGS/build_ext.log"; status_build=1; }
python3 -c "import cgx2._C" || echo "FAIL cgx2._C does not import"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=${status_build:-0}
if [ -z "${SKIP_KERNELS:-}" ]; then
  python3 bench/gpu_check.py "$@" 2>"$LOGS/gpu_check.err" | tail -n 45 || status=1
  python3 bench/gpu_exponential_check.py 2>"$LOGS/exp_check.err" | tail -n 12 || status=1
  python3 bench/gpu_large_check.py 2>"$LOGS/large_check.err" | tail -n 6 || status=1
fi
save() {  # after every stage, so that a run cut short still brings back what it measured
  tar czf "$OUT/results.tgz" bench/results/*.json bench/results/gloo_ddp_*/ 2>/dev/null
}
if [ -n "${AB_VERSIONS:-}" ]; then
  # shellcheck disable=SC2086  # one NAME=PATH word each
  python3 bench/kernel_ab.py $AB_VERSIONS 2>"$LOGS/kernel_ab.err" | tail -n 60 || status=1
  save
fi
if [ -n "${PROFILE_KERNELS:-}" ]; then
  # shellcheck disable=SC2086  # one KERNEL:DTYPE:BITS word each
  python3 bench/kernel_profile.py $PROFILE_KERNELS 2>"$LOGS/kernel_profile.err" | tail -n 30 \
    || status=1
  save
fi
regime_vars() {
  case $1 in
    nvlink) vars=() ;;
    shm) vars=(NCCL_P2P_DISABLE=1) ;;
    socket) vars=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
  esac
}
if [ -z "${SKIP_CHECKS:-}" ]; then  # the codec op inside torch.compile's CUDA graphs
  python3 -m pytest -q -p no:cacheprovider tests/ops/test_ops.py -k "reduce_overhead" 2>&1 \
    | tail -n 3 || status=1
fi
if [ -z "${SKIP_CHECKS:-}" ]; then  # two ranks on GPU 0 over gloo: CUDA tensors without NCCL
  torchrun --nproc-per-node 2 bench/gpu_gloo_check.py 2>"$LOGS/gloo_check.err" | tail -n 12 \
    || status=1
fi
if [ -z "${SKIP_CHECKS:-}" ]; then  # cgx2's NCCL transport: on one GPU, its plumbing only
  torchrun --nproc-per-node "$NGPU" bench/gpu_nccl_transport_check.py \
    2>"$LOGS/nccl_transport_check.err" | tail -n 10 || status=1
fi
if [ -z "${SKIP_TRANSPORTS:-}" ]; then  # two ranks on GPU 0: shared memory against gloo
  torchrun --nproc-per-node 2 bench/transports.py --device cuda --out bench/results \
    ${TRANSPORT_ARGS:-} 2>"$LOGS/transports_cuda.err" | tail -n 14 || status=1
  torchrun --nproc-per-node 2 bench/transports.py --device cpu --out bench/results \
    ${TRANSPORT_ARGS:-} 2>"$LOGS/transports_cpu.err" | tail -n 14 || status=1
  save
fi
if [ -z "${SKIP_COMPAT:-}" ]; then  # this image's torch (2.11): CPU tests of what leans on torch
  CUDA_VISIBLE_DEVICES= timeout 500 python3 -m pytest -q -p no:cacheprovider tests/dtensor \
    tests/ops/test_reduce_scatter_op.py tests/fsdp/test_fsdp_params.py \
    tests/collectives/test_agreement.py tests/backend 2>&1 | tail -n 15 || status=1
fi
if [ -z "${SKIP_HOST_COST:-}" ]; then  # host time of the codec ops; the agreement check's cost
  python3 bench/host_cost.py --out bench/results 2>"$LOGS/host_cost.err" | tail -n 16 || status=1
  torchrun --nproc-per-node 2 bench/agreement_cost.py --device cuda --backend gloo \
    --sizes 64K,1M,16M,64M --out bench/results 2>"$LOGS/agreement_cost.err" | tail -n 14 \
    || status=1
  if [ "$NGPU" -ge 2 ]; then  # the allreduce's host time a call, and where it goes
    torchrun --nproc-per-node 2 bench/allreduce_host_cost.py --profile 300 --out bench/results \
      >"$LOGS/allreduce_host_cost.out" 2>"$LOGS/allreduce_host_cost.err" || status=1
    head -n 60 "$LOGS/allreduce_host_cost.out"  # (a pipe into head cut rank 0 off before its JSON)
  fi
  if [ "$NGPU" -ge 2 ]; then  # over NCCL, shm regime: the deferred check as users get it
    env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node "$NGPU" bench/agreement_cost.py \
      --device cuda --sizes 64K,1M,16M,64M --out bench/results \
      2>"$LOGS/agreement_cost_nccl.err" | tail -n 14 || status=1
  fi
  save
fi
if [ "$NGPU" -ge 2 ] && [ -z "${SKIP_CHECKS:-}" ]; then
  torchrun --nproc-per-node "$NGPU" bench/gpu_allreduce_check.py 2>"$LOGS/ar_check.err" \
    | tail -n 30 || status=1
  torchrun --nproc-per-node "$NGPU" bench/gpu_backend_check.py 2>"$LOGS/backend_check.err" \
    | tail -n 30 || status=1
  torchrun --nproc-per-node "$NGPU" bench/gpu_fsdp_check.py 2>"$LOGS/fsdp_check.err" \
    | tail -n 30 || status=1
  timeout 300 torchrun --nproc-per-node 2 bench/gpu_fault_check.py 2>"$LOGS/fault_check.err" \
    | tail -n 3 || status=1
fi
if [ "$NGPU" -ge 2 ] && [ -z "${SKIP_BENCH:-}" ]; then
  for regime in nvlink shm socket; do
    regime_vars $regime
    echo "== allreduce, $NGPU GPUs, regime $regime"
    env "${vars[@]}" torchrun --nproc-per-node "$NGPU" -m cgx2.bench --out bench/results \
      ${BENCH_ARGS:-} 2>>"$LOGS/bench_$regime.err" || status=1
    save
  done
fi
if [ "$NGPU" -ge 2 ]; then
  for regime in ${TIMELINE_REGIMES:-}; do
    regime_vars $regime
    echo "== timeline, $NGPU GPUs, regime $regime"
    env "${vars[@]}" torchrun --nproc-per-node "$NGPU" bench/allreduce_timeline.py --mib 256 \
      >"$LOGS/timeline_$regime.out" 2>>"$LOGS/timeline_$regime.err" || status=1
    head -n 40 "$LOGS/timeline_$regime.out"
  done
fi
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
if [ "$NGPU" -ge 2 ] && [ -z "${SKIP_TRAIN:-}" ]; then
  TRAIN_ARGS=${TRAIN_ARGS:---steps 40 --dim 1024 --layers 10 --heads 16 --context 256 --batch-size 8}
  IFS=, read -ra RUNS <<< "${TRAIN_RUNS:-32 hook,4 hook,4 backend}"
  for regime in ${TRAIN_REGIMES:-socket shm nvlink}; do
    regime_vars $regime
    for run in "${RUNS[@]}"; do
      set -- $run  # bits, mode and, optionally, "graphs" or "eager" (CGX2_CUDA_GRAPHS=1 or 0)
      graphs=auto; tag=""
      if [ "${3:-}" = graphs ]; then graphs=1; tag=_graphs; fi
      if [ "${3:-}" = eager ]; then graphs=0; tag=_eager; fi
      echo "== DDP step, $NGPU GPUs, regime $regime, $1 bits, $2${3:+, $3}"
      env "${vars[@]}" CGX2_CUDA_GRAPHS=$graphs torchrun --nproc-per-node "$NGPU" \
        examples/train_ddp.py --bits "$1" --mode "$2" $TRAIN_ARGS --log-every 1000 \
        --json "bench/results/train_ddp_${GPU}_${regime}_w${NGPU}_b$1_$2${tag}_$(date -u +%Y%m%dT%H%M).json" \
        2>>"$LOGS/train_$regime.err" | tail -n 1 || status=1
      save
    done
  done
fi
if [ "$NGPU" -ge 2 ] && [ -z "${SKIP_FSDP_TRAIN:-}" ]; then
  for regime in ${FSDP_REGIMES:-socket}; do
    regime_vars $regime
    IFS=, read -ra RUNS <<< "${FSDP_RUNS:-32,4,4 8}"
    for run in "${RUNS[@]}"; do
      set -- $run  # gradient bits, optionally parameter bits (the all-gather), then "hsdp"
      pbits=${2:-}; [ "$pbits" = - ] && pbits=""
      hsdp=""; [ "${3:-}" = hsdp ] && hsdp="--replicas 2"
      tag=b$1${pbits:+_p$pbits}${3:+_$3}
      echo "== FSDP2 step, $NGPU GPUs, regime $regime, $1 bits${pbits:+, $pbits-bit parameters}${3:+, $3}"
      env "${vars[@]}" torchrun --nproc-per-node "$NGPU" examples/train_fsdp.py --bits "$1" \
        ${pbits:+--param-bits "$pbits"} $hsdp ${FSDP_ARGS:-} --log-every 1000 \
        --json "bench/results/train_fsdp_${GPU}_${regime}_w${NGPU}_${tag}_$(date -u +%Y%m%dT%H%M).json" \
        2>>"$LOGS/fsdp_$regime.err" | tail -n 1 || status=1
      save
    done
  done
fi
if [ -n "${CONVERGENCE:-}" ]; then  # bench/convergence_study.sh: a lane a GPU
  # Resumed from the runs committed in bench/results/convergence/; every finished run comes back
  # in $OUT/convergence.tgz (unpack it there and commit before the next call).
  mkdir -p /tmp/convergence && cp bench/results/convergence/run_*.json /tmp/convergence/ 2>/dev/null
  DIR=/tmp/convergence TIMEOUT=${CONVERGENCE_TIMEOUT:-540} LANES=${CONVERGENCE_LANES:-} \
    bash bench/convergence_study.sh
  tar czf "$OUT/convergence.tgz" -C /tmp --exclude=checkpoints convergence  # (GBs: they stay)
fi
if [ -n "${ERROR_BY_LAYER:-}" ]; then  # where the study's quantization error lies, layer by layer
  python3 examples/error_by_layer.py --device cuda --dim 512 --layers 6 --heads 8 --steps 2000 \
    --at 500,2000 --out bench/results 2>"$LOGS/error_by_layer.err" | tail -n 70 || status=1
  save
fi
if [ -n "${GLOO_DDP_RATES:-}${LINK_RATES:-}${CPU_LINK_RATES:-}${NCCL_HOST_RATES:-}" ]; then  # carry .iproute: Debian's iproute2 .debs
  mkdir -p /tmp/iproute && for deb in .iproute/*.deb; do dpkg -x "$deb" /tmp/iproute; done
fi
if [ -n "${NCCL_HOST_RATES:-}" ]; then
  # GPU servers over Ethernet (BENCHMARKS.md's headline): netlab hosts of GPUs, NCCL across them.
  echo "== GPU hosts over shaped links, NCCL, rates $NCCL_HOST_RATES"
  tar_to=""; [ "$OUT" != bench/results ] && tar_to=$OUT  # (not into the results themselves)
  NCCL_HOST_RATES=$NCCL_HOST_RATES IPROUTE_ROOT=/tmp/iproute RESULTS_DIR=bench/results \
    TAR_TO=$tar_to BUDGET_S=${NCCL_HOSTS_BUDGET_S:-420} NGPU=${NCCL_HOSTS_NGPU:-$NGPU} \
    bash bench/nccl_hosts.sh \
    2>>"$LOGS/nccl_hosts.err" || status=1
  save
fi
if [ -n "${LINK_RATES:-}" ]; then
  # The allreduce across two hosts (network namespaces) sharing GPU 0, gloo, CUDA tensors:
  # gloo's own against cgx2's at each rate (BENCHMARKS.md, "GPU hosts over Ethernet").
  python3 bench/links.py --hosts 2 --rates "${LINK_RATES// /,}" --iproute-root /tmp/iproute \
    --timeout 500 --out bench/results -- --backend gloo ${LINK_ARGS:---sizes 16M,64M,256M \
    --bits 4 --dtypes fp32 --iters 5 --warmup 1} 2>>"$LOGS/links.err" \
    | grep -E "^ *(fp32|bf16)|^==|results:" || status=1
  save
fi
if [ -n "${CPU_LINK_RATES:-}" ]; then
  # CPU tensors between hosts with cores of their own (BENCHMARKS.md, "CPU hosts over
  # Ethernet"): 8 threads a rank with one rank a host, 4 with two.
  cpu_args=${CPU_LINK_ARGS:---sizes 1M,4M,16M,64M,256M --bits 4 --dtypes fp32 --iters 5 --warmup 1}
  for layout in "1 8" "2 4"; do
    read -r ranks threads <<<"$layout"
    # shellcheck disable=SC2086  # cgx2.bench's arguments, one word each
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=$threads python3 bench/links.py --hosts 2 \
      --nproc-per-node "$ranks" --rates "${CPU_LINK_RATES// /,}" --iproute-root /tmp/iproute \
      --timeout 500 --out bench/results -- $cpu_args 2>>"$LOGS/cpu_links.err" \
      | grep -E "^ *(fp32|bf16)|^==|results:" || status=1
    save
  done
  for rate in $CPU_LINK_RATES; do
    echo "== DDP training, 2 CPU hosts of 2 ranks, $rate"
    CUDA_VISIBLE_DEVICES= THREADS=4 IPROUTE_ROOT=/tmp/iproute bash bench/train_links.sh "$rate" \
      2>>"$LOGS/train_links.err" | tail -n 4 || status=1
    save
  done
fi
if [ -n "${GLOO_DDP_RATES:-}" ]; then
  # Two hosts (network namespaces) sharing GPU 0 over a shaped link, gloo, CUDA tensors
  # (BENCHMARKS.md, "GPU hosts over Ethernet").
  for rate in $GLOO_DDP_RATES; do
    echo "== DDP step over gloo, 2 hosts on GPU 0, $rate"
    IPROUTE_ROOT=/tmp/iproute RATE=$rate RESULTS_DIR=bench/results bash bench/gloo_cuda_ddp.sh \
      2>>"$LOGS/gloo_ddp.err" | grep -v "^  step" || status=1
    save
  done
fi
save
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $status
