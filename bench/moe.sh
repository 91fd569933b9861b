#!/usr/bin/env bash
# Mixture of experts: the Shakespeare GPT (d_model 128, 4 blocks, seq 64, 16 sequences per rank)
# with 4 experts per block on 2 ranks, experts dealt over both (mesh.ep = 2) or replicated
# (mesh.ep = 1), top-1 and top-2, with and without the auxiliary load-balancing loss: tokens/s
# (all ranks) and the coefficient of variation of the per-expert load over the run.
#   bash bench/moe.sh [reps] [steps]     (2 ranks share this machine's 2 cores)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
steps=${2:-60}
cfg=bench/.gpt-moe.toml
trap 'rm -f "$cfg"' EXIT
echo "# mixture of experts: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $steps steps"
for ep in 2 1; do
  for k in 1 2; do
    for aux in 0.01 0; do
      sed -e "s/^steps = .*/steps = $steps/" -e "s/^top_k = .*/top_k = $k/" -e "s/^aux_loss_weight = .*/aux_loss_weight = $aux/" \
          -e "s/^ep = .*/ep = $ep/" -e "s/^sample_chars = .*/sample_chars = 0/" -e "s/^log_every = .*/log_every = 1000/" examples/shakespeare_gpt_moe.toml > "$cfg"
      out=$($K launch -n 2 -- $K train --config "$cfg" 2>&1)
      ms=$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')
      cv=$(grep -o 'coefficient of variation [0-9.]*' <<<"$out" | grep -o '[0-9.]*$')
      drop=$(grep -o '[0-9.]*% of assignments dropped' <<<"$out" | grep -o '^[0-9.]*')
      loss=$(grep -o 'last loss [0-9.]*' <<<"$out" | grep -o '[0-9.]*$')
      val=$(grep -o 'final eval on [0-9]* examples: loss [0-9.]*' <<<"$out" | head -1 | grep -o '[0-9.]*$')
      tps=$(awk -v ms="$ms" 'BEGIN { if (ms > 0) printf "%.0f", 2 * 16 * 64 / (ms / 1000) }')
      printf "ep %d top-%d aux %-4s: %7s ms/step %7s tokens/s, load CV %s, dropped %s%%, train loss %s, val loss %s\n" "$ep" "$k" "$aux" "$ms" "$tps" "$cv" "$drop" "$loss" "$val"
    done
  done
done
