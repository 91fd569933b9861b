"""Checks a model that Kolo exported (the hf_finetune example's --out directory) in `transformers`:
config.json's dtype is the dtype of every tensor written (one file or the shards of
model.safetensors.index.json), AutoModelForCausalLM.from_pretrained loads it (in float32, so that
a bf16 export is compared on its own values rather than bf16 arithmetic), and its logits on the
ids of kolo_logits.safetensors equal the logits Kolo computed from the same files. Exit status 1
when a dtype disagrees or the logits differ by more than 1e-4.

    python test-data/hf/check_export.py OUT_DIR
"""
import json
import os
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

out = sys.argv[1]
config = json.load(open(f"{out}/config.json"))
index = f"{out}/model.safetensors.index.json"
files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
dtypes = set()
for f in files:
    with safe_open(f"{out}/{f}", "pt") as st:
        dtypes |= {str(st.get_slice(k).get_dtype()) for k in st.keys()}
names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
written = {names.get(d, d) for d in dtypes}
if written != {config.get("dtype")}:
    print(f"{out}: config.json says dtype {config.get('dtype')}, the files hold {sorted(written)}")
    sys.exit(1)
model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
ref = load_file(f"{out}/kolo_logits.safetensors")
with torch.no_grad():
    logits = model(ref["ids"]).logits
diff = (logits - ref["logits"]).abs().max().item()
print(f"{out}: {len(files)} file(s) of {config.get('dtype')}; transformers {transformers.__version__} loads it; "
      f"its logits differ from Kolo's by {diff:.2e} (max |logit| {logits.abs().max().item():.2f})")
sys.exit(0 if diff < 1e-4 else 1)
