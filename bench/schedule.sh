#!/usr/bin/env bash
# Scheduled communication (ByteScheduler, `[ddp] schedule`) against plain DDP on the GPT
# (bench/gpt.toml), N ranks (default 2), on links shaped by bench/netem.sh (root): step time
# and how much of the communication the next forward pass hid.
#   [N=2] bash bench/schedule.sh [RATES...]      (default: 100mbit 1gbit)
source "$(dirname "$0")/shaped.sh"
modes=(
  "plain DDP (buckets 25 MiB, first 1 MiB)|"
  "plain DDP (buckets 1 MiB)|bucket_cap = \"1MiB\""
  "scheduled 256 KiB chunks, credit 1 MiB|schedule = { chunk = \"256KiB\", credit = \"1MiB\" }"
  "scheduled 1 MiB chunks, credit 4 MiB|schedule = { chunk = \"1MiB\", credit = \"4MiB\" }"
)
shaped_all "done" "${modes[@]}"
