#!/usr/bin/env bash
# Kolo's collective benchmarks as reported in docs/benchmarks.md: loopback/memcpy limits, then
# all_reduce f32 4 KiB..256 MiB at 2 and 4 ranks over TCP and shared memory, JSON rows.
#   bash bench/collectives.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/kolo-bench-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
cargo build --release -p kolo-cli
K=target/release/kolo
$K bench loopback --size 256MiB --trials 5 --json | tee "$OUT/loopback.jsonl"
for n in 2 4; do
  for t in tcp shm; do
    $K bench collectives -n "$n" --transport "$t" --min 4KiB --max 256MiB --factor 4 --trials 5 --json \
      | sed 's/^\[rank 0\] //' | tee "$OUT/allreduce-n$n-$t.jsonl"
  done
done
echo "results in $OUT"
