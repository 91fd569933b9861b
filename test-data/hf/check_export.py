"""Checks a model (GPT-2 or Llama) that Kolo exported (the hf_finetune example's --out directory) in `transformers`:
AutoModelForCausalLM.from_pretrained loads it, and its logits on the ids of kolo_logits.safetensors
equal the logits Kolo computed there. Exit status 1 when they differ by more than 1e-4.

    python test-data/hf/check_export.py OUT_DIR
"""
import sys

import torch
import transformers
from safetensors.torch import load_file

out = sys.argv[1]
model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
ref = load_file(f"{out}/kolo_logits.safetensors")
with torch.no_grad():
    logits = model(ref["ids"]).logits
diff = (logits - ref["logits"]).abs().max().item()
print(f"{out}: transformers {transformers.__version__} loads it; its logits differ from Kolo's by {diff:.2e} (max |logit| {logits.abs().max().item():.2f})")
sys.exit(0 if diff < 1e-4 else 1)
