"""torch's tensor parallelism on a Hugging Face Llama, beside Kolo's (issue #32 item 6): the
model directory's LlamaForCausalLM (eager attention) with every block's q, k, v, gate and up
projections ColwiseParallel and o and down RowwiseParallel (torch.distributed.tensor.parallel,
Megatron's layout, as torchtitan's plan without loss parallelism: the embedding, the tied output
layer and the norms stay whole) over a tp mesh of every rank, on gloo (CPU). Every rank trains
on the same G windows of T tokens (fixed seed), AdamW 1e-3 with the norm clipped to 1.0, for
STEPS steps. Rank 0 prints the loss at the last step, the mean ms/step of steps 6..STEPS and
every rank's peak resident memory.

    torchrun --nproc_per_node 3 bench/torch_tp_llama.py MODEL_DIR [G] [T] [STEPS]
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_common import clip, report  # noqa: E402

model_dir = sys.argv[1]
G, T, steps = (int(a) for a in (sys.argv[2:] + ["3", "64", "10"][len(sys.argv) - 2:])[:3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
plan = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(), "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
for layer in model.model.layers:
    parallelize_module(layer, mesh, plan)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
vocab = model.config.vocab_size

ids = torch.randint(0, vocab, (G, T + 1), generator=torch.Generator().manual_seed(0))
times = []
for step in range(1, steps + 1):
    t0 = time.perf_counter()
    logits = model(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    # The split projections' squares summed over the group, the whole layers' counted once
    # (clip_grad_norm_ refuses a model that is partly DTensor).
    clip(model.parameters(), 1.0, split=lambda g: isinstance(g, torch.distributed.tensor.DTensor))
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
report(f"torch tp {world}: loss at step {steps} {loss.item():.4f}", times, steps)
dist.destroy_process_group()
