"""The torch side of bench/hf_speed.sh (issue #17 item 5): a Hugging Face causal language model (AutoModelForCausalLM) from
MODEL_DIR (config.json + model.safetensors, the same files Kolo loads) trained with AdamW
(lr 1e-3, clipping at 1.0) under torch DDP on gloo, one thread per rank, on random tokens of
batch x seq per rank. Prints tokens/s over the steps after the first WARMUP, summed over ranks.

    python bench/torch_hf_ddp.py MODEL_DIR WORLD BATCH SEQ STEPS [WARMUP]
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers


def rank_main(rank, world, model_dir, batch, seq, steps, warmup, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    vocab = (model.module if world > 1 else model).config.vocab_size
    times = []
    for step in range(steps):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        t0 = time.perf_counter()
        # The standard use: labels = the inputs, which transformers shifts by one itself.
        inp = x[:, :-1]
        out = model(input_ids=inp, labels=inp)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step + 1}/{steps} loss {out.loss.item():.4f} {times[-1] * 1e3:.0f} ms", flush=True)
    if rank == 0:
        t = sum(times[warmup:]) / len(times[warmup:])
        print(f"torch {torch.__version__} gloo, {world} rank(s): {t * 1e3:.0f} ms/step, {world * batch * seq / t:.0f} tok/s "
              f"(batch {batch} x seq {seq} per rank, steps {warmup + 1}..{steps})", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, world, batch, seq, steps = sys.argv[1], *map(int, sys.argv[2:6])
    warmup = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    port = 29500 + os.getpid() % 1000
    if world == 1:
        rank_main(0, 1, model_dir, batch, seq, steps, warmup, port)
    else:
        mp.spawn(rank_main, args=(world, model_dir, batch, seq, steps, warmup, port), nprocs=world)
