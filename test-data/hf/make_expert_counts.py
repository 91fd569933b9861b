"""Writes DIR/expert_counts.safetensors for a Hugging Face MoE model whose gate returns
(router_logits, topk_weights, topk_indices) (DeepSeek-V3): `counts`, (sparse layers, experts),
how many of each layer's top-k choices named each expert when `transformers` runs the ids of
DIR/reference.safetensors without their last token (the inputs of Kolo's next-token loss on
those ids). Kolo's selection-bias update (`kolo::ep::update_expert_bias`) is checked against it.

    python test-data/hf/make_expert_counts.py test-data/hf/deepseek-v3-tiny
"""
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

d = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
ids = load_file(f"{d}/reference.safetensors")["ids"].long()[:, :-1]
experts = model.config.n_routed_experts
counts = []


def record(_module, _inputs, out):
    counts.append(torch.bincount(out[2].flatten(), minlength=experts).float())


for layer in model.model.layers:
    gate = getattr(layer.mlp, "gate", None)
    if hasattr(gate, "e_score_correction_bias"):
        gate.register_forward_hook(record)
with torch.no_grad():
    model(ids)
save_file({"counts": torch.stack(counts).contiguous()}, f"{d}/expert_counts.safetensors")
print(torch.stack(counts))
