#!/usr/bin/env bash
# Hugging Face GPT-2 and Llama-style models in and out, checked in `transformers` (issues #17, #33):
#   1. small random GPT-2, Llama, Qwen2, Mistral, Llama 3, Gemma, Phi-3 and GPT-NeoX models (test-data/hf/), a
#      GPT-2 of the real 124M shape, a Llama of SmolLM-135M's shape (~500 MB each) and a Qwen2 of
#      Qwen2.5-0.5B's shape (2 GB; all three made here in /tmp) load into Kolo with transformers' logits;
#   2. each is fine-tuned by Kolo (the small ones by 2 processes under ZeRO-1/2, the large ones by 1
#      process for 2 steps), exported, loaded by AutoModelForCausalLM.from_pretrained, and its logits
#      compared with Kolo's (test-data/hf/check_export.py: fails above 1e-4, or when config.json's
#      dtype is not the files'): exports in bf16 and in shards (model.safetensors.index.json) too.
# Needs a Python with torch and transformers: PYTHON=/path/to/python (default python3).
#   bash bench/hf_interop.sh
source "$(dirname "$0")/common.sh"
PY="${PYTHON:-python3}"
"$PY" -c "import torch, transformers" || { echo "hf_interop: $PY has no torch/transformers (set PYTHON)"; exit 1; }
cargo build --release -p kolo --features hf --example hf_finetune >/dev/null
X=target/release/examples/hf_finetune
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== small GPT-2 (test-data/hf/gpt2-tiny), 2 ranks, ZeRO-1, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/gpt2-tiny --out "$tmp/tiny" --steps 30 --zero 1 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/tiny" 2>/dev/null
echo "== small Llama-style model (test-data/hf/llama-tiny: RMSNorm, rotary, SwiGLU, GQA), 2 ranks, ZeRO-2, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/llama-tiny --out "$tmp/llama" --steps 30 --zero 2 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/llama" 2>/dev/null
echo "== Qwen2 (test-data/hf/qwen2-tiny: q/k/v biases, tied embeddings, a windowed layer), 2 ranks, ZeRO-2, 30 steps, exported in bf16"
$K launch -n 2 -- $X --model test-data/hf/qwen2-tiny --out "$tmp/qwen2" --steps 30 --zero 2 --dtype bf16 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/qwen2" 2>/dev/null
echo "== Mistral (test-data/hf/mistral-tiny: sliding window 5 over 32 tokens), tp 2, 30 steps, exported in shards of 40 kB"
$K launch -n 2 -- $X --model test-data/hf/mistral-tiny --out "$tmp/mistral" --steps 30 --tp 2 --max-shard-size 40000 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/mistral" 2>/dev/null
echo "== Llama 3 rotary scaling (test-data/hf/llama3-tiny), pp 2, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/llama3-tiny --out "$tmp/llama3" --steps 30 --pp 2 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/llama3" 2>/dev/null
echo "== Gemma (test-data/hf/gemma-tiny: norms of 1 + weight, scaled embeddings, GeGLU), 2 ranks, tp 2, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/gemma-tiny --out "$tmp/gemma" --steps 30 --tp 2 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/gemma" 2>/dev/null
echo "== Phi-3 (test-data/hf/phi3-tiny: fused projections, half of each head rotated, sliding window 6), 2 ranks, ZeRO-3, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/phi3-tiny --out "$tmp/phi3" --steps 30 --zero 3 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/phi3" 2>/dev/null
echo "== GPT-NeoX (test-data/hf/neox-tiny: parallel residual, a quarter of each head rotated), 2 ranks, ZeRO-1, 30 steps"
$K launch -n 2 -- $X --model test-data/hf/neox-tiny --out "$tmp/neox" --steps 30 --zero 1 2>&1 | grep -E "loaded|exported|step 30/30"
"$PY" test-data/hf/check_export.py "$tmp/neox" 2>/dev/null
echo "== GPT-2 124M shape (random, made by transformers), 1 rank, 2 steps of 1 x 64 tokens"
"$PY" test-data/hf/make_gpt2_reference.py "$tmp/124m" 124m 2>/dev/null | tail -1
$X --model "$tmp/124m" --out "$tmp/124m-ft" --steps 2 --batch 1 --seq 64 2>&1 | grep -E "loaded|exported|step 2/2"
"$PY" test-data/hf/check_export.py "$tmp/124m-ft" 2>/dev/null
echo "== Llama-style model of SmolLM-135M's shape (random, made by transformers; tied embeddings, 9 query / 3 key-value heads), 1 rank, 2 steps of 1 x 64 tokens"
"$PY" test-data/hf/make_llama_reference.py "$tmp/l135m" 135m 2>/dev/null | tail -1
$X --model "$tmp/l135m" --out "$tmp/l135m-ft" --steps 2 --batch 1 --seq 64 2>&1 | grep -E "loaded|exported|step 2/2"
"$PY" test-data/hf/check_export.py "$tmp/l135m-ft" 2>/dev/null
echo "== Qwen2 of Qwen2.5-0.5B's shape (random, made by transformers; vocabulary 151936, 14 query / 2 key-value heads, tied), 1 rank, 2 steps of 1 x 64 tokens, exported in bf16 shards of 500 MB"
"$PY" test-data/hf/make_family_reference.py qwen2 "$tmp/q05b" 0.5b 2>/dev/null | tail -1
$X --model "$tmp/q05b" --out "$tmp/q05b-ft" --steps 2 --batch 1 --seq 64 --dtype bf16 --max-shard-size 500000000 2>&1 | grep -E "loaded|exported|step 2/2"
"$PY" test-data/hf/check_export.py "$tmp/q05b-ft" 2>/dev/null
