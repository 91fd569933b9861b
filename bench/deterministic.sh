#!/usr/bin/env bash
# Cost of [ddp] deterministic = true against the default mode: MNIST MLP 784-512-512-10 (the
# shipped subset), AdamW, 2 ranks x batch 64, 200 steps; ms/step over the second half, median of
# the repetitions, for the default mode and pieces of 64 (a rank's whole batch), 16 and 4.
#   bash bench/deterministic.sh [reps]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "# deterministic mode: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
mk() { mnist_mlp "$dir/$1.toml" test-data/mnist 200 "progress = false
[ddp]
deterministic = $2
deterministic_chunk = $3"; }
mk default false 1
for c in 64 16 4; do mk "pieces-$c" true "$c"; done
for v in default pieces-64 pieces-16 pieces-4; do
  runs=()
  for rep in $(seq "$R"); do
    out=$($K launch -n 2 -- $K train --config "$dir/$v.toml" 2>&1)
    runs+=("$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')")
  done
  med=$(printf '%s\n' "${runs[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  traffic=$(grep -o 'gradient traffic: [0-9.]* [kMG]*B' <<<"$out" | sed 's/gradient traffic: //')
  printf "%-10s %7s ms/step (runs: %s), %s per step per rank\n" "$v" "$med" "${runs[*]}" "$traffic"
done
