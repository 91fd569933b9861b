#!/usr/bin/env bash
# Kolo on an NVIDIA GPU: the NCCL backend's checks and bandwidth, the models on candle's CUDA
# backend against the CPU, and GPT training tokens/s beside torch eager on the same GPU.
# Runs from the repository root on the GPU machine, with what bench/gpu/build.sh put in .gpu/
# (no Rust toolchain needed there). Writes logs under $OUT (default /tmp/kolo-gpu).
set -u
OUT=${OUT:-/tmp/kolo-gpu}
mkdir -p "$OUT"
G=.gpu
for f in $G/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
. bench/gpu/libs.sh
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-4}
step() { echo; echo "== $*"; }

step "NCCL backend, 1 rank: collective matrix (host API), sub-group, GPU buffers"
$G/kolo-nccl-check check 2>&1 | tee "$OUT/nccl_check.log" | tail -6
step "NCCL, 2 ranks on the one GPU (NCCL refuses two ranks per GPU: the error must say so)"
timeout 120 $G/kolo launch -n 2 -- $G/kolo-nccl-check check 2>&1 | tail -8
step "NCCL, rank 1 never initialises: rank 0's setup deadline (3 s)"
KOLO_TIMEOUT_MS=3000 timeout 60 $G/kolo launch -n 2 -- $G/kolo-nccl-check absent 2>&1 | tail -4
step "NCCL all_reduce bandwidth, GPU buffers and the host API"
$G/kolo-nccl-check bench $((1 << 30)) 2>&1 | tee "$OUT/nccl_bench.log" | tail -18
step "models on candle's CUDA backend vs the CPU"
$G/tensor-cuda-test --nocapture 2>&1 | tail -8
step "GPT training on the GPU (bench shape), kolo vs torch eager"
for b in 8 64; do
  sed "s/batch_size = 8/batch_size = $b/; s/steps = 14/steps = 60/" bench/gpt.toml > "$OUT/gpt_b$b.toml"
  $G/kolo train --config "$OUT/gpt_b$b.toml" --device cuda 2>&1 | grep -E '^done|error' | sed "s/^/kolo cuda batch $b: /"
  (cd $G && python3 torch_gpt.py $b 60) 2>&1 | tail -1
done
for b in 8; do
  $G/kolo train --config "$OUT/gpt_b$b.toml" --device cpu 2>&1 | grep -E '^done|error' | sed "s/^/kolo cpu (RAYON_NUM_THREADS=$RAYON_NUM_THREADS) batch $b: /"
done
step "Shakespeare GPT on the GPU, real data, through the NCCL backend (1 rank)"
$G/kolo train --config examples/shakespeare_gpt.toml --data $G/tinyshakespeare.txt --device cuda --backend nccl 2>&1 | grep -vE '^\s*$' | tail -12
