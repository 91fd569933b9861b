#!/usr/bin/env bash
# Sequence parallelism: GPT (d_model 64, 2 heads, 2 blocks), one sequence per step, synthetic
# tokens, sequence lengths 512..4096 on 1 process and on 4 ranks with mesh.sp = 4 (ring
# attention): step time and the peak heap of rank 0 (activations of its chunk). The longest
# sequence that trains in a memory budget scales with the peak heap per rank.
#   bash bench/sequence.sh     (4 ranks share this machine's 2 cores)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cfg=bench/.gpt-sequence.toml
trap 'rm -f "$cfg"' EXIT
echo "# sequence parallelism: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for seq in 512 1024 2048 4096; do
  for sp in 1 4; do
    cat > "$cfg" <<TOML
[model]
kind = "gpt"
seq = $seq
d_model = 64
n_head = 2
n_layer = 2
[data]
kind = "synthetic"
batch_size = 1
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 4
log_every = 1000
sample_chars = 0
eval_batches = 1
progress = false
TOML
    if [ "$sp" = 1 ]; then out=$($K train --config "$cfg" 2>&1)
    else printf '[mesh]\nsp = %d\n' "$sp" >> "$cfg"; out=$($K launch -n "$sp" -- $K train --config "$cfg" 2>&1); fi
    ms=$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')
    peak=$(grep -o 'peak [0-9.]* MB' <<<"$out" | head -1)
    printf "seq %5d sp %d: %9s ms/step, rank-0 heap %s\n" "$seq" "$sp" "$ms" "$peak"
  done
done
