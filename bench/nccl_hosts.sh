#!/usr/bin/env bash
# GPU servers over Ethernet, on one machine: cgx2.testing.netlab hosts with --gpus-per-host (NCCL
# over NVLink inside a host, over its sockets on a tc-shaped veth link between hosts: NCCL_HOSTID,
# NCCL_SOCKET_IFNAME, docs/hosts.md), torchrun --nnodes across them, NCCL. For each layout (hosts
# x GPUs a host; 2 GPUs: 2x1; 4 or more: 2x2 and 4x1) and link rate:
#   bench    python -m cgx2.bench: NCCL's allreduce against cgx2's (fp32, 64 and 256 MiB, 4 bits);
#            its fp32 bus bandwidth at the largest size is the link's delivered rate
#   mlp_*    bench/ddp_gloo_cuda.py --backend nccl --model mlp: a DDP step of the 134M-parameter
#            MLP (8 x 4096), plain DDP, cgx_hook at 4 and 8 bits (the policy's routing), torch's
#            bf16_compress_hook and PowerSGD (rank 4)
#   ddp_*    examples/train_ddp.py (126.75M: --dim 1024 --layers 10 --heads 16 --context 256
#            --batch-size 8), plain DDP and cgx_hook 4-bit, eager and --compile
#   fsdp_*   examples/train_fsdp.py (85M, its blocks compiled as users run it), fp32 and bf16
#            parameters: FSDP2's own, 4-bit reduce-scatter, and that with 8-bit parameters,
#            gathered twice a step or (_b4p8k) once, the rows kept for the backward
#   hsdp_*   the same as HSDP (--replicas 2: shards inside a host, replicas across), 2x2 only
#   conv_*   examples/convergence.py's model (19.3M) with conv_NAME's compressor (cgx4, cgx2-rot,
#            powersgd, ...: its names), 40 steps: a step's time across the hosts, for
#            examples/convergence_time.py --step-times (not by default)
# then a summary: each table headed by the link's delivered rate (NCCL's fp32 allreduce bus
# bandwidth against the configured rate), as markdown and JSON beside the raw files.
#
# Usage (repo root, root; bench/device_run.sh runs it where NCCL_HOST_RATES is set, after
# unpacking .iproute): NCCL_HOST_RATES="10gbit 25gbit" IPROUTE_ROOT=/tmp/iproute bash bench/nccl_hosts.sh
#   NCCL_HOST_RATES ("10gbit 25gbit"): link rates, tc's units.
#   LAYOUTS (by the GPU count, as above): e.g. "2x2 4x1". NGPU (nvidia-smi -L's count).
#   NCCL_HOST_RUNS (all): the runs to do, by name (bench mlp_plain mlp_cgx4 mlp_cgx8 mlp_bf16
#     mlp_powersgd ddp_b32 ddp_b4 fsdp_fp32_b32 fsdp_fp32_b4 fsdp_fp32_b4p8 fsdp_fp32_b4p8k
#     fsdp_bf16_b32 fsdp_bf16_b4 fsdp_bf16_b4p8 fsdp_bf16_b4p8k ddp_b32_compile ddp_b4_compile hsdp_bf16_b32 hsdp_bf16_b4
#     hsdp_bf16_b4p8; not by default: mlp_compress, cgx2.ddp.compress at 4 bits,
#     mlp_cgx4o, the same with AdamW stepping each bucket in the backward pass
#     (--optimizer-in-backward), ddp_b4o, train_ddp.py 4-bit with it, ddp_c4, train_ddp.py's
#     --mode compress (cgx2.ddp.compress: the hook where it pays), ddp_b3r and ddp_b3ro,
#     train_ddp.py 3-bit rotated, without and with it,
#     mlp_allreduce, torch's allreduce_hook, mlp_cgx4_flat and mlp_cgx4_mesh, the node mesh
#     off and on, mlp_plain_big and mlp_cgx4_big, DDP's buckets at 100 MB; conv_*;
#     timeline_ddp_b4, timeline_ddp_b32, timeline_ddp_b4o, timeline_ddp_b4_compile,
#     timeline_mlp_b4 and timeline_mlp_b4o:
#     bench/ddp_step_timeline.py, where a step's time goes, TIMELINE_ARGS the model's
#     (TIMELINE_TRACE=1: with rank 0's chrome trace, trace.json);
#     mlp_cgx3r, mlp_cgx2r and mlp_cgx25ar: the MLP at 3 and 2 bits rotated, and
#     examples/convergence.py's cgx2.5a-rot; mlp_cgx3c, mlp_cgx2c: rotated and clipped).
#   NCCL_HOST_PLAN: "LAYOUT RATE RUN...; ..." runs exactly these, in this order (in place of
#     LAYOUTS, NCCL_HOST_RATES and NCCL_HOST_RUNS); RUN+VAR=VALUE[+VAR=VALUE] runs RUN with those
#     variables set in every rank (an A/B inside one call: mlp_cgx4+CGX2_CUDA_GRAPHS=0), its
#     results in the summary's "Variants" table; a layout 1xN is one host of N GPUs without
#     the lab, its "rate" the regime: nvlink, shm or socket. They run in that order for every layout and rate,
#     the compiled and HSDP runs after the rest of every layout and rate.
#   NCCL_HOST_ROUNDS (1): the whole plan this many times, each round's order the last one's
#     turned by one (no run always first, nor always after the same one): one run's step
#     wanders by several percent from run to run on these machines. Round r's runs are NAME@r
#     (from 2); the summary gives each run's median over its rounds, and every round's time
#     in its "rounds" table.
#   BUDGET_S (480): no run starts past it (those left are listed as skipped), nor runs more than
#     60 s past it; RUN_TIMEOUT (180): seconds a run may take; MLP_ARGS, DDP_ARGS, FSDP_ARGS,
#     BENCH_ARGS, CONV_ARGS override each kind's arguments.
#   RESULTS_DIR (bench/results): the run's folder, nccl_hosts_<gpu>_<date>/, goes there;
#   TAR_TO: a folder where nccl_hosts.tgz (that folder) is written after every run ($OUT).
#   DRY_RUN=1: on a machine without GPUs (root and iproute2 still), with NGPU=2 or 4: makes the
#     hosts and echoes, from each, its GPUs, NCCL's variables and the command it would run.
#   DEVICE=cpu: every run for real on CPU hosts over gloo (NGPU then counts ranks), to check
#     the script and its summary on a machine without GPUs; give it small *_ARGS.
# Expected duration: 2 GPUs and 2 rates 7-9 minutes (28 runs of 10-20 s: torch's start, NCCL's
# setup over the link, 5-8 steps; the 4 compiled runs 30-60 s, the first compiling cold); 4 GPUs
# and 2 rates (2 layouts) about twice that: within one 10-minute call, give it one rate, or
# NCCL_HOST_RUNS a part. BUDGET_S (device_run.sh: 420) keeps it inside the call either way; a
# call cut short still has every finished run's files in nccl_hosts.tgz, and
# python bench/nccl_hosts_summary.py <its folder> makes the tables from them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# NVLink multicast (NVLS) is not used on these machines, nor by cgx2's transports.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RATES=${NCCL_HOST_RATES:-10gbit 25gbit}
BUDGET_S=${BUDGET_S:-480}
RUN_TIMEOUT=${RUN_TIMEOUT:-180}
DRY=${DRY_RUN:-}
DEVICE=${DEVICE:-cuda}
backend=nccl; [ "$DEVICE" = cpu ] && backend=gloo
if [ -z "${NGPU:-}" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [ -z "${LAYOUTS:-}" ]; then
  if [ "$NGPU" -ge 4 ]; then LAYOUTS="2x2 4x1"; elif [ "$NGPU" -ge 2 ]; then LAYOUTS="2x1"; fi
fi
if [ -z "${LAYOUTS:-}" ]; then
  echo "nccl_hosts.sh: $NGPU GPU(s): GPU hosts need 2 at least (NGPU=2 DRY_RUN=1 for a dry run)" >&2
  exit 2
fi
if [ -n "$DRY" ]; then gpu=dry-run; elif [ "$DEVICE" = cpu ]; then gpu=cpu; else
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr 'A-Z ' 'a-z-')
fi
DIR=${RESULTS_DIR:-bench/results}/nccl_hosts_${gpu}_$(date -u +%Y%m%dT%H%M%S)
mkdir -p "$DIR"
MLP_ARGS=${MLP_ARGS:---model mlp --dim 4096 --layers 8 --batch-size 64 --warmup 2 --steps 3}
DDP_ARGS=${DDP_ARGS:---dim 1024 --layers 10 --heads 16 --context 256 --batch-size 8 --steps 8}
FSDP_ARGS=${FSDP_ARGS:---steps 8}
TIMELINE_ARGS=${TIMELINE_ARGS:---dim 1024 --layers 10 --heads 16 --context 256 --batch-size 8}
BENCH_ARGS=${BENCH_ARGS:---sizes 64M,256M --bits 4 --dtypes fp32 --warmup 1 --iters 5}
CONV_ARGS=${CONV_ARGS:---dim 512 --layers 6 --heads 8 --context 256 --batch-size 16 --steps 40
  --warmup 10 --eval-every 1000 --eval-batches 2 --train-bytes 2000000}
