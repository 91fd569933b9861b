#!/usr/bin/env bash
# Parameter servers: push/pull throughput against loopback TCP, then MNIST (MLP 784-512-512-10,
# batch 64 per worker, Adagrad on the servers) on one epoch of data (60,000 examples split over
# the workers) for 1, 2, 4 workers x 1, 2 servers x BSP, bounded delay (tau 1, 4) and async
# (Downpour): wall time of the epoch and test accuracy. Then the significantly-modified filter's
# traffic saving. Usage: bash bench/ps.sh   (one repetition; the machine has 2 cores, so runs
# with more processes than cores measure contention as much as the protocol)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
echo "## push/pull throughput"
for s in 1 2; do $K bench ps --servers $s 2>/dev/null; done
$K bench ps --servers 2 --replication 1 2>/dev/null
cfg=$(mktemp --suffix=.toml)
trap 'rm -f "$cfg"' EXIT
run() { # workers servers consistency staleness [extra ps lines]
  local w=$1 s=$2 c=$3 tau=$4 extra="${5:-}"
  local steps=$(( 60000 / (64 * w) ))
  cat > "$cfg" <<TOML
[model]
kind = "mlp"
hidden = [512, 512]
[data]
kind = "mnist"
path = "../shared/data/mnist"
batch_size = 64
[optim]
kind = "adagrad"
lr = 0.01
[train]
steps = $steps
log_every = 100000
strategy = "ps"
[ps]
consistency = "$c"
staleness = ${tau:-0}
servers = $s
$extra
TOML
  local t0=$(date +%s.%N)
  local out
  out=$($K ps run -n "$w" --servers "$s" --config "$cfg" 2>&1)
  local t1=$(date +%s.%N)
  local acc=$(grep -o 'accuracy [0-9.]*%' <<<"$out" | head -1)
  local ms=$(grep -o '[0-9.]* ms/step' <<<"$out" | tail -1)
  local sent=$(grep -o 'sent [0-9]* of [0-9]* gradient values ([0-9.]*% saved)' <<<"$out" || true)
  printf "%-8s workers %d servers %d steps %4d: %6.1f s, %s, %s %s\n" "$c${tau:+/$tau}" "$w" "$s" "$steps" "$(echo "$t1 - $t0" | bc)" "$ms" "$acc" "$sent"
}
echo "## one epoch of MNIST through parameter servers ($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
for w in 1 2 4; do
  for s in 1 2; do
    run $w $s bsp ""
    run $w $s bounded 1
    run $w $s bounded 4
    run $w $s async ""
  done
done
echo "## significantly-modified filter (async, 2 workers, 1 server)"
for th in 0.0005 0.002; do run 2 1 async "" "filter_threshold = $th"; done
echo "## backup workers (BSP, 3 workers, 1 server, 150 steps; worker 2 slowed by 40 ms per step)"
for b in 0 1; do
  sed 's/^steps = 600/steps = 150/; s/^consistency = "async".*/consistency = "bsp"/; s/^replication = 1 .*/replication = 0/' examples/mnist_ps.toml > "$cfg"
  printf 'backup_workers = %d\n' "$b" >> "$cfg"
  out=$($K ps run -n 3 --servers 1 --config "$cfg" -- --slow-rank 2:40 2>&1)
  echo "backup_workers $b: $(grep -o '[0-9.]* ms/step (second half)' <<<"$out"), $(grep -o 'accuracy [0-9.]*%' <<<"$out")"
done
