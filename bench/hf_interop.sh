#!/usr/bin/env bash
# Hugging Face GPT-2 and Llama-style models in and out, checked in `transformers` (issues #17, #33):
#   1. small random GPT-2, Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3, Mistral, Mixtral, Llama 3, Gemma, Gemma 2, Gemma 3, Phi-3 and GPT-NeoX models (test-data/hf/), a
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
# tiny NAME WHAT ARGS...: the shipped test-data/hf/NAME fine-tuned on 2 ranks for 30 steps with
# ARGS, exported, and checked in transformers.
tiny() {
  local name=$1 what=$2; shift 2
  echo "== $name ($what), 2 ranks, 30 steps, $*"
  $K launch -n 2 -- $X --model "test-data/hf/$name" --out "$tmp/$name" --steps 30 "$@" 2>&1 | grep -E "loaded|exported|step 30/30"
  "$PY" test-data/hf/check_export.py "$tmp/$name" 2>/dev/null
}
# shape NAME WHAT MAKER ARGS... -- HF_FINETUNE_ARGS...: a real model's shape made by MAKER in
# /tmp, fine-tuned by 1 rank for 2 steps of 1 x 64 tokens, exported, and checked.
shape() {
  local name=$1 what=$2; shift 2
  local maker=()
  while [ "$1" != "--" ]; do maker+=("$1"); shift; done
  shift
  echo "== $what, 1 rank, 2 steps of 1 x 64 tokens $*"
  "$PY" "${maker[@]}" 2>/dev/null | tail -1
  $X --model "$tmp/$name" --out "$tmp/$name-ft" --steps 2 --batch 1 --seq 64 "$@" 2>&1 | grep -E "loaded|exported|step 2/2"
  "$PY" test-data/hf/check_export.py "$tmp/$name-ft" 2>/dev/null
}
tiny gpt2-tiny "Conv1D, tied head" --zero 1
tiny llama-tiny "RMSNorm, rotary, SwiGLU, GQA" --zero 2
tiny qwen2-tiny "q/k/v biases, tied embeddings, a windowed layer; exported in bf16" --zero 2 --dtype bf16
tiny mistral-tiny "sliding window 5 over 32 tokens; exported in shards of 40 kB" --tp 2 --max-shard-size 40000
tiny llama3-tiny "rope_type llama3" --pp 2
tiny llama-yarn-tiny "rope_type yarn (factor 4)" --tp 2
tiny phi3-longrope-tiny "rope_type longrope, 32 tokens beyond the original context of 8" --zero 1
tiny gemma-tiny "norms of 1 + weight, scaled embeddings, GeGLU" --tp 2
tiny qwen3-tiny "Qwen3: an RMS norm on each query and key head" --tp 2
tiny gemma3-tiny "Gemma 3 (text): head norms, a rotary embedding per layer type" --pp 2
tiny gemma3-mm-tiny "Gemma 3 with a vision tower: its text model, exported as gemma3_text" --tp 2
tiny gemma2-tiny "Gemma 2: norms around attention and MLP, soft-capped scores and logits" --tp 2
tiny phi3-tiny "fused projections, half of each head rotated, sliding window 6" --zero 3
tiny neox-tiny "parallel residual, a quarter of each head rotated" --zero 1
tiny mixtral-tiny "Mixtral: 4 experts, top 2, the load-balancing loss; experts dealt out over ep 2" --ep 2
tiny qwen3-moe-tiny "Qwen3-MoE: 8 experts on 2 of 3 layers, top 3 not renormalised; experts over ep 2" --ep 2
tiny qwen2-moe-tiny "Qwen2-MoE: a shared expert beside 8 routed ones, q/k/v biases, windows on layers 0 and 2; experts over ep 2" --ep 2
tiny deepseek-v2-tiny "DeepSeek-V2: latent attention, YaRN with mscale, 8 routed experts scaled by 2.5 beside 2 shared; split over tp 2" --tp 2
tiny deepseek-v3-tiny "DeepSeek-V3: sigmoid routing with a selection bias within the best 2 of 4 groups; experts over ep 2, AdamW" --ep 2 --optim adamw
shape 124m "GPT-2 124M shape (random, made by transformers)" test-data/hf/make_gpt2_reference.py "$tmp/124m" 124m --
shape l135m "Llama-style model of SmolLM-135M's shape (tied embeddings, 9 query / 3 key-value heads)" \
  test-data/hf/make_llama_reference.py "$tmp/l135m" 135m --
shape q05b "Qwen2 of Qwen2.5-0.5B's shape (vocabulary 151936, 14 query / 2 key-value heads, tied), exported in bf16 shards of 500 MB" \
  test-data/hf/make_family_reference.py qwen2 "$tmp/q05b" 0.5b -- --dtype bf16 --max-shard-size 500000000