ALL_RUNS="bench mlp_plain mlp_cgx4 mlp_cgx8 mlp_bf16 mlp_powersgd ddp_b32 ddp_b4 fsdp_fp32_b32
  fsdp_fp32_b4 fsdp_fp32_b4p8 fsdp_fp32_b4p8k fsdp_bf16_b32 fsdp_bf16_b4 fsdp_bf16_b4p8
  fsdp_bf16_b4p8k ddp_b32_compile
  ddp_b4_compile hsdp_bf16_b32 hsdp_bf16_b4 hsdp_bf16_b4p8"
RUNS=${NCCL_HOST_RUNS:-$ALL_RUNS}
iproute=()
[ -n "${IPROUTE_ROOT:-}" ] && iproute=(--iproute-root "$IPROUTE_ROOT")

# What ran where: the machine and its versions, then a line a run (runs.jsonl).
python3 - "$DIR/machine.json" "$NGPU" "$LAYOUTS" "$RATES" "$*" <<'EOF'
import datetime, json, os, platform, subprocess, sys
path, ngpu, layouts, rates, argv = sys.argv[1:]
def out(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return None
info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": out(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
        "ngpu": int(ngpu), "layouts": layouts.split(), "rates": rates.split(),
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "git": out(["git", "rev-parse", "HEAD"]),
        "command": " ".join(f"{k}={v!r}" for k, v in sorted(os.environ.items())
                            if k.startswith(("NCCL_", "CGX2_", "LAYOUTS", "BUDGET_S", "RUN_",
                                             "MLP_ARGS", "DDP_ARGS", "FSDP_ARGS", "BENCH_ARGS", "DEVICE",
                                             "DRY_RUN", "NGPU")))
                   + f" bash bench/nccl_hosts.sh {argv}".rstrip()}
