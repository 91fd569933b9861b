#!/usr/bin/env bash
# Stragglers under all-reduce DDP: MNIST MLP 784-512-512-10, 2 ranks, global batch 128, 200 steps;
# rank 1 made a slower device (+0.25 ms per example it computes, about 2x its compute) without
# and with dynamic batch sizing (ddp.dynamic_batch_every = 10), against no slow rank: ms/step over
# the second half, the straggler named, and the final split of the global batch.
#   bash bench/stragglers.sh [reps]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "# stragglers: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
mk() { mnist_mlp "$dir/$1.toml" ../shared/data/mnist 50 "[ddp]
dynamic_batch_every = $2"; }
mk static 0
mk dynamic 10
for rep in $(seq "$R"); do
  for v in "none static" "slow static" "slow dynamic"; do
    set -- $v
    extra=(); [ "$1" = slow ] && extra=(--slow-per-example 1:0.25)
    out=$($K launch -n 2 -- $K train --config "$dir/$2.toml" "${extra[@]}" 2>&1)
    ms=$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')
    strag=$(grep -o 'straggler: rank [0-9]*' <<<"$out" | tail -1 || true)
    split=$(grep -o 'dynamic batch: per-rank batches .*' <<<"$out" | tail -1 | sed 's/.*-> \(\[[0-9, ]*\]\).*/\1/' || true)
    printf "%-5s rank 1, %-7s batches: %7s ms/step  %s %s\n" "$1" "$2" "$ms" "${strag:-no straggler named}" "${split:+final split $split}"
  done
done
