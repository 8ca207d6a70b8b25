#!/usr/bin/env bash
# Two hosts on one machine: two Linux network namespaces joined by a veth pair shaped with tc
# (DESIGN.md, "Measuring"), running one command in each; the namespaces go away on exit.
#
# Usage (as root): bash bench/hosts.sh [--rate 10gbit] [--mtu 1500] [--timeout SECONDS] -- CMD...
#   CMD runs in both namespaces at once with HOST (0 or 1), NHOSTS (2), HOST_ADDR (this host's
#   address), MASTER_ADDR (host 0's), HOSTS_RATE and GLOO_SOCKET_IFNAME exported; wrap it in
#   bash -c '...' to use them in its arguments, e.g.
#     bash bench/hosts.sh --rate 1gbit -- bash -c 'torchrun --nnodes 2 --nproc-per-node 1 \
#       --node-rank $HOST --master-addr $MASTER_ADDR --master-port 29500 train.py'
#   --rate: tc's rate of each direction (kbit, mbit, gbit); --timeout: stop both commands after
#   this long (0: never). Exit status: 0 when both commands succeeded, else the first failure's.
#   HOSTS_SYSCTL ("name=value ..."): network settings of each namespace, e.g.
#   net.ipv4.tcp_slow_start_after_idle=0.
# Where ip and tc are not installed (a minimal GPU image), IPROUTE_ROOT names a folder where
# `dpkg -x` unpacked Debian's iproute2 and the libraries it links (libbpf1, libelf1, libmnl0,
# libxtables12, libcap2, libbsd0, libmd0): its binaries run with its libraries, the commands
# in the namespaces with the caller's LD_LIBRARY_PATH.
set -uo pipefail

RATE=10gbit MTU=1500 TIMEOUT=0
while [ $# -gt 0 ]; do
  case $1 in
    --rate) RATE=$2; shift 2 ;;
    --mtu) MTU=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "hosts.sh: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "hosts.sh: no command (--help)" >&2; exit 2; }

PREFIX=cgx2h            # namespaces are $PREFIX<index>-<pid of the run that made them>
IFNAME=cgx2link         # the veth end inside each namespace
NHOSTS=2
NETWORK=10.77.0         # /24, only inside the namespaces: hosts are .1 and .2

CALLER_LD=${LD_LIBRARY_PATH-}
IP_BIN=ip TC_BIN=tc TOOL_LD=$CALLER_LD
if [ -n "${IPROUTE_ROOT:-}" ]; then
  find_tool() {
    for d in usr/sbin sbin usr/bin bin; do
      [ -x "$IPROUTE_ROOT/$d/$1" ] && { echo "$IPROUTE_ROOT/$d/$1"; return; }
    done
    echo "hosts.sh: no $1 under IPROUTE_ROOT=$IPROUTE_ROOT" >&2; exit 2
  }
  IP_BIN=$(find_tool ip) || exit 2
  TC_BIN=$(find_tool tc) || exit 2
  TOOL_LD=$IPROUTE_ROOT/usr/lib/x86_64-linux-gnu:$IPROUTE_ROOT/lib/x86_64-linux-gnu${CALLER_LD:+:$CALLER_LD}
fi
ipr() { LD_LIBRARY_PATH=$TOOL_LD "$IP_BIN" "$@"; }
tcr() { LD_LIBRARY_PATH=$TOOL_LD "$TC_BIN" "$@"; }
ipr -V >/dev/null 2>&1 || {
  echo "hosts.sh: cannot run ip ($IP_BIN): install iproute2, or set IPROUTE_ROOT to where" \
       "dpkg -x unpacked its .debs" >&2
  exit 2
}
tcr -V >/dev/null 2>&1 || { echo "hosts.sh: cannot run tc ($TC_BIN)" >&2; exit 2; }

# tbf's bucket: 2 ms of the rate (at least 64 KiB, a GSO packet), so that it never caps a
# packet but holds the rate over any transfer longer than a few ms.
rate_bits() {
  local n=${1%%[a-zA-Z]*} unit=${1##*[0-9.]}
  case ${unit,,} in
    bit|"") echo "$n" ;; kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;;
    gbit) echo $((n * 1000000000)) ;;
    *) echo "hosts.sh: --rate $1: use bit, kbit, mbit or gbit (integers)" >&2; return 1 ;;
  esac
}
BITS=$(rate_bits "$RATE") || exit 2
BURST=$((BITS / 8 / 500)); [ "$BURST" -ge 65536 ] || BURST=65536

