"""Regenerates test-data/hf/gpt2-tiny, Kolo's reference for loading Hugging Face GPT-2 weights.

A GPT2LMHeadModel of a small configuration, built offline by `transformers` from a fixed seed;
every parameter gets extra noise (std 0.3; 0.05 at the 124M shape) so that layer norms, attention and the MLP all
matter to the logits (the default initialisation leaves the norms at 1 and 0 and the logits
near zero). It is saved with `save_pretrained` (config.json, model.safetensors), and its
logits on fixed token ids go to reference.safetensors ("ids" int64, "logits" f32).

    python test-data/hf/make_gpt2_reference.py [OUT_DIR] [124m]

With `124m` the model has GPT-2's real shape (vocab 50257, 1024 positions, 12 layers of 768,
12 heads; 500 MB, not shipped: bench/hf_interop.sh makes it in /tmp).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import transformers
from reference_common import save_reference

out = sys.argv[1] if len(sys.argv) > 1 else "test-data/hf/gpt2-tiny"
torch.manual_seed(0)
noise = 0.3
if sys.argv[2:] == ["124m"]:
    cfg, noise = transformers.GPT2Config(), 0.05  # 12 noisy layers amplify f32 rounding (0.3: 5e-3 in torch's own f32 vs f64)
else:
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=2, n_head=4, bos_token_id=95, eos_token_id=95)
model = transformers.GPT2LMHeadModel(cfg).eval()
save_reference(model, cfg, out, noise)