try:
    import torch
    info |= {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except ImportError:
    pass
with open(path, "w") as f:
    json.dump(info, f, indent=1)
EOF

record() {  # name layout rate rc seconds folder command: a line of runs.jsonl
  python3 - "$DIR/runs.jsonl" "$@" <<'EOF'
import json, sys
path, name, layout, rate, rc, seconds, folder, command = sys.argv[1:]
hosts, per_host = (int(n) for n in layout.split("x"))
with open(path, "a") as f:
    f.write(json.dumps({"run": name, "layout": layout, "hosts": hosts, "gpus_per_host": per_host,
                        "rate": rate, "rc": None if rc == "-" else int(rc),
                        "seconds": None if seconds == "-" else int(seconds),
                        "folder": folder, "command": command}) + "\n")
EOF
}

# A run's program and arguments, given its name and its folder; empty: not this layout's.
program() {  # name folder layout; NAME+VAR=VALUE... runs NAME with those variables set (A/B)
  local name=${1%%+*} dir=$2 layout=$3 bits pbits dtype
  args=() run_env=()
  if [ "$name" != "$1" ]; then IFS=+ read -ra run_env <<< "${1#*+}"; fi
  case $name in
    bench) args=(-m cgx2.bench --backend "$backend" --out "$dir" $BENCH_ARGS) ;;
    mlp_plain) args=(bench/ddp_gloo_cuda.py --hook plain) ;;
    mlp_cgx4) args=(bench/ddp_gloo_cuda.py --hook cgx --bits 4 --name cgx4) ;;
    mlp_cgx8) args=(bench/ddp_gloo_cuda.py --hook cgx --bits 8 --name cgx8) ;;
    mlp_plain_big) args=(bench/ddp_gloo_cuda.py --hook plain --bucket-cap-mb 100 --name plain_big) ;;
    mlp_cgx4_big)  # DDP's buckets of 100 MB: the link's latency paid a quarter as often
      args=(bench/ddp_gloo_cuda.py --hook cgx --bits 4 --bucket-cap-mb 100 --name cgx4_big) ;;
    mlp_cgx4_flat|mlp_cgx4_mesh)  # the node mesh off or on (CGX2_NODE_MESH), not measured
      run_env+=(CGX2_NODE_MESH=$([ "$name" = mlp_cgx4_mesh ] && echo 1 || echo 0))
      args=(bench/ddp_gloo_cuda.py --hook cgx --bits 4 --name "${name#mlp_}") ;;
    mlp_bf16) args=(bench/ddp_gloo_cuda.py --hook bf16) ;;
    mlp_powersgd) args=(bench/ddp_gloo_cuda.py --hook powersgd) ;;
    mlp_compress) args=(bench/ddp_gloo_cuda.py --hook compress --bits 4) ;;
    mlp_cgx4o)  # AdamW steps each bucket in the hook, overlapping the backward pass and the bytes
      args=(bench/ddp_gloo_cuda.py --hook compress --bits 4 --optimizer-in-backward --name cgx4o) ;;
    mlp_allreduce) args=(bench/ddp_gloo_cuda.py --hook allreduce) ;;
    mlp_cgx3r|mlp_cgx2r)  # fewer bits, rotated (issue 44's speed)
      bits=${name#mlp_cgx}; bits=${bits%r}
      args=(bench/ddp_gloo_cuda.py --hook cgx --bits "$bits" --rotation hadamard --name "${name#mlp_}") ;;
    mlp_cgx3c|mlp_cgx2c)  # rotated and clipped (its reference codes it until its kernels exist)
      bits=${name#mlp_cgx}; bits=${bits%c}
      args=(bench/ddp_gloo_cuda.py --hook cgx --bits "$bits" --rotation hadamard-clipped
            --name "${name#mlp_}") ;;
    mlp_cgx25ar)  # examples/convergence.py's cgx2.5a-rot
      args=(bench/ddp_gloo_cuda.py --hook cgx --bits 2 --rotation hadamard --adaptive-bits 2,3,4,8
            --average-bits 2.28 --name cgx25ar) ;;
    timeline_ddp_b4|timeline_ddp_b32|timeline_ddp_b4o|timeline_ddp_b4_compile)
      # where a train_ddp.py step's time goes (b4o: AdamW in the backward pass)
      bits=${name#timeline_ddp_b}; bits=${bits%_compile}; bits=${bits%o}
      args=(bench/ddp_step_timeline.py --device "$DEVICE" --bits "$bits" $TIMELINE_ARGS --out "$dir")
      [ "${name%o}" != "$name" ] && args+=(--optimizer-in-backward)
      [ "${name%_compile}" != "$name" ] && args+=(--compile) ;;
    timeline_mlp_b4|timeline_mlp_b4o)  # the same for the MLP's step
      args=(bench/ddp_step_timeline.py --device "$DEVICE" --bits 4 --model mlp --dim 4096 --layers 8
            --batch-size 64 --out "$dir")
      [ "${name%o}" != "$name" ] && args+=(--optimizer-in-backward) ;;
    ddp_b32|ddp_b4|ddp_b32_compile|ddp_b4_compile|ddp_b4o|ddp_b3r|ddp_b3ro|ddp_c4)
      # o: AdamW in the backward pass; r: rotated (issue 44's 3-bit); c: cgx2.ddp.compress
      bits=${name#ddp_[bc]}; bits=${bits%_compile}; bits=${bits%o}; bits=${bits%r}
      args=(examples/train_ddp.py --device "$DEVICE" --bits "$bits" $DDP_ARGS --log-every 1000
            --json "$dir/$name.json")
      [ "${name#ddp_c}" != "$name" ] && args+=(--mode compress)
      [ "${name%_compile}" != "$name" ] && args+=(--compile)
      [ "${name%o}" != "$name" ] && args+=(--optimizer-in-backward)
      case $name in *r|*ro) args+=(--rotation hadamard) ;; esac ;;
    fsdp_*|hsdp_*)
      if [ "${name%%_*}" = hsdp ] && [ "$layout" != 2x2 ]; then return; fi
      dtype=${name#*_}; dtype=${dtype%%_*}
      bits=${name##*_b}; pbits=""; keep=""
      case $bits in *k) keep=1; bits=${bits%k} ;; esac  # b4p8k: the 8-bit rows kept for the backward
      case $bits in *p*) pbits=${bits#*p}; bits=${bits%p*} ;; esac
      args=(examples/train_fsdp.py --device "$DEVICE" --bits "$bits" ${pbits:+--param-bits "$pbits"}
            ${keep:+--keep-quantized-params} $FSDP_ARGS --log-every 1000 --json "$dir/$name.json")
      [ "$dtype" = bf16 ] && args+=(--bf16)
      [ "${name%%_*}" = hsdp ] && args+=(--replicas 2) ;;
    conv_*)  # examples/convergence.py's compressor NAME (conv_NAME), a short run: its step time
      args=(examples/convergence.py --device "$DEVICE" --backend "$backend" $CONV_ARGS
            --compressors "${name#conv_}" --out "$dir") ;;
    *) echo "nccl_hosts.sh: unknown run $name" >&2; return ;;
  esac
  case $name in mlp_*) args+=(--backend "$backend" --device "$DEVICE" $MLP_ARGS --out "$dir") ;; esac
  if [ "${name#timeline_}" != "$name" ] && [ -n "${TIMELINE_TRACE:-}" ]; then
    args+=(--trace "$dir/trace.json")  # rank 0's every kernel and op, for chrome://tracing
  fi
}

