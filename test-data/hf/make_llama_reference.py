"""Regenerates test-data/hf/llama-tiny, Kolo's reference for Llama-style models.

A LlamaForCausalLM of a small configuration (RMSNorm, rotary position embeddings, SwiGLU MLP,
grouped-query attention: 4 query heads sharing 2 key/value heads, untied output projection),
built offline by `transformers` from a fixed seed, with noise (std 0.3) added to every parameter
so that every layer matters to the logits; saved with `save_pretrained`, and its logits on fixed
token ids in reference.safetensors ("ids" int64, "logits" f32).

    python test-data/hf/make_llama_reference.py [OUT_DIR] [135m]

With `135m` the model has the shape of a published Llama-architecture model, SmolLM-135M
(vocabulary 49152, 30 layers of 576, 9 query heads sharing 3 key/value heads, SwiGLU of 1536,
tied input and output embeddings: 135M parameters, 540 MB, not shipped: bench/hf_interop.sh
makes it in /tmp), with noise of std 0.02 (30 noisy layers amplify f32 rounding).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import transformers
from reference_common import save_reference

out = sys.argv[1] if len(sys.argv) > 1 else "test-data/hf/llama-tiny"
torch.manual_seed(0)
noise = 0.3
if sys.argv[2:] == ["135m"]:
    cfg, noise = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    ), 0.02
else:
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
model = transformers.LlamaForCausalLM(cfg).eval()
save_reference(model, cfg, out, noise)