# A namespace of ours whose run is gone (killed before its trap ran) is deleted; those of a
# run still going are left alone.
for ns in $(ipr netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX[0-9]*-[0-9]*$"); do
  owner=${ns##*-}
  state=$(sed -n 's/^State:[[:space:]]*\(.\).*/\1/p' "/proc/$owner/status" 2>/dev/null)
  if [ "$owner" != $$ ] && { [ -z "$state" ] || [ "$state" = Z ]; }; then  # gone, or a zombie
    echo "hosts.sh: deleting $ns, left by an earlier run" >&2
    ipr netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ipr netns del "$ns"
  fi
done

NAMES=() PIDS=()
for ((i = 0; i < NHOSTS; i++)); do NAMES+=("$PREFIX$i-$$"); done
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for ns in "${NAMES[@]}"; do
    # Whatever still runs in the namespace was started by this run.
    ipr netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ipr netns del "$ns" 2>/dev/null
  done
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

set -e
for ns in "${NAMES[@]}"; do
  ipr netns add "$ns"
  ipr -n "$ns" link set lo up
  # HOSTS_SYSCTL="net.ipv4.tcp_slow_start_after_idle=0 ...": the namespace's own settings.
  for setting in ${HOSTS_SYSCTL:-}; do
    ipr netns exec "$ns" sh -c "echo ${setting#*=} > /proc/sys/$(tr . / <<<"${setting%%=*}")"
  done
done
# Made inside the namespaces: no name in the caller's namespace, no clash between runs.
ipr -n "${NAMES[0]}" link add "$IFNAME" mtu "$MTU" type veth \
  peer name "$IFNAME" mtu "$MTU" netns "${NAMES[1]}"
for ((i = 0; i < NHOSTS; i++)); do
  ns=${NAMES[$i]}
  ipr -n "$ns" addr add "$NETWORK.$((i + 1))/24" dev "$IFNAME"
  ipr -n "$ns" link set "$IFNAME" up
  tcr -n "$ns" qdisc add dev "$IFNAME" root tbf rate "$RATE" burst "$BURST" latency 50ms
done
set +e
for ns in "${NAMES[@]}"; do  # both ends up before anything connects
  for _ in $(seq 50); do
    ipr -n "$ns" link show "$IFNAME" | grep -q 'state UP' && break
    sleep 0.1
  done
done
echo "hosts.sh: ${NAMES[*]} joined at $RATE (tbf burst $BURST bytes, mtu $MTU)" >&2

limit=()
[ "$TIMEOUT" = 0 ] || limit=(timeout -k 10 "$TIMEOUT")
for ((i = 0; i < NHOSTS; i++)); do
  if [ -n "$CALLER_LD" ]; then restore=(LD_LIBRARY_PATH="$CALLER_LD"); else restore=(-u LD_LIBRARY_PATH); fi
  # Not through ipr: a function would run in a subshell, and the pid would be that shell's.
  LD_LIBRARY_PATH=$TOOL_LD "$IP_BIN" netns exec "${NAMES[$i]}" env "${restore[@]}" HOST="$i" NHOSTS="$NHOSTS" \
    HOST_ADDR="$NETWORK.$((i + 1))" MASTER_ADDR="$NETWORK.1" HOSTS_RATE="$RATE" \
    GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME" TP_SOCKET_IFNAME="$IFNAME" \
    "${limit[@]}" "$@" &
  PIDS+=($!)
done

# When one host fails the other would wait for it until its own timeout: stop it.
status=0 running=("${PIDS[@]}")
while [ ${#running[@]} -gt 0 ]; do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then still+=("$pid"); continue; fi
    wait "$pid"; rc=$?
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
      status=$rc
      echo "hosts.sh: a host's command failed (exit $rc); stopping the other" >&2
      for other in "${PIDS[@]}"; do kill -TERM "$other" 2>/dev/null; done
    fi
  done
  running=("${still[@]}")
  [ ${#running[@]} -eq 0 ] || sleep 0.2
done
exit "$status"
