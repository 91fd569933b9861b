#!/usr/bin/env bash
# Runs a Kolo training config on N ranks, each in its own network namespace, joined by a bridge
# whose links are shaped with tc (rate limit + added latency), so that communication costs what
# it would on a slow network. Needs root (ip netns, veth, tc); cleans up after itself.
#   bash bench/netem.sh CONFIG N RATE DELAY [kolo train args...]
#   e.g. bash bench/netem.sh bench/gpt.toml 2 100mbit 1ms --steps 8
# Ranks talk TCP only (namespaces still share /dev/shm, so shared memory is switched off),
# unless HOSTS=H: then the ranks form H emulated hosts (KOLO_HOST_ID, consecutive ranks
# together), shared memory within a host and the shaped links between hosts.
# CONFIG may be `bench`: the ranks then run `kolo bench collectives ARGS` instead of training.
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=$1 N=$2 RATE=$3 DELAY=$4
shift 4
if [ "$(id -u)" != 0 ] || ! ip netns list >/dev/null 2>&1; then
  echo "netem.sh: needs root and network namespaces (ip netns); running on loopback instead is bench/train.sh" >&2
  exit 2
fi
cargo build --release -p kolo-cli >/dev/null
K=$PWD/target/release/kolo
TAG=k$$
cleanup() {
  for i in $(seq 0 $((N - 1))); do ip netns del "$TAG-$i" 2>/dev/null || true; done
  ip link del "$TAG-br" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "$TAG-br" type bridge
ip link set "$TAG-br" up
for i in $(seq 0 $((N - 1))); do
  ns=$TAG-$i
  ip netns add "$ns"
  ip link add "$TAG-v$i" type veth peer name "$TAG-p$i"
  ip link set "$TAG-p$i" netns "$ns"
  ip link set "$TAG-v$i" master "$TAG-br"
  ip link set "$TAG-v$i" up
  ip netns exec "$ns" ip addr add "10.77.0.$((i + 1))/24" dev "$TAG-p$i"
  ip netns exec "$ns" ip link set "$TAG-p$i" up
  ip netns exec "$ns" ip link set lo up
  # Each rank's outgoing traffic: DELAY of latency (netem, where the kernel has it), then at
  # most RATE (tbf).
  if ip netns exec "$ns" tc qdisc add dev "$TAG-p$i" root handle 1: netem delay "$DELAY" 2>/dev/null; then
    ip netns exec "$ns" tc qdisc add dev "$TAG-p$i" parent 1: handle 2: tbf rate "$RATE" burst 256kb latency 100ms
  else
    [ "$i" = 0 ] && echo "netem.sh: this kernel has no netem qdisc: rate limit $RATE only, no added delay" >&2
    ip netns exec "$ns" tc qdisc add dev "$TAG-p$i" root tbf rate "$RATE" burst 256kb latency 100ms
  fi
done
TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
PORT=$((20000 + RANDOM % 20000))
pids=()
HOSTS=${HOSTS:-$N}
TRANSPORT=tcp
[ "$HOSTS" != "$N" ] && TRANSPORT=auto
CMD=(train --config "$CFG")
[ "$CFG" = bench ] && CMD=(bench collectives)
for i in $(seq 0 $((N - 1))); do
  RANK=$i WORLD_SIZE=$N LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=10.77.0.1 MASTER_PORT=$PORT KOLO_JOB_TOKEN=$TOKEN \
    KOLO_HOST_ID=host$((i * HOSTS / N)) RAYON_NUM_THREADS=1 ip netns exec "$TAG-$i" "$K" "${CMD[@]}" --transport "$TRANSPORT" "$@" 2>&1 | sed "s/^/[rank $i] /" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
