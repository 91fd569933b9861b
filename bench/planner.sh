#!/usr/bin/env bash
# The planner's cost model against this machine: the benchmark GPT (bench/gpt.toml, global batch
# 16 x 128 tokens) run by each strategy Kolo has on 1-2 ranks; predicted step time and memory
# per rank (`kolo plan --cluster this-machine --evaluate`: candle's measured GEMM efficiency,
# memory-bound rate, loopback 1.5 GB/s, Kolo-on-CPU activation constants) next to the measured
# step time (second half of 8 steps) and peak heap of rank 0. A device is one core: the
# one-process run gets one thread.
#   bash bench/planner.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cfg=bench/.gpt-planner.toml
trap 'rm -f "$cfg"' EXIT
echo "# planner vs measured: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
shape=(--layers 4 --d-model 256 --heads 4 --seq 128 --vocab 65 --global-batch 16 --cluster this-machine --precision f32 --device-memory 24GiB)
run() { # name ranks plan-spec extra-toml
  sed 's/^steps = 14/steps = 8/' bench/gpt.toml > "$cfg"
  printf '%b' "$4" >> "$cfg"
  sed -i "s/^batch_size = 8/batch_size = $5/" "$cfg"
  if [ "$2" = 1 ]; then out=$(RAYON_NUM_THREADS=1 $K train --config "$cfg" 2>&1); else out=$($K launch -n "$2" -- $K train --config "$cfg" 2>&1); fi
  ms=$(grep -o '[0-9.]* ms/step (second half)' <<<"$out" | grep -o '^[0-9.]*')
  peak=$(grep -o 'peak [0-9.]* MB' <<<"$out" | head -1 | grep -o '[0-9.]*')
  pred=$($K plan "${shape[@]}" --devices "$2" --evaluate "$3" | tail -1)
  pms=$(grep -o '[0-9.]* s  *[0-9.]* TFLOP' <<<"$pred" | grep -o '^[0-9.]*')
  pmem=$(grep -o 'memory *[0-9.]* GiB' <<<"$pred" | grep -o '[0-9.]*')
  awk -v n="$1" -v ms="$ms" -v pms="$pms" -v peak="$peak" -v pmem="$pmem" 'BEGIN {
    pm = pmem * 1073.741824; printf "%-22s measured %7.1f ms, predicted %7.1f ms (%+5.1f%%) | peak heap %7.1f MB, predicted %7.1f MB (%+5.1f%%)\n", n, ms, pms * 1000, (pms * 1000 / ms - 1) * 100, peak, pm, (pm / peak - 1) * 100 }'
}
run "1 process"            1 "dp=1,micro=16"            "" 16
run "DDP, 2 ranks"         2 "dp=2,micro=8"             "" 8
run "ZeRO-1, 2 ranks"      2 "dp=2,zero=1,micro=8"      "\n[ddp]\nzero_stage = 1\n" 8
run "ZeRO-2, 2 ranks"      2 "dp=2,zero=2,micro=8"      "\n[ddp]\nzero_stage = 2\n" 8
run "ZeRO-3, 2 ranks"      2 "dp=2,zero=3,micro=8,ckpt" "\n[ddp]\nzero_stage = 3\n" 8
run "tp 2"                 2 "tp=2,micro=16"            "\n[mesh]\ntp = 2\n" 16
run "pp 2, 8 micro-batches" 2 "pp=2,micro=2"            "\n[pipeline]\nmicro_batches = 8\n" 16
