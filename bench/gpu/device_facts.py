"""The facts the planner's device description holds, measured on this GPU (issue #37): bf16
GEMM TFLOP/s of square n x n x n products (the efficiency curve), the bandwidth an elementwise
kernel reaches (a + b over 1 GiB), the cost of one eager kernel launch (a stream of tiny
in-place adds), and how many kernels one Llama decoder layer launches forward and backward
under bf16 autocast with SDPA (transformers' LlamaDecoderLayer at Llama-3.2-1B's shape, 4 x 2048
tokens), with the layer's own time: what a per-layer fixed cost of an eager runtime is made of.
Prints one JSON line per fact.

    python bench/gpu/device_facts.py [OUT.jsonl]
"""
import json
import sys
import time

import torch
import transformers

out = open(sys.argv[1], "w") if len(sys.argv) > 1 else None
dev = torch.device("cuda")


def emit(row):
    print(json.dumps(row), flush=True)
    if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def timed(f, reps):
    f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__})
for n in [256, 512, 1024, 2048, 4096, 8192, 16384]:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    s = timed(lambda: a @ b, max(3, int(2e11 / n**3)))
    emit({"gemm_n": n, "tflops": 2 * n**3 / s / 1e12})
x = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
y = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
s = timed(lambda: x + y, 20)
emit({"elementwise": "a + b, 1 GiB bf16 each", "gb_per_s": 3 * x.numel() * 2 / s / 1e9})
del x, y
tiny = torch.zeros(1, device=dev)


def launches():
    for _ in range(1000):
        tiny.add_(1)


emit({"launch_us": timed(launches, 5) / 1000 * 1e6})

cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                               num_hidden_layers=1, vocab_size=128256, max_position_embeddings=2048)
cfg._attn_implementation = "sdpa"
with dev:
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, 0)
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
hidden = torch.randn(4, 2048, 2048, device=dev, requires_grad=True)
pos = torch.arange(2048, device=dev).unsqueeze(0)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        emb = rope(hidden, pos)
        out = layer(hidden, position_embeddings=emb, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()


layer_s = timed(step, 10)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
emit({"llama_layer": "Llama-3.2-1B decoder layer, 4 x 2048 tokens, forward + backward", "seconds": layer_s,
      "cuda_kernels": len(kernels),
      "kernel_seconds": sum(getattr(e, "device_time_total", 0.0) for e in kernels) / 1e6})
