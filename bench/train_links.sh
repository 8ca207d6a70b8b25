#!/usr/bin/env bash
# examples/train_ddp.py on CPU tensors across two cgx2.testing.netlab hosts of two ranks, torchrun
# across them: plain DDP, cgx_hook 4-bit as the policy routes it (mesh="auto"), over the node mesh
# (CGX2_NODE_MESH=1) and flat (--flat), cgx2.ddp.compress at 4 bits (the hook only where it
# pays), and plain DDP on the cgx backend at 4 bits. Needs root.
# Usage: bash bench/train_links.sh [RATE] [OUT]   (RATE 1gbit, OUT bench/results)
# THREADS (1) is each rank's OMP_NUM_THREADS; WAIT_POLICY each rank's OMP_WAIT_POLICY (unset:
# OpenMP's default; the files' names end in _passive for PASSIVE); RANKS (2) ranks a host (the
# files say the world size: _w4); IPROUTE_ROOT where dpkg -x
# unpacked iproute2 on an image without it; MODEL overrides the model and run arguments below.
set -euo pipefail
rate=${1:-1gbit}
out=${2:-bench/results}
threads=${THREADS:-1}
ranks=${RANKS:-2}
world=$((2 * ranks))
wait_env=""
tag=""
if [ -n "${WAIT_POLICY:-}" ]; then
  wait_env="OMP_WAIT_POLICY=$WAIT_POLICY"
  tag="_$(echo "$WAIT_POLICY" | tr 'A-Z' 'a-z')"
fi
model=${MODEL:---dim 512 --layers 2 --heads 8 --batch-size 2 --context 32 --steps 30}
iproute=()
[ -n "${IPROUTE_ROOT:-}" ] && iproute=(--iproute-root "$IPROUTE_ROOT")
device=$(python3 -c 'import platform; print(platform.processor() or "cpu")' | tr -c 'A-Za-z0-9\n' '-')
stamp=$(date -u +%Y%m%dT%H%M)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
runs=("b32_hook::--bits 32" "b4_hook::--bits 4" "b4_hook_mesh:CGX2_NODE_MESH=1:--bits 4"
      "b4_hook_flat::--bits 4 --flat" "b4_compress::--mode compress --bits 4"
      "b4_backend::--mode backend --bits 4")
for run in "${runs[@]}"; do
  name=${run%%:*}
  rest=${run#*:}
  env=${rest%%:*}
  flags=${rest#*:}
  echo "== $name at $rate" >&2
  python3 -m cgx2.testing.netlab "${iproute[@]}" --hosts 2 --rate "$rate" -- bash -c "
    OMP_NUM_THREADS=$threads $wait_env $env torchrun --nnodes 2 --nproc-per-node $ranks --rdzv-backend c10d \
      --rdzv-endpoint \$MASTER_ADDR:29711 --rdzv-conf is_host=\$((HOST == 0)) \
      --local-addr \$HOST_ADDR examples/train_ddp.py $flags --device cpu --log-every 100 --verbose \
      $model --json $work/$name.json"
  cp "$work/$name.json" "$out/train_ddp_${device}_cpu-${rate}-h2_w${world}_${name}${tag}_${stamp}.json"
done
python3 - "$out" "$device" "$rate" "$stamp" "$tag" "$world" <<'EOF'
import json, sys
out, device, rate, stamp, tag, world = sys.argv[1:]
runs = {}
for name in ("b32_hook", "b4_hook", "b4_hook_mesh", "b4_hook_flat", "b4_compress", "b4_backend"):
    with open(f"{out}/train_ddp_{device}_cpu-{rate}-h2_w{world}_{name}{tag}_{stamp}.json") as f:
        runs[name] = json.load(f)
plain = runs["b32_hook"]["step_ms"]
for name, r in runs.items():
    print(f"{name:13s} {r['step_ms']:8.1f} ms/step  {plain / r['step_ms']:5.2f}x plain  "
          f"loss {r['final_loss']:.4f}  {(r['bytes_sent'] or 0) / 1e6:8.1f} MB sent")
EOF
