#!/usr/bin/env bash
# Pipeline parallelism on the benchmark GPT (bench/gpt.toml: d_model 256, 4 blocks, seq 128),
# a batch of 16 sequences split into M micro-batches, K = 2 and 4 stages (ranks), GPipe and
# 1F1B: step time, measured bubble against (K-1)/(M+K-1), and stage 0's peak heap (activations).
#   bash bench/pipeline.sh      (K = 4 puts 4 ranks on this machine's 2 cores)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cfg=bench/.gpt-pipeline.toml
trap 'rm -f "$cfg"' EXIT
echo "# pipeline: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for k in 2 4; do
  for m in 1 2 4 8 16; do
    for s in gpipe 1f1b; do
      sed 's/^batch_size = 8/batch_size = 16/; s/^steps = 14/steps = 8/' bench/gpt.toml > "$cfg"
      printf '\n[pipeline]\nmicro_batches = %d\nschedule = "%s"\n' "$m" "$s" >> "$cfg"
      out=$($K launch -n "$k" -- $K train --config "$cfg" 2>&1)
      ms=$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')
      bub=$(grep -o 'mean bubble [0-9.]*% measured, [0-9.]*% in theory' <<<"$out" | sed 's/mean bubble //; s/ measured,//; s/ in theory//')
      peak=$(grep -o 'peak [0-9.]* MB' <<<"$out" | head -1)
      printf "K=%d M=%-2d %-5s  %8s ms/step  bubble (measured theory) %s  stage-0 heap %s\n" "$k" "$m" "$s" "$ms" "$bub" "$peak"
    done
  done
done
