#!/usr/bin/env bash
# Activation checkpointing of a Hugging Face model's decoder layers (`[model] checkpoint_blocks`):
# a random Llama of 8 layers (hidden 256, 8 heads over 4 key/value heads, 5.9M parameters, made
# here with numpy as transformers lays one out) fine-tuned on 2 ranks, 8 sequences of 128 bytes
# per rank, 12 AdamW steps, without and with every layer checkpointed: rank 0's heap line
# (transient: activations and step buffers) and ms/step, alternating.
#   bash bench/hf_checkpointing.sh [REPEATS]
source "$(dirname "$0")/common.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir" <<'PY'
import json, struct, sys, numpy as np
out = sys.argv[1]
L, H, I, nh, kv, V = 8, 256, 688, 8, 4, 96
cfg = json.load(open("test-data/hf/llama-tiny/config.json"))
cfg.update(num_hidden_layers=L, hidden_size=H, intermediate_size=I, num_attention_heads=nh,
           num_key_value_heads=kv, head_dim=H // nh, max_position_embeddings=256)
json.dump(cfg, open(f"{out}/config.json", "w"), indent=2)
rng, t = np.random.default_rng(0), {}
w = lambda *s: rng.normal(0, 0.02, s)
t["model.embed_tokens.weight"], t["lm_head.weight"], t["model.norm.weight"] = w(V, H), w(V, H), np.ones(H)
for l in range(L):
    p = f"model.layers.{l}."
    t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = np.ones(H)
    t[p + "self_attn.q_proj.weight"], t[p + "self_attn.o_proj.weight"] = w(H, H), w(H, H)
    t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"] = w(kv * H // nh, H), w(kv * H // nh, H)
    t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"], t[p + "mlp.down_proj.weight"] = w(I, H), w(I, H), w(H, I)
hdr, off, blobs = {}, 0, []
for k in sorted(t):
    b = t[k].astype(np.float32).tobytes()
    hdr[k] = dict(dtype="F32", shape=list(t[k].shape), data_offsets=[off, off + len(b)])
    off, blobs = off + len(b), blobs + [b]
hdr["__metadata__"] = {"format": "pt"}
h = json.dumps(hdr).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(f"{out}/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PY
for i in $(seq "$R"); do
  for blocks in "" "checkpoint_blocks = [0, 1, 2, 3, 4, 5, 6, 7]"; do
    cat > "$dir/job.toml" <<TOML
[model]
hf = "$dir"
$blocks
[data]
text = "$(realpath data/tinyshakespeare.txt)"
batch_size = 8
seq = 128
eval_fraction = 0.01
[optim]
kind = "adamw"
lr = 0.001
[train]
steps = 12
log_every = 12
eval_every = 0
TOML
    $K launch -n 2 -- $K train --config "$dir/job.toml" 2>&1 | grep -E '^\[rank 0\] (step 12/12 loss|heap)' \
      | sed "s/^/checkpointed=$([ -n "$blocks" ] && echo yes || echo no) | /"
  done
done
