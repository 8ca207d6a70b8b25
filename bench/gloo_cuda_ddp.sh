#!/usr/bin/env bash
# A DDP step over gloo between two hosts on one machine (cgx2.testing.netlab: network
# namespaces joined through a bridge by shaped links), both ranks on one GPU, per communication hook: plain DDP,
# cgx_hook at 4 bits as the policy routes it, cgx_hook with compression forced
# (CGX2_CROSSOVER_BYTES=0), and torch's bf16_compress_hook; then a table of the step times.
# cgx-inline (not run unless named in RUNS): cgx_hook on autograd's thread (CGX2_COMM_WORKER=0).
#
# Usage (repo root, as root): bash bench/gloo_cuda_ddp.sh
#   RATE (10gbit): the link's rate; RUNS ("plain cgx cgx-forced bf16"): which runs;
#   DEVICE (cuda) and MODEL_ARGS (ddp_gloo_cuda.py's flags, e.g. "--dim 128 --layers 2"):
#   DEVICE=cpu with a small model runs anywhere; TIMEOUT (300): seconds a run may take;
#   RESULTS_DIR ($OUT, else cgx2-results): the JSON files and logs go in a folder under it;
#   IPROUTE_ROOT: where dpkg -x unpacked iproute2's .debs, where ip and tc are not installed.
# The GPU image has no iproute2; fetch its .debs here first (echo /.iproute/ >>.git/info/exclude;
# mkdir .iproute && cd .iproute && apt-get download iproute2 libbpf1 libelf1 libmnl0
# libxtables12 libcap2 libbsd0 libmd0) and carry .iproute (bench/device_run.sh unpacks it).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD  # a caller's cgx2 first (A/B runs)
RATE=${RATE:-10gbit}
RUNS=${RUNS:-plain cgx cgx-forced bf16}
DEVICE=${DEVICE:-cuda}
MODEL_ARGS=${MODEL_ARGS:-}
TIMEOUT=${TIMEOUT:-300}
PYTHON=${PYTHON:-python3}
DIR=${RESULTS_DIR:-${OUT:-cgx2-results}}/gloo_ddp_${DEVICE}_${RATE}_$(date +%Y%m%d-%H%M%S)
mkdir -p "$DIR"
# Two ranks on a 2-core CPU each taking every core would measure the contention.
[ "$DEVICE" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

trap 'echo "gloo_cuda_ddp.sh: interrupted" >&2; exit 130' INT TERM
status=0 n=0 total=$(wc -w <<<"$RUNS")
for run in $RUNS; do
  n=$((n + 1))
  case $run in
    plain|bf16) hook=$run vars=(-u CGX2_CROSSOVER_BYTES) ;;
    cgx) hook=cgx vars=(-u CGX2_CROSSOVER_BYTES) ;;  # the policy's own routing
    cgx-forced) hook=cgx vars=(CGX2_CROSSOVER_BYTES=0) ;;
    cgx-inline) hook=cgx vars=(-u CGX2_CROSSOVER_BYTES CGX2_COMM_WORKER=0) ;;  # on autograd's thread
    *) echo "gloo_cuda_ddp.sh: unknown run $run (plain, cgx, cgx-forced, cgx-inline, bf16)" >&2
       exit 2 ;;
  esac
  # shellcheck disable=SC2086  # MODEL_ARGS: one flag a word
  args=(bench/ddp_gloo_cuda.py --hook "$hook" --name "$run" --device "$DEVICE" --out "$DIR"
        $MODEL_ARGS)
  echo "run $n/$total: $run (hook $hook, ${vars[*]}) at $RATE on $DEVICE"
  start=$(date +%s)
  # $HOST and $MASTER_ADDR are each namespace's own: expanded there, by the inner bash.
  "$PYTHON" -m cgx2.testing.netlab --hosts 2 --rate "$RATE" --timeout "$TIMEOUT" \
    ${IPROUTE_ROOT:+--iproute-root "$IPROUTE_ROOT"} -- env "${vars[@]}" \
    bash -c 'exec "$0" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
      --node-rank "$HOST" --master-addr "$MASTER_ADDR" --master-port 29500 "$@"' \
    "$PYTHON" "${args[@]}" >"$DIR/$run.log" 2>&1
  rc=$?
  grep -E '^(  step |ddp_gloo_cuda: )' "$DIR/$run.log"
  if [ "$rc" -ne 0 ]; then
    status=1
    echo "run $n/$total: $run FAILED (exit $rc) after $(($(date +%s) - start)) s; the log's end:"
    tail -n 25 "$DIR/$run.log"
  else
    echo "run $n/$total: $run done in $(($(date +%s) - start)) s"
  fi
done

"$PYTHON" - "$DIR" <<'EOF'
import json, sys
from pathlib import Path

rows = {}
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    rows[r["run"]] = (r, path.name)
if not rows:
    sys.exit("no results")
any_ = next(iter(rows.values()))[0]
plain = rows.get("plain", (None,))[0]
print(f"\nDDP step over gloo, {any_['world_size']} hosts at {any_['rate']}, "
      f"{any_['params'] / 1e6:.1f}M params, {any_['device']}, torch {any_['torch']}, {any_['date']}")
print("| run | hook | CGX2_CROSSOVER_BYTES | CGX2_COMM_WORKER | regime | median step ms "
      "| speedup vs plain | bytes sent vs plain | loss | file |")
print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
order = ["plain", "cgx", "cgx-inline", "cgx-forced", "bf16"]
for run in sorted(rows, key=lambda run: order.index(run) if run in order else len(order)):
    r, name = rows[run]
    speedup = f"{plain['median_ms'] / r['median_ms']:.2f}x" if plain else "-"
    ratio = "-" if r["bytes_sent_ratio"] is None else f"{r['bytes_sent_ratio']:.3f}"
    env = r["env"]
    print(f"| {run} | {r['hook']} | {env.get('CGX2_CROSSOVER_BYTES', '(unset)')} "
          f"| {env.get('CGX2_COMM_WORKER', '(unset)')} | {r['regime']} | {r['median_ms']:.1f} | {speedup} | {ratio} | {r['loss']:.4f} "
          f"| `{name}` |")
print("speedup vs plain: plain DDP's median step time over the run's. bytes sent vs plain: "
      "what cgx_hook sent in the timed steps over what a plain ring allreduce sends "
      "(1.000: every bucket went uncompressed). regime: the policy's, for fp32 on this group.")
EOF
exit "$status"
