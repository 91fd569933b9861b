#!/usr/bin/env bash
# Scheduled communication (ByteScheduler, `[ddp] schedule`) against plain DDP on the GPT
# (bench/gpt.toml), N ranks (default 2), on links shaped by bench/netem.sh (root): step time
# and how much of the communication the next forward pass hid.
#   [N=2] bash bench/schedule.sh [RATES...]      (default: 100mbit 1gbit)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-2}
RATES=("$@")
[ $# -eq 0 ] && RATES=(100mbit 1gbit)
modes=(
  "plain DDP (buckets 25 MiB, first 1 MiB)|"
  "plain DDP (buckets 1 MiB)|bucket_cap = \"1MiB\""
  "scheduled 256 KiB chunks, credit 1 MiB|schedule = { chunk = \"256KiB\", credit = \"1MiB\" }"
  "scheduled 1 MiB chunks, credit 4 MiB|schedule = { chunk = \"1MiB\", credit = \"4MiB\" }"
)
for rate in "${RATES[@]}"; do
  for m in "${modes[@]}"; do
    name=${m%%|*} ddp=${m#*|}
    cfg=$(mktemp --suffix=.toml)
    sed "s/^\[train\]/[ddp]\n$ddp\n\n[train]/" bench/gpt.toml > "$cfg"
    bash bench/netem.sh "$cfg" "$N" "$rate" 0ms --steps 10 2>/dev/null | grep -E '^\[rank 0\] done' | sed "s/^/$N ranks | $rate | $name | /"
    rm -f "$cfg"
  done
done
