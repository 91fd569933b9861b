"""The planner's single-device cost model checked on a GPU it was not fitted to (issue #37): GPT
shapes trained by transformers' GPT2LMHeadModel (SDPA attention) under torch eager, bf16
autocast with f32 master weights and fused AdamW, sequence 2048, random tokens; each shape's
step time over steps 4..13 (CUDA-synchronised), tokens/s, model TFLOP/s (Narayanan et al.'s
count, the planner's: 72 b s l h^2 (1 + s/6h + V/12lh)) and peak memory. Prints one JSON line
per shape; bench/gpu/planner_check.sh puts them beside `kolo plan --evaluate` for the same
shape on the dgx-h100 preset.

    python bench/gpu/planner_check.py [OUT.jsonl]
"""
import json
import sys
import time

import torch
import transformers

SHAPES = [  # (name, layers, hidden, heads, micro-batch)
    ("gpt-350m", 24, 1024, 16, 8),
    ("gpt-760m", 24, 1536, 16, 8),
    ("gpt-1.3b", 24, 2048, 16, 8),
    ("gpt-2.7b", 32, 2560, 32, 4),
]
SEQ, VOCAB = 2048, 50257
out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, transformers.__version__, flush=True)
for name, l, h, a, b in SHAPES:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=l, n_embd=h, n_head=a, n_positions=SEQ, vocab_size=VOCAB,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, VOCAB, (b, SEQ), device=dev)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(14):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step_s = sum(times[4:]) / len(times[4:])
    flops = 72 * b * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (12 * l * h))
    row = {
        "shape": name, "layers": l, "hidden": h, "heads": a, "micro_batch": b, "seq": SEQ,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "step_s": step_s,
        "tokens_per_s": b * SEQ / step_s, "model_tflops": flops / step_s / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item(),
    }
    print(json.dumps(row), flush=True)
    if out:
        out.write(json.dumps(row) + "\n")
    del model, opt, ids, loss
    torch.cuda.empty_cache()
