"""What bench/torch_tp_llama.py and bench/torch_pp_llama.py share: clipping whose squares are
summed over the ranks that hold different pieces, and the closing report."""
import resource

import torch
import torch.distributed as dist


def clip(params, max_norm, split=lambda g: True):
    """Scales the gradients of `params` so that their global norm is at most `max_norm`: the
    squares of the gradients `split` says are this rank's own piece are summed over every rank,
    the others (held whole on every rank) counted once, as Megatron's clipping does."""
    grads = [p.grad for p in params if p.grad is not None]
    own, whole = torch.zeros(()), torch.zeros(())
    for g in grads:
        if split(g):
            own += (g.to_local() if isinstance(g, torch.distributed.tensor.DTensor) else g).pow(2).sum()
        else:
            whole += g.pow(2).sum()
    dist.all_reduce(own)
    coef = min(1.0, max_norm / ((own + whole).sqrt().item() + 1e-6))
    for g in grads:
        g.mul_(coef)


def report(label, times, steps):
    """Collective: rank 0 prints `label`, the mean ms/step of steps 6..steps and every rank's
    peak resident memory."""
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6])
    all_rss = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rss, rss)
    if dist.get_rank() == 0:
        late = times[5:] or times
        print(f"{label}: {1e3 * sum(late) / len(late):.0f} ms/step (steps 6..{steps}), "
              f"peak RSS per rank {' / '.join(f'{r.item():.2f}' for r in all_rss)} GB, torch {torch.__version__}")
