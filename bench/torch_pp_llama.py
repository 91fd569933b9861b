"""torch's pipeline parallelism on a Hugging Face Llama, beside Kolo's (issue #32 item 6): the
model directory's LlamaForCausalLM (eager attention, an untied output layer) cut into one stage
per rank by the same block costs Kolo uses (multiply-adds per token, the output layer's on the
last block), each stage a module of its blocks (the first with the embedding, the last with the
norm and the output layer), run by torch.distributed.pipelining's Schedule1F1B over M
micro-batches on gloo. The ranks train on G windows of T tokens (fixed seed), AdamW 1e-3 with
the norm clipped to 1.0 (the squares summed over the stages), for STEPS steps. Rank 0 prints the
mean ms/step of steps 6..STEPS and every rank's peak resident memory.

    torchrun --nproc_per_node 2 bench/torch_pp_llama.py MODEL_DIR [G] [T] [STEPS] [M]
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_common import clip, report  # noqa: E402

model_dir = sys.argv[1]
G, T, steps, M = (int(a) for a in (sys.argv[2:] + ["2", "64", "10", "2"][len(sys.argv) - 2:])[:4])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
cfg = model.config
n = cfg.num_hidden_layers
# Kolo's cut (LlamaConfig::block_costs with kolo-pipe's partition): contiguous runs of nearly
# equal cost, the last block carrying the output layer.
e, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
block = e * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * e * cfg.intermediate_size
costs = [block] * n
costs[-1] += e * cfg.vocab_size
total, cuts, acc = sum(costs), [0], 0.0
for i, c in enumerate(costs):
    acc += c
    if len(cuts) < world and acc >= total * len(cuts) / world:
        cuts.append(i + 1)
cuts.append(n)
first, last = rank == 0, rank == world - 1


class Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = model.model.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(model.model.layers[cuts[rank]:cuts[rank + 1]])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if first else x
        t = h.shape[1]
        pos = torch.arange(t).unsqueeze(0)
        pe = self.rotary(h, pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return self.head(self.norm(h)) if last else h


stage_mod = Stage()
del model
stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
schedule = Schedule1F1B(stage, M, loss_fn=loss_fn)
opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, foreach=False)
ids = torch.randint(0, cfg.vocab_size, (G, T + 1), generator=torch.Generator().manual_seed(0))
times = []
for step in range(1, steps + 1):
    t0 = time.perf_counter()
    if first:
        schedule.step(ids[:, :-1])
    elif last:
        schedule.step(target=ids[:, 1:])
    else:
        schedule.step()
    clip(stage_mod.parameters(), 1.0)  # each stage's own parameters, squares summed over the stages
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
report(f"torch pp {world} (1F1B, {M} micro-batches, blocks {cuts})", times, steps)
dist.destroy_process_group()
