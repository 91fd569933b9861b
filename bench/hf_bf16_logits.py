# The tiny Hugging Face models of test-data/hf in f32 and bf16 (eager attention) under
# transformers: each one's largest logit difference from its f32 reference. Kolo's side of the
# comparison is `hf_finetune --precision bf16`'s "logits differ from transformers' reference" line
# (docs/benchmarks.md, "Hugging Face models in bf16").
import os, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
for m in ["llama-tiny","qwen2-tiny","gemma-tiny","mixtral-tiny","gpt2-tiny","neox-tiny","phi3-tiny"]:
    d=f"{root}/test-data/hf/{m}"
    ref=load_file(d+"/reference.safetensors")
    ids=ref["ids"].long()
    out=[]
    for dt in [torch.float32, torch.bfloat16]:
        model=AutoModelForCausalLM.from_pretrained(d, dtype=dt, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            l=model(ids).logits.float()
        out.append((l-ref["logits"]).abs().max().item())
    print(m, "torch f32 %.2e  torch bf16 %.2e" % tuple(out))
