"""torch eager on the GPU, the peers' GPT (peerbench_models.GPT: d_model 256, 4 heads, 4
layers, seq 128, vocab 65), AdamW lr 1e-3, fixed synthetic batch: the reference for Kolo's
`train.device = "cuda"` step time on the same machine.  Usage: torch_gpt.py BATCH [STEPS]."""
import sys, time
import torch
import peerbench_models as pm

batch = int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
torch.manual_seed(0)
net = pm.GPT().cuda()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
x = torch.randint(0, 65, (batch, 128), device="cuda")
y = torch.randint(0, 65, (batch, 128), device="cuda")
times = []
for i in range(steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = net(x)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, 65), y.reshape(-1))
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
tail = sorted(times[steps // 2:])
ms = tail[len(tail) // 2] * 1e3
print(f"torch cuda gpt batch {batch}: {ms:.2f} ms/step (median of the second half), {batch * 128 / ms * 1e3:.0f} tokens/s, loss {loss.item():.4f}")