# torchrun in each host: $HOST and $MASTER_ADDR are the host's, expanded there.
launch='exec "$0" -m torch.distributed.run --nnodes "$NHOSTS" --nproc-per-node "$RANKS_PER_HOST"'
launch+=' --node-rank "$HOST" --master-addr "$MASTER_ADDR" --master-port 29500 "$@"'
if [ -n "$DRY" ]; then
  launch='echo "host $HOST: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES NCCL_HOSTID=$NCCL_HOSTID'
  launch+=' NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME NCCL_IB_DISABLE=$NCCL_IB_DISABLE LINK_RATE=$LINK_RATE:'
  launch+=' $0 -m torch.distributed.run --nnodes $NHOSTS --nproc-per-node $RANKS_PER_HOST'
  launch+=' --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29500 $*"'
fi
gpu_flags() {  # netlab's GPU hosts (none on CPU hosts), a count of fakes on a dry run
  [ "$DEVICE" = cpu ] && return
  echo --gpus-per-host "$1"
  [ -n "$DRY" ] && echo --gpus "$NGPU"
}

status=0 start=$SECONDS
save() {
  [ -n "${TAR_TO:-}" ] && tar czf "$TAR_TO/nccl_hosts.tgz" -C "$(dirname "$DIR")" "$(basename "$DIR")"
  return 0
}
# What to run: NCCL_HOST_PLAN's items in its order, else first every layout's and rate's main
# runs, then the compiled and HSDP ones.
plan=()
if [ -n "${NCCL_HOST_PLAN:-}" ]; then
  IFS=';' read -ra items <<< "$NCCL_HOST_PLAN"
  for item in "${items[@]}"; do
    read -ra words <<< "$item"
    [ ${#words[@]} -ge 3 ] || { echo "nccl_hosts.sh: plan item '$item': LAYOUT RATE RUN..." >&2; exit 2; }
    for name in "${words[@]:2}"; do plan+=("${words[0]} ${words[1]} $name"); done
  done
else
  for pass in main late; do
    for layout in $LAYOUTS; do
      for rate in $RATES; do
        for name in $RUNS; do
          case $name in *_compile|hsdp_*) late=late ;; *) late=main ;; esac
          [ "$late" = "$pass" ] && plan+=("$layout $rate $name")
        done
      done
    done
  done
