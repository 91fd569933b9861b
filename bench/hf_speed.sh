#!/usr/bin/env bash
# The user-model path against torch at a real model's shape (issues #17 item 5, #33 item 4): a
# random model saved by transformers (MODEL=gpt2-124m, default: GPT-2's 124M shape;
# smollm-135m: a Llama of SmolLM-135M's shape; qwen2-0.5b: Qwen2.5-0.5B's), fine-tuned by Kolo's
# hf_finetune example (kolo::hf GPT-2 in candle-nn under kolo::Trainer, DDP) and by
# transformers under torch DDP (gloo), AdamW 1e-3 with clipping, batch B x seq T per rank, one
# thread per rank, at 1 and 2 ranks; tokens/s over the steps after the first (Kolo: the mean
# of steps 6..10 that its log line at step 10 reports).
#   PYTHON=/path/to/python-with-torch-and-transformers [MODEL=...] bash bench/hf_speed.sh [R] [B] [T]
source "$(dirname "$0")/common.sh"
PY="${PYTHON:-python3}"
B="${2:-2}"; T="${3:-256}"
"$PY" -c "import torch, transformers" || { echo "hf_speed: $PY has no torch/transformers (set PYTHON)"; exit 1; }
cargo build --release -p kolo --features hf --example hf_finetune >/dev/null
X=target/release/examples/hf_finetune
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case "${MODEL:-gpt2-124m}" in
  gpt2-124m) "$PY" test-data/hf/make_gpt2_reference.py "$tmp/124m" 124m >/dev/null 2>&1 ;;
  smollm-135m) "$PY" test-data/hf/make_llama_reference.py "$tmp/124m" 135m >/dev/null 2>&1 ;;
  qwen2-0.5b) "$PY" test-data/hf/make_family_reference.py qwen2 "$tmp/124m" 0.5b >/dev/null 2>&1 ;;
  *) echo "MODEL: gpt2-124m, smollm-135m or qwen2-0.5b"; exit 1 ;;
esac
echo "model ${MODEL:-gpt2-124m}: $(grep -E '"(model_type|num_hidden_layers|n_layer|hidden_size|n_embd|vocab_size)"' "$tmp/124m/config.json" | tr -d ' \n')"
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
