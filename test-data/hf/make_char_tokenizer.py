"""Writes tokenizer.json into the tiny Hugging Face models of test-data/hf: a character-level
tokenizer (each character of data/tinyshakespeare.txt is a token; `<unk>` for the others and
`<|endoftext|>` between documents: 67 tokens, within the models' vocabulary of 96), made with
Hugging Face `tokenizers` so that `kolo data prepare --tokenizer DIR` and the fine-tuning job
read it as they read a real model's.

    python test-data/hf/make_char_tokenizer.py
"""
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

chars = sorted(set(open("data/tinyshakespeare.txt", encoding="utf-8").read()))
vocab = {"<unk>": 0, "<|endoftext|>": 1} | {c: i + 2 for i, c in enumerate(chars)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
tok.decoder = decoders.Fuse()
tok.add_special_tokens(["<|endoftext|>"])
for name in ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "mistral-tiny", "llama3-tiny", "mixtral-tiny"]:
    tok.save(f"test-data/hf/{name}/tokenizer.json")
enc = tok.encode("First Citizen:\nBefore we proceed")
assert tok.decode(enc.ids) == "First Citizen:\nBefore we proceed", tok.decode(enc.ids)
print(f"{len(vocab)} tokens; 'First Citizen:' -> {enc.ids[:14]}")
