"""What the reference makers of test-data/hf share: noise on every parameter (so that every layer
matters to the logits), `save_pretrained`, and the logits on fixed token ids (2 x 16, seed 1)
in reference.safetensors ("ids" int64, "logits" f32)."""
import torch
import transformers
from safetensors.torch import save_file


def save_reference(model, cfg, out, noise, extra=None, ids_below=None):
    """`extra(model, ids)`, when given, returns more tensors for reference.safetensors; the ids
    are below `ids_below` (default the vocabulary's size)."""
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(out, safe_serialization=True)
    ids = torch.randint(0, ids_below or cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    tensors = {"ids": ids.to(torch.int64), "logits": logits.float().contiguous()}
    if extra is not None:
        with torch.no_grad():
            tensors |= extra(model, ids)
    save_file(tensors, f"{out}/reference.safetensors")
    print(f"{out}: logits {tuple(logits.shape)}, max |logit| {logits.abs().max().item():.3f}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
