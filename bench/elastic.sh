#!/usr/bin/env bash
# Elastic training: MNIST MLP 784-512-512-10 on 4 ranks, batch 32 per rank, checkpoints every 50
# steps; rank 2 SIGKILLs itself at step 130 under `kolo launch --min-nodes 3`. Prints when each
# milestone line appeared: the death, the launcher's restart, the resume (checkpoint loaded on 3
# ranks) and the first logged step after it; and the steps lost (death step - checkpoint step).
#   bash bench/elastic.sh [reps]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "# elastic restart 4 -> 3 ranks: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$R"); do
  rm -rf "$dir/ckpt"
  cat > "$dir/mlp.toml" <<TOML
[model]
kind = "mlp"
hidden = [512, 512]
[data]
kind = "mnist"
path = "$(realpath ../shared/data/mnist)"
batch_size = 32
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 200
log_every = 10
checkpoint_dir = "$dir/ckpt"
checkpoint_every = 50
TOML
  $K launch -n 4 --min-nodes 3 --restart-backoff 0 -- $K train --config "$dir/mlp.toml" --kill-at 2:130 2>&1 |
    while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$dir/log"
  t_kill=$(grep -m1 'killing itself' "$dir/log" | cut -d' ' -f1)
  t_restart=$(grep -m1 'restarting on' "$dir/log" | cut -d' ' -f1)
  t_resumed=$(grep -m1 'resumed from' "$dir/log" | cut -d' ' -f1)
  from=$(grep -m1 'resumed from' "$dir/log" | grep -o 'at step [0-9]*' | grep -o '[0-9]*$')
  t_step=$(awk -v f="$from" '/resumed from/ {r=1} r && /\] step [0-9]+\/200 loss/ {print $1; exit}' "$dir/log")
  awk -v k="$t_kill" -v r="$t_restart" -v s="$t_resumed" -v p="$t_step" -v from="$from" 'BEGIN {
    printf "death -> restart %.2f s, -> checkpoint loaded on 3 ranks %.2f s, -> first logged step %.2f s; steps lost %d (died at 130, resumed at %d)\n", r - k, s - k, p - k, 130 - from, from }'
  grep -o 'final eval.*' "$dir/log" | tail -1
done
