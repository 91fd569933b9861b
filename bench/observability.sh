#!/usr/bin/env bash
# What watching a run costs: the benchmark GPT (bench/gpt.toml) on 2 ranks, 30 steps, with
# nothing on, with the Prometheus endpoint + TensorBoard event files + JSON-lines log (logging
# every step), and with the Chrome timeline; runs alternate, R repetitions, median of each. The
# flight recorder is always on: its cost per collective comes from `kolo bench recorder`.
#   bash bench/observability.sh [reps]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "# observability overhead: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
base() { sed 's/^steps = 14/steps = 30/' bench/gpt.toml > "$dir/$1.toml"; }
base off
base metrics; sed -i -e "s#^\[train\]#[train]\nmetrics_port = 29650\ntensorboard_dir = \"$dir/tb\"\njson_log = \"$dir/log.jsonl\"#" -e 's/^log_every = .*/log_every = 1/' "$dir/metrics.toml"
base timeline; sed -i "s#^\[train\]#[train]\ntimeline_dir = \"$dir/tl\"#" "$dir/timeline.toml"
declare -A all=([off]= [metrics]= [timeline]=)
for rep in $(seq "$R"); do
  for v in off metrics timeline; do
    ms=$($K launch -n 2 -- $K train --config "$dir/$v.toml" 2>&1 | grep -o '[0-9.]* ms/step (second half)' | grep -o '^[0-9.]*')
    all[$v]="${all[$v]} $ms"
  done
done
med() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
off=$(med "${all[off]}")
for v in off metrics timeline; do
  m=$(med "${all[$v]}")
  awk -v v="$v" -v m="$m" -v o="$off" -v s="${all[$v]}" 'BEGIN { printf "%-9s %7.1f ms/step (median of%s), %+.1f%% vs off\n", v, m, s, (m / o - 1) * 100 }'
done
$K bench recorder