fi
ROUNDS=${NCCL_HOST_ROUNDS:-1}
if ! [[ $ROUNDS =~ ^[1-9][0-9]*$ ]]; then
  echo "nccl_hosts.sh: NCCL_HOST_ROUNDS is a count of rounds, 1 or more, not '$ROUNDS'" >&2
  exit 2
fi
first=("${plan[@]}")
for ((r = 2; r <= ROUNDS; r++)); do
  for ((i = 0; i < ${#first[@]}; i++)); do
    plan+=("${first[$(((i + r - 1) % ${#first[@]}))]}@$r")
  done
done
for item in "${plan[@]}"; do
        read -r layout rate name <<< "$item"
        hosts=${layout%x*} per_host=${layout#*x}
        folder=$DIR/${layout}_$rate/$name  # the run's log and JSON
        program "${name%@*}" "$folder" "$layout"
        [ ${#args[@]} -eq 0 ] && continue
        mkdir -p "$folder"
        elapsed=$((SECONDS - start))
        # A run may take RUN_TIMEOUT, and no more than 60 s past the budget.
        timeout=$((BUDGET_S + 60 - elapsed)); [ "$timeout" -gt "$RUN_TIMEOUT" ] && timeout=$RUN_TIMEOUT
        if [ "$hosts" = 1 ]; then
          # One server: no lab, its GPUs over NVLink (rate nvlink), NCCL's shared memory (shm)
          # or its sockets on loopback (socket), as DESIGN.md's regimes.
          case $rate in
            nvlink) regime=() ;;
            shm) regime=(NCCL_P2P_DISABLE=1) ;;
            socket) regime=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
            *) echo "nccl_hosts.sh: one host's rate is nvlink, shm or socket, not $rate" >&2; exit 2 ;;
          esac
          devices=$(seq -s, 0 $((per_host - 1)))
          cmd=(timeout "$timeout" env "${regime[@]}" "${run_env[@]}" CUDA_VISIBLE_DEVICES="$devices"
               python3 -m torch.distributed.run --standalone
               --nproc-per-node "$per_host" "${args[@]}")
          [ -n "$DRY" ] && cmd=(echo "host 0:" "${cmd[@]}")
        else
          # shellcheck disable=SC2046  # gpu_flags: one word each
          cmd=(python3 -m cgx2.testing.netlab --hosts "$hosts" $(gpu_flags "$per_host")
               --rate "$rate" "${iproute[@]}" --timeout "$timeout"
               -- env RANKS_PER_HOST="$per_host" "${run_env[@]}" bash -c "$launch" python3 "${args[@]}")
        fi
        command=$(printf '%q ' "${cmd[@]}")
        if [ "$elapsed" -ge "$BUDGET_S" ]; then
          echo "== $layout $rate $name: skipped (${elapsed} s, past BUDGET_S=$BUDGET_S)"
          record "$name" "$layout" "$rate" - - "$folder" "$command"
          continue
        fi
        echo "== $layout $rate $name"
        t0=$SECONDS
        # The exact command, in every JSON the run writes (cgx2.bench's env.link.driver).
        LINK_DRIVER=$command HOSTS_COMMAND=$command "${cmd[@]}" >"$folder/run.log" 2>&1
        rc=$?
        record "$name" "$layout" "$rate" "$rc" "$((SECONDS - t0))" "$folder" "$command"
        if [ -n "$DRY" ]; then
          grep "^host " "$folder/run.log" | sort
        else
          grep -E "^(ddp_gloo_cuda: |[0-9]+-bit |results: )" "$folder/run.log" | tail -n 2
        fi
        if [ "$rc" -ne 0 ]; then
          status=1
          echo "   FAILED (exit $rc) after $((SECONDS - t0)) s; the log's end:"
          tail -n 15 "$folder/run.log" | sed 's/^/   /'
        fi
        save
done

python3 bench/nccl_hosts_summary.py "$DIR" || status=1
save
exit "$status"
