"""The planner's one-device cost model checked on a GPU it was not fitted to (issue #37):
decoder-only shapes trained by transformers under torch eager (SDPA attention, bf16 autocast
with f32 master weights, fused AdamW, random tokens), each shape's step time over steps
4..N (CUDA-synchronised), tokens/s, model TFLOP/s and peak memory, and the memory left after an
optimizer step (parameters and Adam's moments). Two families:

- `gpt`: GPT-2 shapes of the GPT-3 family (session 19), sequence 2048;
- `llama`: Llama-3.2-1B/3B, Qwen2.5-0.5B (as a Llama: no q/k/v biases) and a Mixtral-style
  mixture of experts, sequence 2048, each at two micro-batch sizes (the difference of the two
  peaks is the activations of the extra sequences, apart from the model states), one with
  gradient checkpointing (full recomputation).

Prints one JSON line per run; docs/benchmarks.md sets them beside `kolo plan --evaluate` for the
same shape, predicted before the run.

    python bench/gpu/planner_check.py FAMILY [OUT.jsonl]    # FAMILY: gpt, llama or tiny (CPU)
"""
import json
import sys
import time

import torch
import transformers

SEQ = 2048
# (name, family, config, micro-batches, gradient checkpointing)
GPT = [
    (f"gpt-{n}", "gpt2", dict(n_layer=l, n_embd=h, n_head=a, vocab_size=50257), [b], False)
    for n, l, h, a, b in [
        ("350m", 24, 1024, 16, 8),
        ("760m", 24, 1536, 16, 8),
        ("1.3b", 24, 2048, 16, 8),
        ("2.7b", 32, 2560, 32, 4),
    ]
]


def llama(layers, hidden, heads, kv, ffn, vocab, tied):
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied)


LLAMA = [
    ("llama-3.2-1b", "llama", llama(16, 2048, 32, 8, 8192, 128256, True), [2, 4], False),
    ("qwen2.5-0.5b", "llama", llama(24, 896, 14, 2, 4864, 151936, True), [4, 8], False),
    ("llama-3.2-3b", "llama", llama(28, 3072, 24, 8, 8192, 128256, True), [1, 2], False),
    ("llama-3.2-1b", "llama", llama(16, 2048, 32, 8, 8192, 128256, True), [4, 8], True),
    ("mixtral-1.5b", "mixtral", dict(llama(16, 1024, 16, 8, 3584, 32000, False), num_local_experts=8,
                                      num_experts_per_tok=2), [4, 8], False),
]
TINY = [
    ("tiny-llama", "llama", llama(2, 64, 4, 2, 128, 256, True), [1, 2], False),
    ("tiny-llama", "llama", llama(2, 64, 4, 2, 128, 256, True), [1, 2], True),
    ("tiny-mixtral", "mixtral", dict(llama(2, 64, 4, 2, 96, 256, False), num_local_experts=4,
                                     num_experts_per_tok=2), [2], False),
    ("tiny-gpt", "gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256), [2], False),
]


def build(family, cfg, seq):
    if family == "gpt2":
        c = transformers.GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg)
        return transformers.GPT2LMHeadModel(c), c
    if family == "llama":
        c = transformers.LlamaConfig(max_position_embeddings=seq, **cfg)
        return transformers.LlamaForCausalLM(c), c
    c = transformers.MixtralConfig(max_position_embeddings=seq, router_aux_loss_coef=0.0, **cfg)
    return transformers.MixtralForCausalLM(c), c


def run(model, opt, ids, steps, sync, cuda, times):
    """Trains `steps` steps, appending each step's seconds to `times`, then the last loss and the
    bytes allocated after the first step (parameters and Adam's moments; gradients freed)."""
    states = 0
    for step in range(steps):
        sync()
        t = time.perf_counter()
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
        if step == 0 and cuda:
            states = torch.cuda.memory_allocated()
    times += [loss, states]


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "gpt"
    shapes = {"gpt": GPT, "llama": LLAMA, "tiny": TINY}[which]
    out = open(sys.argv[2], "w") if len(sys.argv) > 2 else None
    cuda = which != "tiny"
    dev = torch.device("cuda" if cuda else "cpu")
    seq, steps = (SEQ, 14) if cuda else (32, 6)
    name_of_device = torch.cuda.get_device_name() if cuda else "cpu"
    print(name_of_device, torch.__version__, transformers.__version__, flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, family, cfg, micro_batches, ckpt in shapes:
        for b in micro_batches:
            torch.manual_seed(0)
            with dev:
                model, c = build(family, cfg, seq)
            c._attn_implementation = "sdpa"
            model = model.to(dev).train()
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
            ids = torch.randint(0, c.vocab_size, (b, seq), device=dev)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, states = [], 0
            try:
                run(model, opt, ids, steps, sync, cuda, times)
            except torch.cuda.OutOfMemoryError:
                print(json.dumps({"shape": name, "micro_batch": b, "checkpointing": ckpt, "oom": True}), flush=True)
                del model, opt, ids
                torch.cuda.empty_cache()
                continue
            states, loss = times.pop(), times.pop()
            step_s = sum(times[4:]) / len(times[4:])
            row = {
                "shape": name, "family": family, "config": cfg, "micro_batch": b, "seq": seq,
                "checkpointing": ckpt, "device": name_of_device, "torch": torch.__version__,
                "transformers": transformers.__version__,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "step_s": step_s,
                "tokens_per_s": b * seq / step_s,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "states_gib": states / 2**30, "loss": loss.item(),
            }
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            del model, opt, ids, loss
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
