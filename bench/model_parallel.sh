#!/usr/bin/env bash
# Model parallelism on the benchmark GPT (bench/gpt.toml: d_model 256, 4 blocks, seq 128).
# Pipeline: a batch of 16 sequences split into M micro-batches, K = 2 and 4 stages (ranks), GPipe
# 1F1B and PipeDream-2BW: step time, measured bubble against (K-1)/(M+K-1) (2BW: M = every
# micro-batch of the run, it never flushes), stage 0's peak heap (activations; 2BW also keeps a
# second weight version).
# Tensor parallelism: tp = 2 on 2 ranks against 1 process and DDP on 2 ranks (batch 16 in all),
# and the all-reduces per block against Megatron's 2 + 2.
#   bash bench/model_parallel.sh      (K = 4 puts 4 ranks on this machine's 2 cores)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cfg=bench/.gpt-model-parallel.toml
trap 'rm -f "$cfg"' EXIT
echo "# pipeline: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for k in 2 4; do
  for m in 1 2 4 8 16; do
    for s in gpipe 1f1b 2bw; do
      if [ "$s" = 2bw ] && [ $((m + 1)) -lt "$k" ]; then continue; fi
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
echo "# tensor parallelism (batch 16 per data-parallel replica x 8 steps)"
sed 's/^batch_size = 8/batch_size = 16/; s/^steps = 14/steps = 8/' bench/gpt.toml > "$cfg"
echo "1 process:   $($K train --config "$cfg" 2>&1 | grep -o '[0-9.]* ms/step (second half)')"
sed 's/^batch_size = 8/batch_size = 8/; s/^steps = 14/steps = 8/' bench/gpt.toml > "$cfg"
echo "DDP 2 ranks: $($K launch -n 2 -- $K train --config "$cfg" 2>&1 | grep -o '[0-9.]* ms/step (second half)')"
sed 's/^batch_size = 8/batch_size = 16/; s/^steps = 14/steps = 8/' bench/gpt.toml > "$cfg"
printf '\n[mesh]\ntp = 2\n' >> "$cfg"
out=$($K launch -n 2 -- $K train --config "$cfg" 2>&1)
echo "tp 2 ranks:  $(grep -o '[0-9.]* ms/step (second half)' <<<"$out"); $(grep -o 'tensor parallel: .*' <<<"$out")"
