#!/usr/bin/env bash
# The user-model path against torch at GPT-2's 124M shape (issue #17 item 5): a random
# GPT2LMHeadModel saved by transformers (bench/hf_interop.sh's maker), fine-tuned by Kolo's
# hf_finetune example (kolo::hf GPT-2 in candle-nn under kolo::Trainer, DDP) and by
# transformers under torch DDP (gloo), AdamW 1e-3 with clipping, batch B x seq T per rank, one
# thread per rank, at 1 and 2 ranks; tokens/s over the steps after the first (Kolo: the mean
# of steps 6..10 that its log line at step 10 reports).
#   PYTHON=/path/to/python-with-torch-and-transformers bash bench/hf_speed.sh [B] [T]
source "$(dirname "$0")/common.sh"
PY="${PYTHON:-python3}"
B="${2:-2}"; T="${3:-256}"
"$PY" -c "import torch, transformers" || { echo "hf_speed: $PY has no torch/transformers (set PYTHON)"; exit 1; }
cargo build --release -p kolo --features hf --example hf_finetune >/dev/null
X=target/release/examples/hf_finetune
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" test-data/hf/make_gpt2_reference.py "$tmp/124m" 124m >/dev/null 2>&1
rm -f "$tmp/124m/reference.safetensors"   # no logits check here: speed only
uptime
for n in 1 2; do
  echo "== Kolo, $n rank(s), batch $B x seq $T per rank, 10 steps"
  if [ "$n" = 1 ]; then $X --model "$tmp/124m" --out "$tmp/out" --steps 10 --batch "$B" --seq "$T" 2>&1 | grep -E "step 10/10"
  else $K launch -n "$n" -- $X --model "$tmp/124m" --out "$tmp/out" --steps 10 --batch "$B" --seq "$T" 2>&1 | grep -E "step 10/10"; fi
  echo "== torch, $n rank(s)"
  OMP_NUM_THREADS=1 "$PY" bench/torch_hf_ddp.py "$tmp/124m" "$n" "$B" "$T" 10 5 2>&1 | grep -E "^torch"
done
uptime
