#!/usr/bin/env bash
# Kolo's DDP training benchmarks on the peers' shapes (bench/mlp.toml, bench/gpt.toml):
# step time at 1 and 2 ranks (1 thread each), scaling efficiency, and the cost of
# synchronisation (2 ranks with ddp.skip_sync = true, i.e. no gradient all-reduce).
#   bash bench/train.sh [REPEATS]
source "$(dirname "$0")/common.sh"
run() { # name world extra-args...
  local name=$1 n=$2; shift 2
  for i in $(seq "$R"); do
    if [ "$n" = 1 ]; then $K train --config "bench/$name.toml" "$@" 2>&1 | grep '^done:'
    else $K launch -n "$n" -- $K train --config "bench/$name.toml" "$@" 2>&1 | grep 'done:'; fi
  done | sed "s/^/$name world=$n $* | /"
}
for m in mlp gpt; do
  run $m 1
  run $m 2
  tmp=$(mktemp --suffix=.toml); sed 's/^\[train\]/[ddp]\nskip_sync = true\n\n[train]/' "bench/$m.toml" > "$tmp"
  cp "$tmp" "bench/.$m-nosync.toml"; run ".$m-nosync" 2; rm -f "bench/.$m-nosync.toml" "$tmp"
done
