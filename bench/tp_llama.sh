#!/usr/bin/env bash
# Tensor and pipeline parallelism of a Hugging Face model (issue #32 item 6): a random Llama at
# SmolLM-135M's shape (30 layers of 576, 9 query heads sharing 3 key/value heads, SwiGLU of
# 1536, vocabulary 49152 tied to the output; 135M parameters), fine-tuned by the hf_finetune
# example with AdamW and clipping on the same global batch of G windows of T tokens: one
# process, DDP over 3 processes (G / 3 each), and tp 3 (the heads, MLP and vocabulary split
# over 3 processes that read the same G windows). tp 2 cannot split 9 heads and 3 key/value
# heads (transformers' and Megatron's tensor parallelism refuse it too). Then the same shape with
# an untied output layer (a tied one cannot span stages yet; 163M parameters): one process, DDP
# over 2 and 2 pipeline stages (1F1B over 2 micro-batches) on G windows. Per rank: the peak
# resident memory (/usr/bin/time), the step time of steps 6..10 from the log, each stage's bubble.
#   [PYTHON=/opt/peers-venv/bin/python] bash bench/tp_llama.sh [R] [G] [T]   (PYTHON: also torch's tp 3 and pp 2)
source "$(dirname "$0")/common.sh"
G="${2:-3}"; T="${3:-64}"
cargo build --release -p kolo --features hf --example hf_finetune >/dev/null
X=target/release/examples/hf_finetune
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
make_model() { python3 - "$1" "$2" <<'PY'
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
out = sys.argv[1]; os.makedirs(out)
e, inter, layers, h, kv, vocab = 576, 1536, 30, 9, 3, 49152
hd = e // h
rng = np.random.default_rng(0)
w = lambda *s: (rng.standard_normal(s) * 0.02).astype(np.float32)
tied = sys.argv[2] == "tied"
t = {"model.embed_tokens.weight": w(vocab, e), "model.norm.weight": np.ones(e, np.float32)}
if not tied:
    t["lm_head.weight"] = w(vocab, e)
for i in range(layers):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": np.ones(e, np.float32), p + "post_attention_layernorm.weight": np.ones(e, np.float32),
          p + "self_attn.q_proj.weight": w(h * hd, e), p + "self_attn.k_proj.weight": w(kv * hd, e),
          p + "self_attn.v_proj.weight": w(kv * hd, e), p + "self_attn.o_proj.weight": w(e, h * hd),
          p + "mlp.gate_proj.weight": w(inter, e), p + "mlp.up_proj.weight": w(inter, e), p + "mlp.down_proj.weight": w(e, inter)}
save_file(t, f"{out}/model.safetensors", metadata={"format": "pt"})
cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=e, intermediate_size=inter,
           num_hidden_layers=layers, num_attention_heads=h, num_key_value_heads=kv, max_position_embeddings=2048,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, hidden_act="silu")
json.dump(cfg, open(f"{out}/config.json", "w"), indent=1)
print(f"{out}: {sum(v.size for v in t.values()) / 1e6:.1f}M parameters")
PY
}
make_model "$tmp/135m" tied
make_model "$tmp/135m-untied" untied
lscpu | grep -E "Model name" ; uptime
run() { # MODEL NAME N ARGS...
  local model=$1 name=$2 n=$3; shift 3
  echo "== $name"
  $K launch -n "$n" -- /usr/bin/time -f "peak RSS %M KB" $X --model "$tmp/$model" --out "$tmp/out" --steps 10 --seq "$T" "$@" 2>&1 \
    | grep -E "step 10/10|peak RSS|bubble" | sed 's/^/  /'
}
run 135m "one process, batch $G" 1 --batch "$G"
run 135m "DDP, 3 ranks x batch $((G / 3))" 3 --batch "$((G / 3))"
run 135m "tp 3, batch $G" 3 --batch "$G" --tp 3
# torch's tensor parallelism on the same files, when PYTHON has torch and transformers
# (bench/torch_tp_llama.py: the blocks split Megatron's way, the embedding and head whole).
if [ -n "${PYTHON:-}" ] && "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
  echo "== torch tp 3 (torch.distributed.tensor.parallel over gloo), batch $G"
  OMP_NUM_THREADS=1 "$(dirname "$PYTHON")/torchrun" --nproc_per_node 3 bench/torch_tp_llama.py "$tmp/135m" "$G" "$T" 10 2>&1 | grep "torch tp" | sed 's/^/  /'
fi
P=$(( G / 3 * 2 ))   # the pipeline's global batch: 2 micro-batches
run 135m-untied "untied: one process, batch $P" 1 --batch "$P"
run 135m-untied "untied: DDP, 2 ranks x batch $((P / 2))" 2 --batch "$((P / 2))"
run 135m-untied "untied: pp 2 (1F1B, 2 micro-batches), batch $P" 2 --batch "$P" --pp 2 --micro 2
if [ -n "${PYTHON:-}" ] && "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
  echo "== untied: torch pp 2 (torch.distributed.pipelining, 1F1B, 2 micro-batches), batch $P"
  OMP_NUM_THREADS=1 "$(dirname "$PYTHON")/torchrun" --nproc_per_node 2 bench/torch_pp_llama.py "$tmp/135m-untied" "$P" "$T" 10 2 2>&1 | grep "torch pp" | sed 's/^/  /'
fi
uptime
