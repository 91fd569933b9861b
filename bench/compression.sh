#!/usr/bin/env bash
# Gradient compression and Local SGD on the GPT (bench/gpt.toml), N ranks (default 2), on links
# shaped by bench/netem.sh (root): step time and bytes per step for each method at each rate.
#   [N=4] bash bench/compression.sh [RATES...]      (default: 100mbit 1gbit)
source "$(dirname "$0")/shaped.sh"
methods=(
  "none|"
  "powersgd r1|compression = { method = \"powersgd\", rank = 1, warmup_steps = 2 }"
  "powersgd r4|compression = { method = \"powersgd\", rank = 4, warmup_steps = 2 }"
  "fp16|compression = { method = \"fp16\", warmup_steps = 2 }"
  "topk 1%|compression = { method = \"topk\", fraction = 0.01, warmup_steps = 2 }"
  "sign|compression = { method = \"sign\", warmup_steps = 2 }"
  "local SGD H=4|local_sgd = { every = 4, warmup_steps = 2 }"
)
shaped_all "done|gradient" "${methods[@]}"
