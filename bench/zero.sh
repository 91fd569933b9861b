#!/usr/bin/env bash
# ZeRO benchmarks: step time of ZeRO-1/2/3 against Kolo's DDP on the peers' GPT (2 ranks), and
# per-rank memory of model states on the peers' GPT-m (25.3 M parameters) at 2 and 4 ranks,
# measured by Kolo's counting allocator (heap between steps minus heap before the model).
#   bash bench/zero.sh [REPEATS]          (PEERS=1 also runs torch DDP / ZeRO-1 / FSDP on GPT)
source "$(dirname "$0")/common.sh"
echo "## step time, GPT, 2 ranks (ms/step, second half of 14 steps)"
for i in $(seq "$R"); do
  for z in 0 1 2 3; do
    $K launch -n 2 -- $K train --config bench/gpt.toml --zero-stage "$z" 2>&1 | grep 'done:' | sed "s/^/zero=$z | /"
  done
done
echo "## memory per rank, GPT-m"
for n in 2 4; do
  for z in 0 1 2 3; do
    $K launch -n "$n" -- $K train --config bench/gptm.toml --zero-stage "$z" --steps 3 2>&1 | grep -E 'memory per rank|heap per rank' | sed "s/^/world=$n zero=$z | /"
  done
done
if [ "${PEERS:-0}" = 1 ]; then
  echo "## torch (../shared/bench/peers), GPT, 2 ranks"
  (cd ../shared/bench/peers && /opt/peers-venv/bin/python bench_torch_ddp.py --configs gpt:ddp:2:1 gpt:zero:2:1 gpt:fsdp:2:1 --repeat "$R" --trials 3 2>&1 | grep -E '^\| gpt:')
fi
